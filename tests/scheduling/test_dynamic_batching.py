"""Algorithm 1: the switch happens exactly when the ratio crosses alpha, and back below beta;
merged steps run the merged adapter alone, or (mixed) B_fcfs."""

from __future__ import annotations

import pytest

from dlora.scheduling import BatchingConfig, DLoRAPolicy, Mode, Switch, check_decision
from dlora.scheduling.dynamic_batching import (
    build_queues,
    dynamic_batching,
    merge_candidate,
    starvation_batch,
)
from tests.scheduling.simlib import req, reqs

ALL = lambda adapter: True  # noqa: E731  every adapter eligible


def mix(a_count: int, total: int = 10) -> list:
    """a_count requests for A (oldest first), the rest on distinct adapters o0, o1, ..."""
    return reqs([("A", a_count)] + [(f"o{i}", 1) for i in range(total - a_count)])


def test_queues_order_fcfs_and_ratio_is_bounded_by_max_batch():
    rs = [req("late", "A", 5.0), req("b", None, 1.0), req("a2", "A", 2.0), req("a1", "A", 2.0)]
    q = build_queues(rs, max_batch=3)
    assert [r.req_id for r in q.ordered] == ["b", "a1", "a2", "late"]  # arrival, then id
    assert [r.req_id for r in q.fcfs] == ["b", "a1", "a2"]
    assert q.ratio("A") == 1.0  # min(3 A requests, max_bs 3) / |B_fcfs| 3
    assert [r.req_id for r in q.merged_batch("A")] == ["a1", "a2", "late"]


@pytest.mark.parametrize("a_count, merges", [(5, False), (6, True), (10, True), (1, False)])
def test_unmerged_to_merged_exactly_above_alpha(a_count, merges):
    q = build_queues(mix(a_count), max_batch=10)
    step = dynamic_batching(q, Mode.UNMERGED, None, alpha=0.5, beta=0.3, eligible=ALL)
    assert q.ratio("A") == a_count / 10
    if merges:
        assert (step.mode, step.merged_adapter) == (Mode.MERGED, "A")
        assert [r.adapter for r in step.batch] == ["A"] * a_count
    else:  # ratio 0.5 is not > 0.5
        assert (step.mode, step.batch) == (Mode.UNMERGED, q.fcfs)


@pytest.mark.parametrize("a_count, stays", [(3, True), (2, False)])
def test_merged_to_unmerged_exactly_below_beta(a_count, stays):
    q = build_queues(mix(a_count), max_batch=10)
    step = dynamic_batching(q, Mode.MERGED, "A", alpha=0.5, beta=0.3, eligible=ALL)
    if stays:  # ratio 0.3 is not < 0.3
        assert (step.mode, step.merged_adapter, len(step.batch)) == (Mode.MERGED, "A", 3)
    else:
        assert (step.mode, step.merged_adapter, step.batch) == (Mode.UNMERGED, None, q.fcfs)


def test_merged_unmerges_when_adapter_has_no_requests_or_is_not_eligible():
    q = build_queues(mix(8), max_batch=10)
    gone = dynamic_batching(q, Mode.MERGED, "Z", 0.5, 0.3, ALL)
    assert gone.mode is Mode.UNMERGED
    broke = dynamic_batching(q, Mode.MERGED, "A", 0.5, 0.3, lambda a: a != "A")
    assert broke.mode is Mode.UNMERGED and broke.batch == q.fcfs


def test_ratio_uses_the_group_bounded_by_max_batch():
    # 12 A requests then 4 others, max_bs 8: B_fcfs is 8 A's; ratio = min(12, 8) / 8 = 1.
    q = build_queues(reqs([("A", 12), ("B", 4)]), max_batch=8)
    assert q.ratio("A") == 1.0 and q.ratio("B") == 0.5
    step = dynamic_batching(q, Mode.UNMERGED, None, 0.9, 0.5, ALL)
    assert step.merged_adapter == "A" and len(step.batch) == 8


def test_base_model_is_never_merged():
    q = build_queues(reqs([(None, 9), ("A", 1)]), max_batch=10)
    assert merge_candidate(q, ALL) == "A"
    step = dynamic_batching(q, Mode.UNMERGED, None, 0.05, 0.01, ALL)
    assert step.merged_adapter == "A" and [r.adapter for r in step.batch] == ["A"]
    only_base = build_queues(reqs([(None, 4)]), max_batch=10)
    assert merge_candidate(only_base, ALL) is None
    assert dynamic_batching(only_base, Mode.UNMERGED, None, 0.05, 0.01, ALL).mode is Mode.UNMERGED


def test_candidate_is_largest_eligible_group_ties_to_older():
    rs = [req("b1", "B", 0.0), req("a1", "A", 1.0), req("b2", "B", 2.0), req("a2", "A", 3.0), req("c1", "C", 4.0)]
    q = build_queues(rs, 10)
    assert merge_candidate(q, ALL) == "B"  # tie 2-2, B's oldest is older
    assert merge_candidate(q, lambda a: a != "B") == "A"
    assert merge_candidate(q, lambda a: False) is None


def test_starvation_batch_serves_starving_first_and_fills_fcfs():
    rs = reqs([("A", 6), ("X", 2)])  # X arrives last
    q = build_queues(rs, max_batch=4)
    step = starvation_batch(q, {"X"}, Mode.UNMERGED, None)
    assert [r.req_id for r in step.batch] == ["X-0", "X-1", "A-0", "A-1"]
    assert [r.req_id for r in step.priority] == ["X-0", "X-1"] and step.mode is Mode.UNMERGED
    assert starvation_batch(q, {"nobody"}, Mode.UNMERGED, None) is None
    # merged on A and only A starving: stays merged with A's requests only
    stay = starvation_batch(q, {"A"}, Mode.MERGED, "A")
    assert stay.mode is Mode.MERGED and {r.adapter for r in stay.batch} == {"A"}
    # merged on A and X starving: the starvation step runs unmerged
    assert starvation_batch(q, {"X"}, Mode.MERGED, "A").mode is Mode.UNMERGED


def roomy(**kw) -> BatchingConfig:
    """Credits that never bind and no merge planner, so the test sees Alg. 1 alone."""
    base = dict(
        merge_planner=False, alpha=0.5, beta=0.3, initial_credit=100.0, t_starve=1000.0, t_normal=500.0, max_batch=10
    )
    return BatchingConfig(**{**base, **kw})


def test_policy_switches_at_the_documented_ratios_over_time():
    p = DLoRAPolicy(roomy())
    trace = []
    for step, a_count in enumerate([5, 6, 6, 4, 3, 2, 5, 6]):
        rs = mix(a_count)
        d = p.decide(rs, now=step * 0.01)
        check_decision(d, rs, 10, mixed=True)
        trace.append((d.mode.value, d.switch.value))
    assert trace == [
        ("unmerged", "none"),  # 0.5 not > alpha
        ("merged", "merge"),  # 0.6 > 0.5
        ("merged", "none"),
        ("merged", "none"),  # 0.4 not < beta
        ("merged", "none"),  # 0.3 not < 0.3
        ("unmerged", "unmerge"),  # 0.2 < 0.3
        ("unmerged", "none"),
        ("merged", "merge"),
    ]
    assert p.snapshot().num_switches == 3


def test_while_merged_only_the_merged_adapter_runs():
    p = DLoRAPolicy(roomy(mixed_merged=False))
    rs = mix(7) + [req("base-x", None, 0.5)]
    d = p.decide(rs, now=0.0)
    assert d.mode is Mode.MERGED and d.switch is Switch.MERGE
    assert {r.adapter for r in rs if r.req_id in d.allowed_req_ids} == {"A"}
    check_decision(d, rs, 10)


# A-0 (t 0), base (0.5), B-0 (1), A-1 .. A-4 (2 .. 5); max_bs 5: B_fcfs = A-0 base B-0 A-1 A-2,
# ratio(A) = min(5, 5) / 5 = 1.
SKEWED = [req("A-0", "A", 0.0), req("base", None, 0.5), req("B-0", "B", 1.0)] + [
    req(f"A-{i}", "A", 1.0 + i) for i in range(1, 5)
]


def test_mixed_merged_step_runs_b_fcfs_in_fcfs_order():
    q = build_queues(SKEWED, max_batch=5)
    mixed = dynamic_batching(q, Mode.UNMERGED, None, 0.5, 0.3, ALL, mixed=True)
    assert (mixed.mode, mixed.merged_adapter) == (Mode.MERGED, "A")
    assert [r.req_id for r in mixed.batch] == ["A-0", "base", "B-0", "A-1", "A-2"]
    assert mixed.priority is None  # B_fcfs ran: no credit transfer
    alone = dynamic_batching(q, Mode.UNMERGED, None, 0.5, 0.3, ALL)
    assert [r.req_id for r in alone.batch] == ["A-0", "A-1", "A-2", "A-3", "A-4"]
    stay = dynamic_batching(q, Mode.MERGED, "A", 0.5, 0.3, ALL, mixed=True)
    assert (stay.mode, stay.batch) == (Mode.MERGED, q.fcfs)


def test_mixed_policy_allows_others_while_merged_and_keeps_the_switch_rules():
    p = DLoRAPolicy(roomy(max_batch=5, mixed_merged=True))
    d = p.decide(SKEWED, now=0.0)
    assert (d.mode, d.merged_adapter, d.switch) == (Mode.MERGED, "A", Switch.MERGE)
    assert d.allowed_req_ids == ("A-0", "base", "B-0", "A-1", "A-2")
    check_decision(d, SKEWED, 5, mixed=True)
    with pytest.raises(ValueError, match="merged weights"):
        check_decision(d, SKEWED, 5)  # only a mixing engine may run them
    # done: B_fcfs = base B-0 A-3 A-4, ratio 2/4 = 0.5 >= beta: stays merged, all run
    rest = [r for r in SKEWED if r.req_id not in ("A-0", "A-1", "A-2")]
    d = p.decide(rest, now=0.1)
    assert (d.mode, d.switch, d.allowed_req_ids) == (Mode.MERGED, Switch.NONE, ("base", "B-0", "A-3", "A-4"))
    # only A-4 left of A: ratio 1/3 < beta 0.4 -> UNMERGE, B_fcfs unmerged
    p.thresholds.beta = 0.4
    d = p.decide(rest[:2] + rest[3:], now=0.2)
    assert (d.mode, d.switch, d.allowed_req_ids) == (Mode.UNMERGED, Switch.UNMERGE, ("base", "B-0", "A-4"))


def test_mixed_alg2_alternative_is_the_fcfs_batch():
    # Unmerged (0.6 not > alpha 0.9): the merged batch Alg. 2 prices is R_A (6), or mixed B_fcfs (10).
    for mixed, alternative in ((False, 6), (True, 10)):
        p = DLoRAPolicy(roomy(alpha=0.9, mixed_merged=mixed))
        assert p.decide(mix(6), now=0.0).mode is Mode.UNMERGED
        assert p._sample == (Mode.UNMERGED, alternative, "A")
