import random

import pytest

from dlora.cluster.estimators.held_work import draw_remaining
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.simulated_gain import simulated_gain
from tests.cluster.balancer_factories import make_replica, make_request

# A step costs 10 ms whatever its batch, a prompt token 1 ms, two requests run at once: the
# completion times below are worked by hand.
P = CostParams(per_iteration_s=0.01, per_decode_token_s=0.0, per_prefill_token_s=0.001, max_batch=2)
PARAMS = {0: P, 1: P}


def no_lengths(adapter):
    return []


def busy_replica(context_of_b: int):
    """Replica 0 runs a and b (100 tokens left each) with c and d queued (10-token prompts, 100
    tokens each); replica 1 is empty.

    Without moves: a, b end at 1.0 s; c, d prefill 20 tokens and end at 2.02 s: 6.04 s in all.
    Moving b to replica 1: a and c run together and end at 1.01 s, d at 2.02 s (4.04 s); b
    re-prefills its context there and ends at 1.0 + context/1000 s."""
    b_prompt = context_of_b - 50
    reqs = [
        make_request("a", prompt=10, output=0, expected=100, running=True, arrival=0),
        make_request("b", prompt=b_prompt, output=50, expected=150, running=True, arrival=0),
        make_request("c", prompt=10, expected=100, arrival=1),
        make_request("d", prompt=10, expected=100, arrival=2),
    ]
    return [make_replica(0, reqs), make_replica(1)]


def test_moving_a_running_request_pays_when_its_recompute_is_shorter_than_the_wait_it_saves():
    gain = simulated_gain(busy_replica(500), [("b", 0, 1)], PARAMS, no_lengths, draws=4)
    assert gain.median_s == pytest.approx(6.04 - (4.04 + 1.5)) and gain.worth_it


def test_a_move_whose_recompute_costs_more_than_it_saves_is_refused():
    gain = simulated_gain(busy_replica(2000), [("b", 0, 1)], PARAMS, no_lengths, draws=4)
    assert gain.median_s == pytest.approx(6.04 - (4.04 + 3.0)) and not gain.worth_it


def test_a_moved_request_joins_the_receivers_queue_in_arrival_order_and_delays_later_arrivals():
    src = [
        make_request("a", prompt=10, expected=100, running=True, arrival=0),
        make_request("b", prompt=450, output=50, expected=150, running=True, arrival=0),
    ]
    dst = [
        make_request("x", prompt=10, expected=100, running=True, arrival=3),
        make_request("y", prompt=10, expected=100, arrival=5),
    ]
    views = [make_replica(0, src), make_replica(1, dst)]
    gain = simulated_gain(views, [("b", 0, 1)], PARAMS, no_lengths, draws=1)
    # Before: replica 0: a and b end at 1.0 (2.0 in all); replica 1: x runs, y takes the second
    # slot at once (10-token prefill): both end at 1.01 (2.02). 4.02 in all.
    # After: replica 0: a at 1.0. Replica 1: b arrived before y, so it takes the slot beside x;
    # both end at 0.5 (b's 500-token prefill) + 1.0 = 1.5; then y at 1.5 + 0.01 + 1.0 = 2.51.
    # 1.0 + 1.5 + 1.5 + 2.51 = 6.51: the move costs 2.49 s.
    assert gain.median_s == pytest.approx(4.02 - 6.51)


def test_remaining_lengths_are_drawn_from_observed_lengths_longer_than_what_was_generated():
    r = make_request("r", output=30, expected=60, running=True)
    rng = random.Random(0)
    draws = {draw_remaining(r, [10, 20, 40, 90], rng) for _ in range(200)}
    assert draws == {10, 60}  # 40 - 30 and 90 - 30; 10 and 20 are already passed
    assert draw_remaining(r, [10, 20, 30], rng) == 30  # nothing longer seen: the expected remainder


def test_the_drawn_lengths_decide_a_close_call():
    # The same move as the first test, with b's remaining output drawn instead of expected: when
    # b is likely to end soon, moving it (and re-prefilling) is not worth it.
    def lengths(adapter):
        return [51] * 9 + [1000]  # b has 50 tokens: mostly 1 token left

    gain = simulated_gain(busy_replica(500), [("b", 0, 1)], PARAMS, lengths, draws=9, seed=1)
    assert not gain.worth_it


def test_no_moves_no_gain():
    gain = simulated_gain(busy_replica(500), [], PARAMS, no_lengths, draws=16)
    assert gain.median_s == 0 and gain.draws == 0 and not gain.worth_it
