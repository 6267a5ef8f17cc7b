import pytest

from dlora.batch.plan import Job, simulate_s
from dlora.cluster.estimators.cost_model import CostParams
from dlora.cluster.estimators.held_work import held_jobs, with_running
from tests.cluster.balancer_factories import make_request

# A step costs 10 ms whatever its batch (merged or not), a prompt token 1 ms, two requests run at once.
P = CostParams(per_iteration_s=0.01, per_decode_token_s=0.0, per_prefill_token_s=0.001, max_batch=2, merged_ratio=1.0)


def test_held_requests_run_running_first_then_the_queue_in_arrival_order():
    reqs = [
        make_request("late", prompt=100, expected=50, arrival=9),  # queued, arrived last
        make_request("run", prompt=10, output=20, expected=70, running=True, arrival=0),  # 50 left
        make_request("early", prompt=200, expected=30, arrival=1),  # queued
    ]
    # No lengths observed: each runs its expected remainder.
    jobs = held_jobs(reqs, lambda a: [])
    assert jobs == [Job("a", (0,), (50,)), Job("a", (200,), (30,)), Job("a", (100,), (50,))]
    # "run" and "early" (200-token prefill, 0.2 s) share the first steps; "early" ends after 30
    # steps (0.5 s), "late" takes its slot (0.1 s prefill) and runs 50 steps (0.5 s): 1.1 s;
    # "run" ended at 0.7 s.
    assert simulate_s(jobs, P) == pytest.approx(1.1)
    assert held_jobs([], lambda a: []) == []


def test_a_running_requests_remaining_output_is_drawn_from_longer_observed_lengths():
    run = make_request("run", prompt=0, output=40, expected=41, running=True)
    # Only 100 is longer than the 40 generated: 60 steps left, whatever the seed.
    assert [held_jobs([run], lambda a: [100, 5, 10], seed=s) for s in range(5)] == [[Job("a", (0,), (60,))]] * 5


def test_running_requests_add_a_conditioned_draw_to_the_lengths_of_finished_ones():
    finished = {"a": [10, 20, 300]}  # the short ones finished first
    running = [
        make_request("r1", "a", output=150, expected=300, running=True),  # only 300 is longer
        make_request("r2", "b", output=5, expected=40, running=True),  # b: nothing seen, its expected total
        make_request("q", "a", output=0, expected=100),  # generated nothing: says nothing yet
    ]
    assert with_running(finished, running) == {"a": [10, 20, 300, 300], "b": [40]}
    assert finished == {"a": [10, 20, 300]}  # the caller's lists are left as they were
