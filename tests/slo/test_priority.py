"""SeaLLM's doubling-budget priority: budgets mu + sigma, doubling when used up; O_r = Q_r * mu_a."""

from __future__ import annotations

import pytest

from dlora.cluster.estimators.output_lengths import OutputLengthConfig, OutputLengthEstimator, length_stats
from dlora.scheduling.types import RequestView
from dlora.slo.priority import (
    LengthStats,
    budget_level,
    order_requests,
    priority,
    remaining_budget,
    sort_key,
)

CHAT = LengthStats(mean=100, std=20)  # Q_0 = 120
CODE = LengthStats(mean=30, std=10)  # Q_0 = 40


def view(rid: str, adapter: str | None, arrival: float, generated: int, prompt: int = 10) -> RequestView:
    return RequestView(rid, adapter, arrival, prompt, prompt + generated, generated, running=generated > 0)


def test_length_stats_are_mean_and_population_std():
    s = LengthStats.of([80, 120])  # deviations +-20
    assert (s.mean, s.std) == (100, 20)
    assert LengthStats.of([50]) == LengthStats(50, 0)
    with pytest.raises(ValueError):
        LengthStats.of([])
    with pytest.raises(ValueError, match="LengthStats.std"):
        LengthStats(100, -1)


def test_budget_doubles_each_time_it_is_used_up():
    # budgets 120, 240, 480, 960: used up after 120, 120+240 = 360, 360+480 = 840 tokens
    starts = [0, 120, 360, 840]
    assert [remaining_budget(g, CHAT) for g in starts] == [120, 240, 480, 960]
    assert [budget_level(g, CHAT) for g in starts] == [0, 1, 2, 3]
    # one token before each budget ends, a single token of it is left
    assert [remaining_budget(g - 1, CHAT) for g in starts[1:]] == [1, 1, 1]
    assert [budget_level(g - 1, CHAT) for g in starts[1:]] == [0, 1, 2]
    assert remaining_budget(200, CHAT) == 360 - 200


def test_priority_is_remaining_budget_times_the_adapters_mean():
    assert priority(0, CHAT) == 120 * 100  # 12,000
    assert priority(35, CODE) == (40 - 35) * 30  # 150
    assert priority(45, CODE) == (120 - 45) * 30  # second budget (40..120): 75 left -> 2,250


def test_hand_worked_order_of_four_requests():
    reqs = [
        view("A", "chat", arrival=0.0, generated=0),  # Q 120 -> O = 120 * 100 = 12,000
        view("B", "code", arrival=1.0, generated=35),  # Q 40 - 35 = 5 -> O = 5 * 30 = 150
        view("C", "code", arrival=2.0, generated=45),  # budget 2 ends at 120: Q 75 -> O = 2,250
        view("D", "chat", arrival=3.0, generated=110),  # Q 120 - 110 = 10 -> O = 1,000
    ]
    ordered = order_requests(reqs, {"chat": CHAT, "code": CODE}, default=CHAT)
    assert [r.req_id for r in ordered] == ["B", "D", "C", "A"]  # FCFS would be A, B, C, D


def test_a_request_that_uses_up_its_budget_sinks_behind_a_fresh_one():
    fresh = view("fresh", "chat", arrival=5.0, generated=0)  # O = 12,000
    almost = view("old", "chat", arrival=0.0, generated=119)  # Q 1 -> O = 100
    assert [r.req_id for r in order_requests([fresh, almost], {"chat": CHAT}, CHAT)] == ["old", "fresh"]
    spent = view("old", "chat", arrival=0.0, generated=120)  # new budget 240 -> O = 24,000
    assert [r.req_id for r in order_requests([fresh, spent], {"chat": CHAT}, CHAT)] == ["fresh", "old"]


def test_ties_go_in_arrival_order_then_request_id_and_unknown_adapters_use_the_default():
    reqs = [view("z", "chat", 2.0, 0), view("y", "chat", 1.0, 0), view("x", "chat", 1.0, 0)]
    assert [r.req_id for r in order_requests(reqs, {"chat": CHAT}, CHAT)] == ["x", "y", "z"]
    # "new" has no profile yet: the default CODE profile makes it O = 40 * 30 = 1,200 < 12,000
    mixed = [view("c", "chat", 0.0, 0), view("n", "new", 9.0, 0)]
    assert [r.req_id for r in order_requests(mixed, {"chat": CHAT}, default=CODE)] == ["n", "c"]
    assert sort_key(3.0, 0, CODE, "n") == (1200, 3.0, "n")


def test_empty_profile_still_orders_by_arrival():
    zero = LengthStats(0, 0)  # budget and weight floored at one token
    assert (zero.initial_budget, zero.weight) == (1, 1)
    assert remaining_budget(0, zero) == 1 and remaining_budget(1, zero) == 2  # budgets 1, 2, 4, ...
    reqs = [view("late", None, 2.0, 0), view("early", None, 1.0, 0)]
    assert [r.req_id for r in order_requests(reqs, {}, zero)] == ["early", "late"]


def test_length_stats_from_the_output_length_estimator():
    est = OutputLengthEstimator(OutputLengthConfig(window=16, min_samples=2))
    est.observe("a", 80)
    est.observe("a", 120)
    est.observe("b", 500)
    prior = LengthStats(64, 0)
    assert length_stats(est, "a", prior) == LengthStats(100, 20)
    assert length_stats(est, "b", prior) == prior  # one sample, fewer than min_samples
    assert length_stats(est, "unseen", prior) == prior
