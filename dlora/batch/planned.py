"""Running a batch by its stage plan: each replica's segments in order, repaired as the run goes.

The plan (dlora/batch/plan.py) comes from the lines' prompt sizes, output lengths drawn from each
adapter's history, and the replicas' fitted step costs. In a `stages` plan a line starts on the
replica its segment names (the router sends it there unless that replica stopped serving), at
most `per_replica` lines at a time per replica, and a segment starts once the replica's previous
segment has drained, so a merged adapter's batch is not joined by other adapters' requests. A
`dispatch` plan (sending every line at once was predicted as fast) names no replica: its lines
start in input order and the router places each one as it would an unplanned line, on the load
it sees then rather than on drawn lengths. Lines take their places from the shared gate either
way, so batch work keeps yielding to online traffic.

Repair: the plan rests on drawn lengths and fitted costs, and the run departs from it. A replica
that runs out of segments takes the last unstarted segment of the replica with the most work
left, or, when that replica has nothing queued behind its current segment, the back half of the
current segment's unstarted lines; the replicas end together whichever prediction was off.

Re-planning: a plan made before the replicas' step costs were fitted rests on priors. Once they
are measured (`BatchPlanner.costs_measured`), the lines not started yet are planned once more,
and the run follows the new plan (a replica whose next segment continues its current one in the
same mode goes on without draining).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine
from dlora.batch.plan import Plan, PlannedLine, choose_plan, job_work, simulate_s
from dlora.batch.predict import RequestWork, sample_lengths
from dlora.batch.runner import Execute, line_choices, run_lines
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.router import preferred_replica

ANY_REPLICA = -1  # the queue key of a `dispatch` plan: its lines go wherever the router sends them


@dataclass
class QueuedSegment:
    """A segment's lines not started yet (its replica takes them from the front, a thief from the back)."""

    mode: str
    adapter: str | None
    lines: deque[BatchLine]
    work: dict[int, float]  # line number -> its planned work (seconds), for choosing whom to relieve

    def left(self) -> float:
        return sum(self.work[line.line] for line in self.lines)


@dataclass
class LinePlan:
    """A plan over batch lines, by replica id."""

    queues: dict[int, deque[QueuedSegment]]  # by replica id, or one queue under ANY_REPLICA
    predicted_s: float
    mode: str  # "stages", or "dispatch" when sending every line at once was predicted as fast
    per_replica: int  # lines in flight per replica
    segments: int = field(default=0)
    measured_costs: bool = False  # priced by the replicas' fitted step costs, not the priors


def line_plan(
    lines: Sequence[BatchLine],
    works: Sequence[Sequence[RequestWork]],
    params: dict[int, CostParams],
    lengths_of: Callable[[str | None], Sequence[int]],
    per_replica: int,
    seed: int = 0,
    held: Mapping[int, Sequence[PlannedLine]] | None = None,
    min_stage_gain: float = 0.0,
) -> LinePlan:
    """Plan `lines` (whose engine requests are `works`, line by line) over the replicas `params`
    prices, each holding `held` already (replica id -> its requests as `held_jobs.held_jobs`
    gives them; none if absent); staged only when that is predicted more than `min_stage_gain`
    sooner than sending at once."""
    flat = [w for ws in works for w in ws]
    drawn = iter(sample_lengths(flat, lengths_of, random.Random(seed)))
    jobs = [
        PlannedLine(ws[0].adapter if ws else None, tuple(w.prompt_tokens for w in ws), tuple(next(drawn) for _ in ws))
        for ws in works
    ]
    ids = sorted(params)
    holds = [list((held or {}).get(r, ())) for r in ids]
    busy = [simulate_s(h, params[r]) for h, r in zip(holds, ids)]
    plan = choose_plan(jobs, [params[r] for r in ids], busy, min_stage_gain, holds)
    mode = _mode(plan)
    queues = _queues(plan, jobs, lines, ids, params) if mode == "stages" else _one_queue(lines)
    return LinePlan(queues, plan.makespan_s, mode, per_replica, len(plan.segments))


def _mode(plan: Plan) -> str:
    per_replica = Counter(s.replica for s in plan.segments)
    merged = any(s.mode != "unmerged" for s in plan.segments)
    staged = plan.staged and (merged or any(n > 1 for n in per_replica.values()))
    return "stages" if staged else "dispatch"


def _queues(plan: Plan, jobs, lines, ids, params) -> dict[int, deque[QueuedSegment]]:
    queues: dict[int, deque[QueuedSegment]] = {r: deque() for r in ids}
    for seg in sorted(plan.segments, key=lambda s: (s.replica, s.start_s)):
        rid = ids[seg.replica]
        work = {lines[i].line: job_work(jobs[i], params[rid]) for i in seg.jobs}
        queues[rid].append(QueuedSegment(seg.mode, seg.adapter, deque(lines[i] for i in seg.jobs), work))
    return queues


def _one_queue(lines) -> dict[int, deque[QueuedSegment]]:
    """Every line in input order, for the router to place. Its work is never priced: no replica
    relieves this queue (`_Run.next_segment`), which is what segment work is for."""
    work = dict.fromkeys((ln.line for ln in lines), 0.0)
    return {ANY_REPLICA: deque([QueuedSegment("unmerged", None, deque(lines), work)])}


@dataclass(frozen=True)
class Replan:
    """The plan made again on measured step costs: when, and its prediction for the rest."""

    at_s: float  # since the run started
    plan: LinePlan

    @property
    def predicted_end_s(self) -> float:
        return self.at_s + self.plan.predicted_s


class _Run:
    def __init__(self, plan: LinePlan, execute: Execute, gate: BatchGate, on_done, stop) -> None:
        self.plan, self.execute, self.gate, self.on_done, self.stop = plan, execute, gate, on_done, stop
        self.current: dict[int, QueuedSegment | None] = {r: None for r in plan.queues}
        self.workers: dict[int, asyncio.Task] = {}
        self.lines: set[asyncio.Task] = set()
        self.steals = 0

    def start_workers(self) -> None:
        """A worker for every replica that never had one, and again for one whose worker ended
        (it found no work) and has segments queued now."""
        for rid, queue in self.plan.queues.items():
            worker = self.workers.get(rid)
            if worker is None or (worker.done() and queue):
                self.current.setdefault(rid, None)
                self.workers[rid] = asyncio.create_task(self.replica(rid))

    def unstarted(self) -> list[BatchLine]:
        current = [ln for seg in self.current.values() if seg is not None for ln in seg.lines]
        queued = [ln for queue in self.plan.queues.values() for seg in queue for ln in seg.lines]
        return sorted(current + queued, key=lambda ln: ln.line)

    def adopt(self, new: LinePlan) -> None:
        """Run the lines not started yet by `new` (planned from an earlier `unstarted()`: lines
        started since stay where they are). A current segment whose replica's next new segment
        has the same mode and adapter takes that segment's lines; any other current segment
        stops taking lines, drains, and its replica goes on with the new queue."""
        still = {ln.line for ln in self.unstarted()}
        queues: dict[int, deque[QueuedSegment]] = {}
        for rid, queue in new.queues.items():
            kept = (dataclasses.replace(s, lines=deque(x for x in s.lines if x.line in still)) for s in queue)
            queues[rid] = deque(s for s in kept if s.lines)
        for rid, cur in self.current.items():
            if cur is None:
                continue
            follow = queues.get(rid)
            if follow and (follow[0].mode, follow[0].adapter) == (cur.mode, cur.adapter):
                nxt = follow.popleft()
                cur.lines.clear()
                cur.lines.extend(nxt.lines)
                cur.work.update(nxt.work)
            else:
                cur.lines.clear()
        self.plan = dataclasses.replace(new, queues=queues, per_replica=self.plan.per_replica)
        for rid in self.current.keys() - queues.keys():
            self.plan.queues[rid] = deque()  # a replica the new plan leaves out may still relieve others

    def left(self, rid: int) -> float:
        cur = self.current[rid]
        return (cur.left() if cur is not None else 0.0) + sum(s.left() for s in self.plan.queues[rid])

    def next_segment(self, rid: int) -> QueuedSegment | None:
        own = self.plan.queues[rid]
        if own:
            return own.popleft()
        if rid == ANY_REPLICA:
            return None  # a line with no replica named runs wherever the router sends it: none to relieve
        # A dispatch plan's lines are not relieved either: pinning them would undo the router's choice.
        others = [r for r in self.plan.queues if r not in (rid, ANY_REPLICA) and self.left(r) > 0]
        if not others:
            return None
        victim = max(others, key=self.left)
        if self.plan.queues[victim]:
            self.steals += 1
            return self.plan.queues[victim].pop()
        cur = self.current[victim]
        if cur is None or len(cur.lines) < 2:
            return None
        taken = [cur.lines.pop() for _ in range(len(cur.lines) // 2)]
        self.steals += 1
        return QueuedSegment(cur.mode, cur.adapter, deque(reversed(taken)), cur.work)

    async def replica(self, rid: int) -> None:
        # Lines the router places are bounded by the gate alone, as an unplanned batch's are.
        room = asyncio.Semaphore(self.plan.per_replica if rid != ANY_REPLICA else 1 << 30)
        while not self.stop():
            seg = self.current[rid] = self.next_segment(rid)
            if seg is None:
                return
            while seg.lines and not self.stop():
                await self.run_segment(seg, rid, room)
                # drained; lines a new plan added to it meanwhile (same adapter and mode) run first
        self.current[rid] = None

    async def run_segment(self, seg: QueuedSegment, rid: int, room: asyncio.Semaphore) -> None:
        """Start the segment's lines as places free up, then wait for them all (the next segment
        starts on a drained replica)."""
        running: set[asyncio.Task] = set()
        while seg.lines and not self.stop():
            await room.acquire()
            line = seg.lines[0] if seg.lines else None
            choices = 1 if line is None else line_choices(line)
            if not await self.gate.acquire(self.stop, choices):
                room.release()
                break
            if not seg.lines or seg.lines[0] is not line:  # taken by another replica or a new plan meanwhile
                self.gate.release(choices)
                room.release()
                continue
            task = asyncio.create_task(self.one(seg.lines.popleft(), choices, rid, room))
            running.add(task)
            await asyncio.sleep(0)  # with places free, thousands of lines start here: let the loop run between
            self.lines.add(task)
        await asyncio.gather(*running)

    async def one(self, line: BatchLine, choices: int, rid: int, room: asyncio.Semaphore) -> None:
        if rid != ANY_REPLICA:
            preferred_replica.set(rid)  # this task's own context: the router takes its requests to rid
        try:
            output = await self.execute(line)
        finally:
            self.gate.release(choices)
            room.release()
        self.on_done(line, output)


@dataclass(frozen=True)
class PlannedRun:
    repairs: int  # segments moved to another replica
    replan: Replan | None


async def run_planned(
    plan: LinePlan,
    execute: Execute,
    gate: BatchGate,
    on_done: Callable[[BatchLine, dict], None],
    stop: Callable[[], bool] = lambda: False,
    on_tick: Callable[[], None] = lambda: None,
    tick_s: float = 1.0,
    planner: BatchPlanner | None = None,
) -> PlannedRun:
    """`run_lines`' contract (dlora/batch/runner.py) over a plan. With a `planner` and a plan not
    made on measured costs, the unstarted lines are planned again once the costs are measured."""
    run = _Run(plan, execute, gate, on_done, stop)
    run.start_workers()
    started = last_tick = time.monotonic()
    replan: Replan | None = None
    replanned = False
    try:
        while not stop():
            live = {t for t in run.workers.values() if not t.done()}
            if not live:
                break
            done, _ = await asyncio.wait(live, timeout=tick_s)
            for task in done:
                task.result()  # a worker's own failure is the run's
            if time.monotonic() - last_tick < tick_s:
                continue
            last_tick = time.monotonic()
            on_tick()
            if planner is not None and not replanned and not plan.measured_costs and planner.costs_measured():
                replanned = True
                replan = await _replan(run, planner, time.monotonic() - started)
    finally:
        for task in {*run.workers.values(), *run.lines}:
            task.cancel()
        await asyncio.gather(*run.workers.values(), *run.lines, return_exceptions=True)
    return PlannedRun(run.steals, replan)


async def _replan(run: _Run, planner: BatchPlanner, at_s: float) -> Replan | None:
    """Plan the unstarted lines again and run by that plan; None when nothing was left to plan."""
    left = run.unstarted()
    new = await planner.plan(left) if left else None
    if new is None or run.stop():
        return None
    run.adopt(new)
    run.start_workers()
    return Replan(at_s, new)


class BatchPlanner(Protocol):
    def plan(self, lines: Sequence[BatchLine]) -> Awaitable[LinePlan | None]:
        """The plan for the lines, or None to send them as they come."""
        ...

    def costs_measured(self) -> bool:
        """Whether every replica's step costs are fitted from its own steps by now."""
        ...


@dataclass(frozen=True)
class BatchRun:
    """How a batch ran: its plan, and how long running by it took."""

    plan: LinePlan | None
    planned_s: float | None  # measured time from the plan's start to its last line's end
    repairs: int  # segments moved to another replica
    replan: Replan | None = None

    def summary(self) -> str:
        if self.plan is None:
            return ""
        p = self.plan
        measured = "" if self.planned_s is None else f", measured {self.planned_s:.1f} s"
        text = f"plan: {p.mode}, {p.segments} segments, predicted {p.predicted_s:.1f} s{measured}"
        text += f", {self.repairs} repairs"
        if self.replan is not None:
            r = self.replan
            text += (
                f"; planned again at {r.at_s:.1f} s on measured step costs: {r.plan.mode}, "
                f"{r.plan.segments} segments, predicted {r.predicted_end_s:.1f} s in all"
            )
        return text


async def run_batch(
    lines: Sequence[BatchLine],
    execute: Execute,
    gate: BatchGate,
    planner: BatchPlanner | None,
    on_done: Callable[[BatchLine, dict], None],
    stop: Callable[[], bool] = lambda: False,
    on_tick: Callable[[], None] = lambda: None,
    tick_s: float = 1.0,
) -> BatchRun:
    """A batch's lines by the planner's plan, or as they come without a planner or a plan."""
    plan = await planner.plan(lines) if planner is not None and lines else None
    if plan is None:
        await run_lines(lines, execute, gate, on_done, stop, on_tick, tick_s)
        return BatchRun(None, None, 0)
    started = time.monotonic()
    ran = await run_planned(plan, execute, gate, on_done, stop, on_tick, tick_s, planner)
    return BatchRun(plan, None if stop() else time.monotonic() - started, ran.repairs, ran.replan)
