"""Running a batch by its stage plan: each replica's segments in order, repaired as the run goes.

The plan (dlora/batch/plan.py) comes from the lines' prompt sizes, output lengths drawn from each
adapter's history, and the replicas' fitted step costs. A line starts on the replica its segment
names (the router sends it there unless that replica stopped serving), at most `per_replica`
lines at a time per replica, and a segment starts once the replica's previous segment has
drained, so a merged adapter's batch is not joined by other adapters' requests. Lines still take
their places from the shared gate, so batch work keeps yielding to online traffic.

Repair: the plan rests on drawn lengths and fitted costs, and the run departs from it. A replica
that runs out of segments takes the last unstarted segment of the replica with the most work
left, or, when that replica has nothing queued behind its current segment, the back half of the
current segment's unstarted lines; the replicas end together whichever prediction was off.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine
from dlora.batch.plan import Job, Plan, choose_plan, job_work
from dlora.batch.predict import Work, sample_lengths
from dlora.batch.runner import Execute, run_lines
from dlora.cluster.estimators.cost_model import CostParams
from dlora.cluster.router import preferred_replica


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

    queues: dict[int, deque[QueuedSegment]]
    predicted_s: float
    mode: str  # "stages", or "dispatch" when sending every line at once was predicted as fast
    per_replica: int  # lines in flight per replica
    segments: int = field(default=0)


def line_plan(
    lines: Sequence[BatchLine],
    works: Sequence[Sequence[Work]],
    params: dict[int, CostParams],
    lengths_of: Callable[[str | None], Sequence[int]],
    per_replica: int,
    seed: int = 0,
) -> LinePlan:
    """Plan `lines` (whose engine requests are `works`, line by line) over the replicas `params` prices."""
    flat = [w for ws in works for w in ws]
    drawn = iter(sample_lengths(flat, lengths_of, random.Random(seed)))
    jobs = [
        Job(ws[0].adapter if ws else None, tuple(w.prompt_tokens for w in ws), tuple(next(drawn) for _ in ws))
        for ws in works
    ]
    ids = sorted(params)
    plan = choose_plan(jobs, [params[r] for r in ids])
    return LinePlan(
        _queues(plan, jobs, lines, ids, params), plan.makespan_s, _mode(plan), per_replica, len(plan.segments)
    )


def _mode(plan: Plan) -> str:
    staged = any(s.start_s > 0 or s.mode != "unmerged" for s in plan.segments)
    return "stages" if staged else "dispatch"


def _queues(plan: Plan, jobs, lines, ids, params) -> dict[int, deque[QueuedSegment]]:
    queues: dict[int, deque[QueuedSegment]] = {r: deque() for r in ids}
    for seg in sorted(plan.segments, key=lambda s: (s.replica, s.start_s)):
        rid = ids[seg.replica]
        work = {lines[i].line: job_work(jobs[i], params[rid]) for i in seg.jobs}
        queues[rid].append(QueuedSegment(seg.mode, seg.adapter, deque(lines[i] for i in seg.jobs), work))
    return queues


class _Run:
    def __init__(self, plan: LinePlan, execute: Execute, gate: BatchGate, on_done, stop) -> None:
        self.plan, self.execute, self.gate, self.on_done, self.stop = plan, execute, gate, on_done, stop
        self.current: dict[int, QueuedSegment | None] = {r: None for r in plan.queues}
        self.lines: set[asyncio.Task] = set()
        self.steals = 0

    def left(self, rid: int) -> float:
        cur = self.current[rid]
        return (cur.left() if cur is not None else 0.0) + sum(s.left() for s in self.plan.queues[rid])

    def next_segment(self, rid: int) -> QueuedSegment | None:
        own = self.plan.queues[rid]
        if own:
            return own.popleft()
        others = [r for r in self.plan.queues if r != rid and self.left(r) > 0]
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
        room = asyncio.Semaphore(self.plan.per_replica)
        while not self.stop():
            seg = self.current[rid] = self.next_segment(rid)
            if seg is None:
                return
            running: set[asyncio.Task] = set()
            while seg.lines and not self.stop():
                await room.acquire()
                if not seg.lines or not await self.gate.acquire(self.stop):
                    room.release()
                    break
                task = asyncio.create_task(self.one(seg.lines.popleft(), rid, room))
                running.add(task)
                self.lines.add(task)
            await asyncio.gather(*running)  # the segment drains before the next one starts
        self.current[rid] = None

    async def one(self, line: BatchLine, rid: int, room: asyncio.Semaphore) -> None:
        preferred_replica.set(rid)  # this task's own context: the router takes its requests to rid
        try:
            output = await self.execute(line)
        finally:
            self.gate.release()
            room.release()
        self.on_done(line, output)


async def run_planned(
    plan: LinePlan,
    execute: Execute,
    gate: BatchGate,
    on_done: Callable[[BatchLine, dict], None],
    stop: Callable[[], bool] = lambda: False,
    on_tick: Callable[[], None] = lambda: None,
    tick_s: float = 1.0,
) -> int:
    """`run_lines`' contract (dlora/batch/runner.py) over a plan; returns how many segments were
    moved to another replica by repair."""
    run = _Run(plan, execute, gate, on_done, stop)
    workers = {asyncio.create_task(run.replica(rid)) for rid in plan.queues}
    last_tick = time.monotonic()
    try:
        while workers and not stop():
            done, workers = await asyncio.wait(workers, timeout=tick_s)
            for task in done:
                task.result()  # a worker's own failure is the run's
            if time.monotonic() - last_tick >= tick_s:
                last_tick = time.monotonic()
                on_tick()
    finally:
        for task in workers | run.lines:
            task.cancel()
        await asyncio.gather(*workers, *run.lines, return_exceptions=True)
    return run.steals


class BatchPlanner(Protocol):
    def plan(self, lines: Sequence[BatchLine]) -> Awaitable[LinePlan | None]:
        """The plan for the lines, or None to send them as they come."""
        ...


@dataclass(frozen=True)
class BatchRun:
    """How a batch ran: its plan, and how long running by it took."""

    plan: LinePlan | None
    planned_s: float | None  # measured time from the plan's start to its last line's end
    repairs: int  # segments moved to another replica

    def summary(self) -> str:
        if self.plan is None:
            return ""
        p = self.plan
        measured = "" if self.planned_s is None else f", measured {self.planned_s:.1f} s"
        return (
            f"plan: {p.mode}, {p.segments} segments, predicted {p.predicted_s:.1f} s{measured}, {self.repairs} repairs"
        )


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
    repairs = await run_planned(plan, execute, gate, on_done, stop, on_tick, tick_s)
    return BatchRun(plan, None if stop() else time.monotonic() - started, repairs)
