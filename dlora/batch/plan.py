"""Stage planning for a batch over many adapters: SamuLLM's greedy stages, mapped to dLoRA.

SamuLLM plans offline multi-model work in stages: it samples every request's output length,
estimates what each candidate (model, execution plan) would take with a calibrated step-cost
model, and fills each stage greedily with the candidate that adds the most throughput; a stage
ends when its first model finishes, and the freed resources get the next choice. Here a model is
an adapter, a resource is a replica, and an execution plan is the replica's weight mode:

- merged: one adapter folded into the base weights, alone on the replica; its steps cost
  `merged_ratio` of an unmerged step, but only its own requests fill the batch;
- unmerged: adapters too small to fill a batch alone, sharing the replica, taken adapter by
  adapter so a running batch spans few of them (the base model's requests join either way).

A segment's throughput is its work over its estimated time, work counted in unmerged full-batch
seconds (the router's per-token price), so a large adapter merged scores about 1/merged_ratio, a
mix about 1, and a small adapter alone far less (its batch never fills and drains on its longest
request). Segments are sized like guided self-scheduling: at most the work left over the number
of replicas, never less than one full batch, so the first segments are long, the last ones short,
and the replicas end together. When a segment ends, its replica takes the best next one; the
other replicas keep running theirs (SamuLLM without preemption).

A segment starts on its replica once the previous one has drained: a merged adapter's last
requests would otherwise share steps with the next segment's and run unmerged (two segments in
the same mode in a row are one segment). Plan repair, when the measured run departs from the
plan, is the runner's (`dlora/batch/planned.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from dlora.batch.predict import RequestWork, dispatch, simulate_replica
from dlora.cluster.estimators.replica_cost import CostParams

MERGED = "merged"
UNMERGED = "unmerged"
# Adapters whose merged segment is scored at each choice: the ones with the most work left. A
# smaller adapter fills fewer steps merged, so it never scores above them; bounding the candidates
# keeps a choice O(candidates x segment) at 256 adapters.
CANDIDATES = 8


@dataclass(frozen=True)
class PlannedLine:
    """One batch line as the planner sees it: its engine requests' prompt sizes and sampled output
    lengths (a line with n > 1 or several prompts makes several requests, placed together)."""

    adapter: str | None
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Segment:
    """Jobs run back to back on one replica in one weight mode."""

    replica: int  # an index into the planner's params
    mode: str  # MERGED or UNMERGED
    adapter: str | None  # the adapter a merged segment folds in (None: the base model alone)
    jobs: tuple[int, ...]  # indices into the planned jobs, in run order
    start_s: float
    end_s: float  # estimated


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]
    makespan_s: float
    staged: bool = True  # False: every job sent at once (`dispatch_plan`)

    def queues(self, replicas: int) -> list[list[int]]:
        """Each replica's jobs in the order they are to start."""
        out: list[list[int]] = [[] for _ in range(replicas)]
        for seg in sorted(self.segments, key=lambda s: (s.replica, s.start_s)):
            out[seg.replica].extend(seg.jobs)
        return out


def job_work(job: PlannedLine, p: CostParams) -> float:
    """Seconds of unmerged engine time the job costs at a full batch (the planner's unit of work)."""
    per_token = p.per_decode_token_s + p.per_iteration_s / p.max_batch
    return sum(job.prompts) * p.per_prefill_token_s + sum(job.outputs) * per_token


def estimate_s(jobs: Sequence[PlannedLine], p: CostParams, merged: bool) -> float:
    """A segment's time without simulating it: prefills, one step per output token of a full batch
    (or of all its requests, when fewer), and at least as many steps as its longest output."""
    prompts = sum(sum(j.prompts) for j in jobs)
    outputs = [o for j in jobs for o in j.outputs]
    if not outputs:
        return 0.0
    width = min(len(outputs), p.max_batch)
    steps = max(sum(outputs) / width, max(outputs))
    t = prompts * p.per_prefill_token_s + steps * p.per_iteration_s + sum(outputs) * p.per_decode_token_s
    return t * (p.merged_ratio if merged else 1.0)


def simulate_s(jobs: Sequence[PlannedLine], p: CostParams) -> float:
    """A queue's time on one replica by the step simulation (merged steps where one adapter runs)."""
    prompts = [s for j in jobs for s in j.prompts]
    outputs = [o for j in jobs for o in j.outputs]
    adapters = [j.adapter for j in jobs for _ in j.outputs]
    return max(simulate_replica(prompts, outputs, p, adapters), default=0.0)


class _Pending:
    """The jobs not planned yet, per adapter in first-appearance order, with their work."""

    def __init__(self, jobs: Sequence[PlannedLine], work: Sequence[float]) -> None:
        self.by_adapter: dict[str | None, list[int]] = {}
        for i, job in enumerate(jobs):
            self.by_adapter.setdefault(job.adapter, []).append(i)
        self.work = work
        self.left = {a: sum(work[i] for i in ids) for a, ids in self.by_adapter.items()}

    def total(self) -> float:
        return sum(self.left.values())

    def take(self, adapter: str | None, cap: float) -> list[int]:
        """The adapter's next jobs, up to `cap` work (at least one)."""
        out: list[int] = []
        w = 0.0
        for i in self.by_adapter[adapter]:
            if out and w + self.work[i] > cap:
                break
            out.append(i)
            w += self.work[i]
        return out

    def mix(self, cap: float) -> list[int]:
        """Jobs of the adapters with the least work left, adapter by adapter, up to `cap` work."""
        out: list[int] = []
        w = 0.0
        for adapter in sorted(self.left, key=lambda a: self.left[a]):
            for i in self.by_adapter[adapter]:
                if out and w + self.work[i] > cap:
                    return out
                out.append(i)
                w += self.work[i]
        return out

    def remove(self, chosen: Sequence[int], jobs: Sequence[PlannedLine]) -> None:
        gone = set(chosen)
        for a in {jobs[i].adapter for i in chosen}:
            self.by_adapter[a] = [i for i in self.by_adapter[a] if i not in gone]
            self.left[a] = sum(self.work[i] for i in self.by_adapter[a])
            if not self.by_adapter[a]:
                del self.by_adapter[a], self.left[a]


def plan_stages(
    jobs: Sequence[PlannedLine], params: Sequence[CostParams], busy_s: Sequence[float] | None = None
) -> Plan:
    """The segments each replica runs, chosen greedily by throughput as replicas come free (each
    first after `busy_s`, the seconds it needs for what it holds already; 0 by default)."""
    if not params:
        raise ValueError("no replica to plan for")
    reference = params[0]
    work = [job_work(j, reference) for j in jobs]
    pending = _Pending(jobs, work)
    full_batch = reference.max_batch * sum(work) / max(1, len(work))  # a segment's least work
    busy = list(busy_s) if busy_s is not None else [0.0] * len(params)
    free = [(busy[r], r) for r in range(len(params))]  # (when the replica's last segment ends, replica)
    heapq.heapify(free)
    segments: list[Segment] = []
    last: dict[int, Segment] = {}  # each replica's latest segment
    while pending.left:
        start, r = heapq.heappop(free)
        p = params[r]
        cap = max(pending.total() / len(params), full_batch)
        mode, adapter, chosen = _best_segment(pending, jobs, p, cap)
        pending.remove(chosen, jobs)
        prev = last.get(r)
        if prev is not None and (prev.mode, prev.adapter) == (mode, adapter):  # the same mode goes on
            segments.remove(prev)
            chosen, start = list(prev.jobs) + chosen, prev.start_s
        seg = Segment(r, mode, adapter, tuple(chosen), start, start + simulate_s([jobs[i] for i in chosen], p))
        segments.append(seg)
        last[r] = seg
        heapq.heappush(free, (seg.end_s, r))
    return Plan(tuple(segments), max([s.end_s for s in segments] + busy))


def _best_segment(pending: _Pending, jobs: Sequence[PlannedLine], p: CostParams, cap: float):
    """(mode, adapter, jobs) of the candidate with the best throughput: a merged segment of one of
    the adapters with the most work left, or a mix of the smallest ones."""
    mix = pending.mix(cap)
    alone = {jobs[i].adapter for i in mix}
    best = (
        (_throughput(mix, jobs, pending.work, p, merged=True), MERGED, alone.pop(), mix)
        if len(alone) == 1
        else (_throughput(mix, jobs, pending.work, p, merged=False), UNMERGED, None, mix)
    )
    for adapter in sorted(pending.left, key=lambda a: -pending.left[a])[:CANDIDATES]:
        chosen = pending.take(adapter, cap)
        score = _throughput(chosen, jobs, pending.work, p, merged=True)
        if score > best[0]:
            best = (score, MERGED, adapter, chosen)
    _, mode, adapter, chosen = best
    return mode, adapter, chosen


def _throughput(
    chosen: Sequence[int], jobs: Sequence[PlannedLine], work: Sequence[float], p: CostParams, merged: bool
) -> float:
    t = estimate_s([jobs[i] for i in chosen], p, merged)
    return sum(work[i] for i in chosen) / t if t > 0 else float("inf")


def dispatch_plan(
    jobs: Sequence[PlannedLine],
    params: Sequence[CostParams],
    busy_s: Sequence[float] | None = None,
    held: Sequence[Sequence[PlannedLine]] | None = None,
) -> Plan:
    """Every job sent at once, each to the replica with the least work so far (the router's own
    dispatch, which counts what each replica holds: `busy_s`): one unmerged segment per replica,
    its steps merged only where one adapter runs. With `held` (each replica's requests, as
    `held_jobs.held_jobs` orders them), a replica's jobs are simulated in one queue behind them:
    its engine starts them as the held ones free their slots, in the same batches. Without it,
    they run after `busy_s`, back to back, which errs late by the held requests' tail."""
    busy = list(busy_s) if busy_s is not None else [0.0] * len(params)
    sizes = [RequestWork(j.adapter, sum(j.prompts), 0) for j in jobs]
    replica_of = dispatch(sizes, [sum(j.outputs) for j in jobs], params, busy)
    segments = []
    for r, p in enumerate(params):
        mine = tuple(i for i, q in enumerate(replica_of) if q == r)
        if mine:
            queue = [jobs[i] for i in mine]
            end = simulate_s([*held[r], *queue], p) if held is not None else busy[r] + simulate_s(queue, p)
            segments.append(Segment(r, UNMERGED, None, mine, busy[r], end))
    return Plan(tuple(segments), max([s.end_s for s in segments] + busy), staged=False)


def choose_plan(
    jobs: Sequence[PlannedLine],
    params: Sequence[CostParams],
    busy_s: Sequence[float] | None = None,
    min_gain: float = 0.0,
    held: Sequence[Sequence[PlannedLine]] | None = None,
) -> Plan:
    """The stage plan if it is predicted more than `min_gain` (a fraction) sooner than sending
    everything at once; else sending at once (adapters too small to merge, merging not cheaper on
    these replicas, or a gain too small to be worth the stage boundaries' tails). A stage plan
    starts after `busy_s` (its first segment waits for the replica to drain); sending at once
    runs alongside `held` when given (`dispatch_plan`)."""
    staged, flat = plan_stages(jobs, params, busy_s), dispatch_plan(jobs, params, busy_s, held)
    return staged if staged.makespan_s < (1 - min_gain) * flat.makespan_s else flat
