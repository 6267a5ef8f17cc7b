import dataclasses
import random

import pytest

from dlora.batch.held_jobs import held_jobs
from dlora.batch.plan import PlannedLine, simulate_s
from dlora.cluster.estimators.held_work import draw_remaining, planning_lengths
from dlora.cluster.estimators.output_lengths import LengthHistory
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.estimators.survival import UNBOUNDED
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
    assert jobs == [PlannedLine("a", (0,), (50,)), PlannedLine("a", (200,), (30,)), PlannedLine("a", (100,), (50,))]
    # "run" and "early" (200-token prefill, 0.2 s) share the first steps; "early" ends after 30
    # steps (0.5 s), "late" takes its slot (0.1 s prefill) and runs 50 steps (0.5 s): 1.1 s;
    # "run" ended at 0.7 s.
    assert simulate_s(jobs, P) == pytest.approx(1.1)
    assert held_jobs([], lambda a: []) == []


def test_a_running_requests_remaining_output_is_drawn_from_longer_observed_lengths():
    run = make_request("run", prompt=0, output=40, expected=41, running=True)
    # Only 100 is longer than the 40 generated: 60 steps left, whatever the seed.
    assert [held_jobs([run], lambda a: [100, 5, 10], seed=s) for s in range(5)] == [[PlannedLine("a", (0,), (60,))]] * 5


def test_running_requests_are_censored_at_what_they_have_generated():
    history = LengthHistory({"a": ((10, True), (20, True), (300, False))})  # two stops and one cap hit
    running = [
        make_request("r1", "a", output=150, expected=300, running=True),
        make_request("q", "a", output=0, expected=100),  # generated nothing: says nothing yet
    ]
    # 4 at risk at 10 (one ends: 3/4 left), 3 at 20 (one ends: 1/2 left); r1 and the cap hit are
    # only known to be longer: that half runs past anything seen to end.
    assert planning_lengths(history, running) == {"a": [10] * 64 + [20] * 64 + [UNBOUNDED] * 128}


def test_an_adapter_with_little_history_pools_every_adapters_finished_and_running_requests():
    history = LengthHistory({"a": ((4, True),) * 3, "c": ()}, pooled=((4, True),) * 3 + ((6, True),), min_samples=3)
    running = [make_request(f"b{i}", "b", output=30, expected=60, running=True) for i in range(4)]
    lengths = planning_lengths(history, running)
    assert lengths["a"] == [4] * 256  # its own three: the long-running b's say nothing about a
    # b and c have too few of their own: the pooled four that finished and b's four running. Left
    # out, the running half would make every line as short as the early stops.
    assert lengths["b"] == lengths["c"] == [4] * 96 + [6] * 32 + [UNBOUNDED] * 128


def test_an_unbounded_draw_runs_a_request_to_its_cap():
    rng = random.Random(0)
    capped = dataclasses.replace(make_request("r", output=30, expected=60, running=True), max_tokens=100)
    draws = {draw_remaining(capped, [10, 40, UNBOUNDED], rng) for _ in range(200)}
    assert draws == {10, 70}  # 40 - 30, and the cap 100 - 30
    uncapped = make_request("u", output=30, expected=60, running=True)  # cap not known: its expected remainder
    assert {draw_remaining(uncapped, [10, UNBOUNDED], rng) for _ in range(20)} == {30}
