"""The stage planner: hand-worked plans, the stage rules (a replica takes its next segment when its
last one ends; two segments in one mode are one), and the fallback to sending everything at once."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dlora.batch.plan import MERGED, UNMERGED, PlannedLine, choose_plan, dispatch_plan, plan_stages, simulate_s
from dlora.cluster.estimators.replica_cost import CostParams


def params(it=1.0, dec=0.0, pre=0.0, batch=32, merged=0.5) -> CostParams:
    return CostParams(
        per_iteration_s=it, per_decode_token_s=dec, per_prefill_token_s=pre, max_batch=batch, merged_ratio=merged
    )


def jobs_of(counts: dict[str, int], output: int = 10) -> list[PlannedLine]:
    """`counts` jobs per adapter, interleaved as a batch file would have them."""
    out, left = [], dict(counts)
    while any(left.values()):
        for a in counts:
            if left[a]:
                out.append(PlannedLine(a, (0,), (output,)))
                left[a] -= 1
    return out


def test_two_large_adapters_run_merged_one_per_replica():
    jobs = [PlannedLine(a, (0,), (10,)) for _ in range(32) for a in ("a", "a", "b", "b")]
    p = params()
    plan = plan_stages(jobs, [p, p])
    assert sorted((s.mode, s.adapter) for s in plan.segments) == [(MERGED, "a"), (MERGED, "b")]
    assert {s.replica for s in plan.segments} == {0, 1}
    # 64 jobs at a batch of 32: two rounds of 10 steps at half an unmerged step's cost
    assert plan.makespan_s == pytest.approx(2 * 10 * 0.5)
    # sent at once they mix on both replicas and every step is unmerged: twice as long
    assert dispatch_plan(jobs, [p, p]).makespan_s == pytest.approx(2 * 10 * 1.0)
    assert choose_plan(jobs, [p, p]) == plan
    # predicted 2x sooner: chosen with a margin below half, not with one above
    assert choose_plan(jobs, [p, p], min_gain=0.4) == plan
    assert choose_plan(jobs, [p, p], min_gain=0.6) == dispatch_plan(jobs, [p, p])


def test_small_adapters_share_one_unmerged_batch_adapter_by_adapter():
    jobs = jobs_of({f"a{i}": 2 for i in range(16)})
    plan = plan_stages(jobs, [params()])
    (seg,) = plan.segments
    assert seg.mode == UNMERGED and sorted(seg.jobs) == list(range(32))
    adapters = [jobs[i].adapter for i in seg.jobs]
    assert all(adapters[k] == adapters[k + 1] for k in range(0, 32, 2))  # each adapter's jobs together
    assert plan.makespan_s == pytest.approx(10)  # one batch of 32, unmerged
    # merged one adapter at a time it would take 16 segments of 10 half-cost steps
    assert 16 * 10 * 0.5 > plan.makespan_s


def test_a_replica_takes_its_next_segment_when_its_last_one_ends():
    rng = random.Random(1)
    jobs = [PlannedLine(f"a{rng.choice(range(6))}", (rng.randint(1, 50),), (rng.randint(1, 80),)) for _ in range(600)]
    ps = [params(it=0.01, dec=0.001, pre=0.0001, batch=8), params(it=0.02, dec=0.001, pre=0.0001, batch=8)]
    plan = plan_stages(jobs, ps)
    assert sorted(i for s in plan.segments for i in s.jobs) == list(range(len(jobs)))  # each job once
    for r in range(2):
        mine = sorted((s for s in plan.segments if s.replica == r), key=lambda s: s.start_s)
        assert mine[0].start_s == 0
        for before, after in zip(mine, mine[1:]):
            assert after.start_s == pytest.approx(before.end_s)  # back to back: the stage ended, the next began
            assert (before.mode, before.adapter) != (after.mode, after.adapter)  # else they'd be one segment
        for s in mine:
            assert s.end_s - s.start_s == pytest.approx(simulate_s([jobs[i] for i in s.jobs], ps[r]))
    # the next segment always went to the replica that came free first: no replica idles while
    # another is still to start a segment later than the idle one's end
    ends = {r: max(s.end_s for s in plan.segments if s.replica == r) for r in range(2)}
    last_starts = {r: max(s.start_s for s in plan.segments if s.replica == r) for r in range(2)}
    assert last_starts[0] <= ends[1] and last_starts[1] <= ends[0]
    assert plan.makespan_s == pytest.approx(max(ends.values()))


def test_without_a_merge_discount_everything_is_sent_at_once():
    jobs = jobs_of({"a": 40, "b": 3, "c": 3})
    p = params(merged=1.0)
    plan = choose_plan(jobs, [p, p])
    assert plan == dispatch_plan(jobs, [p, p])
    assert all(s.mode == UNMERGED and s.start_s == 0 for s in plan.segments)


def test_the_plan_beats_sending_at_once_on_skewed_adapters():
    rng = random.Random(0)
    weights = [1 / (k + 1) for k in range(16)]
    jobs = [
        PlannedLine(f"a{rng.choices(range(16), weights)[0]}", (rng.randint(10, 400),), (rng.randint(1, 300),))
        for _ in range(2000)
    ]
    ps = [params(it=0.004, dec=0.001, pre=0.0002, batch=32, merged=0.6)] * 2
    assert plan_stages(jobs, ps).makespan_s < 0.8 * dispatch_plan(jobs, ps).makespan_s


def test_a_replica_busy_with_what_it_holds_starts_its_first_segment_after_it():
    # The test above's two merged adapters, with replica 0 busy for 25 s (the lines of an earlier
    # plan): replica 1 runs both adapters, one after the other (2 x 10 s), and ends first (20 s).
    jobs = [PlannedLine(a, (0,), (10,)) for _ in range(32) for a in ("a", "a", "b", "b")]
    p = params()
    plan = plan_stages(jobs, [p, p], busy_s=[25.0, 0.0])
    assert {s.replica for s in plan.segments} == {1}
    assert [(s.start_s, s.end_s) for s in sorted(plan.segments, key=lambda s: s.start_s)] == [(0, 10), (10, 20)]
    assert plan.makespan_s == 25.0  # what replica 0 holds ends last
    # Sent at once, dispatch counts the held work too (a job is 10 tokens at 1/32 s: 0.3125 s):
    # replica 1 takes the first 80 jobs (25 s), then the two alternate: 104 and 24 jobs.
    flat = dispatch_plan(jobs, [p, p], busy_s=[25.0, 0.0])
    by_replica = {s.replica: s for s in flat.segments}
    assert (len(by_replica[0].jobs), len(by_replica[1].jobs)) == (24, 104)
    assert by_replica[0].start_s == 25.0 and by_replica[1].start_s == 0.0


def test_dispatch_starts_each_replicas_segment_after_what_it_holds():
    jobs = jobs_of({"a": 32, "b": 32})
    p = params(merged=1.0)
    flat = dispatch_plan(jobs, [p, p], busy_s=[3.0, 3.0])
    assert sorted((s.start_s, s.end_s) for s in flat.segments) == [(3.0, 13.0), (3.0, 13.0)]
    assert flat.makespan_s == 13.0


def test_sent_at_once_new_jobs_share_the_batches_of_what_a_replica_holds():
    # One replica, a step 10 ms whatever its batch or mode, nothing else charged. It holds one running
    # request with 100 tokens left (1 s); one new 10-token job. With a free slot the engine runs
    # the two side by side: done at 1 s, not 1.1 s as back to back after the held work.
    p = CostParams(per_iteration_s=0.01, per_decode_token_s=0.0, per_prefill_token_s=0.0, max_batch=2, merged_ratio=1)
    held = [[PlannedLine("h", (0,), (100,))]]
    new = [PlannedLine("a", (0,), (10,))]
    assert dispatch_plan(new, [p], busy_s=[1.0], held=held).makespan_s == pytest.approx(1.0)
    assert dispatch_plan(new, [p], busy_s=[1.0]).makespan_s == pytest.approx(1.1)
    # With one slot the held request keeps it to the end: back to back after all.
    one = dataclasses.replace(p, max_batch=1)
    assert dispatch_plan(new, [one], busy_s=[1.0], held=held).makespan_s == pytest.approx(1.1)


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        plan_stages([PlannedLine("a", (1,), (1,))], [])
