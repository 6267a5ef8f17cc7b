"""Running a batch by its plan (pure asyncio, a fake line executor): lines start on their
segment's replica, a segment waits for the previous one to drain, at most `per_replica` lines run
per replica, idle replicas take work from the busiest one (repair), and a stop ends the run."""

from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest

from dlora.batch.gate import BatchGate
from dlora.batch.lines import BatchLine
from dlora.batch.planned import ANY_REPLICA, LinePlan, QueuedSegment, line_plan, run_planned
from dlora.batch.predict import RequestWork
from dlora.cluster.estimators.output_lengths import LengthHistory
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.router import preferred_replica


def line(n: int) -> BatchLine:
    return BatchLine(n, f"c{n}", "/v1/completions", {"model": "m", "prompt": "x"})


def segment(numbers, adapter="a", mode="merged") -> QueuedSegment:
    return QueuedSegment(mode, adapter, deque(line(n) for n in numbers), {n: 1.0 for n in numbers})


class Recorder:
    """Runs each line for `seconds[line]` (default 0.01) and records where and when it ran."""

    def __init__(self, seconds=None) -> None:
        self.seconds = seconds or {}
        self.ran: dict[int, tuple[int | None, float, float]] = {}  # line -> (replica, start, end)
        self.running: dict[int | None, int] = {}
        self.most: dict[int | None, int] = {}

    async def __call__(self, ln: BatchLine) -> dict:
        loop = asyncio.get_running_loop()
        rid, start = preferred_replica.get(), loop.time()
        self.running[rid] = self.running.get(rid, 0) + 1
        self.most[rid] = max(self.most.get(rid, 0), self.running[rid])
        await asyncio.sleep(self.seconds.get(ln.line, 0.01))
        self.running[rid] -= 1
        self.ran[ln.line] = (rid, start, loop.time())
        return {"custom_id": ln.custom_id}


def run(plan: LinePlan, rec: Recorder, stop=lambda: False) -> tuple[dict[int, dict], int]:
    done: dict[int, dict] = {}

    async def go():
        gate = BatchGate(lambda: 100, lambda: 0)
        ran = await run_planned(plan, rec, gate, lambda ln, out: done.__setitem__(ln.line, out), stop, tick_s=0.01)
        return ran.repairs

    return done, asyncio.run(go())


def test_lines_run_on_their_replica_and_a_segment_waits_for_the_last_to_drain():
    plan = LinePlan(
        {7: deque([segment([1, 2, 3]), segment([4, 5], "b")]), 9: deque([segment([6, 7], "c")])}, 0, "stages", 8
    )
    rec = Recorder({1: 0.1, 6: 0.3, 7: 0.3})  # replica 9 stays busy: nothing moves
    done, steals = run(plan, rec)
    assert sorted(done) == [1, 2, 3, 4, 5, 6, 7] and steals == 0
    assert {n: rec.ran[n][0] for n in done} == {1: 7, 2: 7, 3: 7, 4: 7, 5: 7, 6: 9, 7: 9}
    first_drained = max(rec.ran[n][2] for n in (1, 2, 3))
    assert min(rec.ran[n][1] for n in (4, 5)) >= first_drained  # b started after a's slowest line
    assert preferred_replica.get() is None  # set only inside each line's own task


def test_at_most_per_replica_lines_run_on_a_replica():
    plan = LinePlan({0: deque([segment(range(1, 21))])}, 0, "stages", 3)
    rec = Recorder()
    done, _ = run(plan, rec)
    assert len(done) == 20 and rec.most[0] == 3


def test_an_idle_replica_takes_the_busiest_replicas_last_segment():
    plan = LinePlan(
        {0: deque([segment([1, 2]), segment([3, 4], "b"), segment([5, 6], "c")]), 1: deque()}, 0, "stages", 4
    )
    rec = Recorder()
    done, steals = run(plan, rec)
    assert len(done) == 6 and steals >= 1
    assert rec.ran[5][0] == rec.ran[6][0] == 1  # the last segment moved whole
    assert rec.ran[1][0] == rec.ran[2][0] == 0


def test_an_idle_replica_takes_the_back_half_of_a_long_segment():
    plan = LinePlan({0: deque([segment(range(1, 41))]), 1: deque()}, 0, "stages", 2)
    rec = Recorder()
    done, steals = run(plan, rec)
    assert len(done) == 40 and steals >= 1
    on_1 = sorted(n for n, (rid, _, _) in rec.ran.items() if rid == 1)
    assert on_1 and on_1[-1] == 40 and 1 not in on_1  # taken from the back, in order
    assert 10 <= len(on_1) <= 30  # about half, so both end together


def test_a_stop_starts_nothing_more_and_cancels_the_running_lines():
    plan = LinePlan({0: deque([segment(range(1, 11))])}, 0, "stages", 2)
    rec = Recorder({n: 0.2 for n in range(1, 11)})
    started = []
    real = rec.__call__

    async def execute(ln):
        started.append(ln.line)
        return await real(ln)

    stopping = {"now": False}

    async def go():
        gate = BatchGate(lambda: 100, lambda: 0)
        asyncio.get_running_loop().call_later(0.05, stopping.__setitem__, "now", True)
        done: dict = {}
        await run_planned(
            plan, execute, gate, lambda ln, out: done.__setitem__(ln.line, out), lambda: stopping["now"], tick_s=0.01
        )
        return done, gate.in_flight

    done, in_flight = asyncio.run(go())
    assert started == [1, 2] and done == {} and in_flight == 0


def test_line_plan_groups_lines_and_orders_by_replica_ids():
    lines = [line(n) for n in range(1, 9)]
    works = [[RequestWork("a" if n % 4 in (1, 2) else "b", 10, 16)] for n in range(1, 9)]  # a a b b a a b b
    p = CostParams(per_iteration_s=1, per_decode_token_s=0, per_prefill_token_s=0, max_batch=4, merged_ratio=0.5)
    plan = line_plan(lines, works, {3: p, 5: p}, lambda a: [], per_replica=4)
    assert set(plan.queues) == {3, 5} and plan.mode == "stages"
    placed = {ln.line: rid for rid, segs in plan.queues.items() for s in segs for ln in s.lines}
    assert sorted(placed) == list(range(1, 9))
    assert len({placed[n] for n in (1, 2, 5, 6)}) == len({placed[n] for n in (3, 4, 7, 8)}) == 1  # merged apart
    assert plan.predicted_s == pytest.approx(16 * 0.5)  # one batch of 4 per replica, 16 merged steps


def test_a_batch_runs_by_its_plan_or_as_it_comes_without_one():
    from dlora.batch.planned import run_batch

    class Planner:
        def __init__(self, plan):
            self.made, self.seen = plan, []

        async def plan(self, lines):
            self.seen.append(sorted(ln.line for ln in lines))
            return self.made

        def costs_measured(self):
            return False

    def go(planner):
        rec, done = Recorder(), {}

        async def main():
            gate = BatchGate(lambda: 100, lambda: 0)
            lines = [line(n) for n in range(1, 6)]
            return await run_batch(
                lines, rec, gate, planner, lambda ln, out: done.__setitem__(ln.line, out), tick_s=0.01
            )

        return asyncio.run(main()), rec, done

    planner = Planner(LinePlan({4: deque([segment([1, 2, 3, 4, 5])])}, 2.5, "stages", 8, segments=1))
    ran, rec, done = go(planner)
    assert planner.seen == [[1, 2, 3, 4, 5]] and sorted(done) == [1, 2, 3, 4, 5]
    assert {rec.ran[n][0] for n in done} == {4}
    assert ran.plan is planner.made and ran.planned_s is not None and ran.repairs == 0
    assert ran.summary().startswith("plan: stages, 1 segments, predicted 2.5 s, measured ")
    for no_plan in (None, Planner(None)):
        ran, rec, done = go(no_plan)
        assert sorted(done) == [1, 2, 3, 4, 5] and {rec.ran[n][0] for n in done} == {None}
        assert ran.plan is None and ran.summary() == ""


class MeasuringPlanner:
    """Its costs count as measured from `measured_at` s into the run; a plan made then puts the
    lines it is given alternately on replica 7 (as `segment_on_7` makes them) and replica 9."""

    def __init__(self, measured_at: float, segment_on_7) -> None:
        self.measured_at, self.segment_on_7, self.seen = measured_at, segment_on_7, []
        self.t0 = asyncio.get_running_loop().time()

    def costs_measured(self) -> bool:
        return asyncio.get_running_loop().time() - self.t0 >= self.measured_at

    async def plan(self, lines):
        numbers = [ln.line for ln in lines]
        self.seen.append(numbers)
        queues = {7: deque([self.segment_on_7(numbers[0::2])]), 9: deque([segment(numbers[1::2], "c", "unmerged")])}
        return LinePlan(queues, 1.5, "stages", 2, segments=2, measured_costs=True)


@pytest.mark.parametrize("same_mode", [True, False])
def test_the_unstarted_lines_are_planned_again_once_the_step_costs_are_measured(same_mode):
    first = LinePlan({7: deque([segment(range(1, 11))])}, 9.0, "stages", 2, segments=1)  # on priors
    # line 1 ends at 0.1 s, line 2 at 0.3 s; the costs are measured at 0.05 s, with both running;
    # replica 9's lines are slow enough that it never runs out of work to relieve replica 7
    rec = Recorder({1: 0.1, 2: 0.3, 4: 0.2, 6: 0.2, 8: 0.2, 10: 0.2})

    async def go():
        planner = MeasuringPlanner(0.05, lambda ns: segment(ns, "a" if same_mode else "b"))
        done: dict = {}
        gate = BatchGate(lambda: 100, lambda: 0)
        ran = await run_planned(
            first, rec, gate, lambda ln, out: done.__setitem__(ln.line, out), tick_s=0.01, planner=planner
        )
        return planner, done, ran

    planner, done, ran = asyncio.run(go())
    assert planner.seen == [list(range(3, 11))]  # once, the lines not started at the time
    assert sorted(done) == list(range(1, 11))
    assert {rec.ran[n][0] for n in (3, 5, 7, 9)} == {7} and {rec.ran[n][0] for n in (4, 6, 8, 10)} == {9}
    assert ran.replan is not None and 0.05 <= ran.replan.at_s < 0.1
    assert ran.replan.predicted_end_s == pytest.approx(ran.replan.at_s + 1.5)
    line_2_end = rec.ran[2][2]
    if same_mode:  # the new segment goes on from the current one: line 3 takes line 1's place
        assert rec.ran[3][1] < line_2_end
    else:  # another adapter merged: the current segment drains first
        assert rec.ran[3][1] >= line_2_end


def test_a_plan_made_on_measured_costs_is_not_made_again():
    plan = LinePlan({7: deque([segment(range(1, 5))])}, 1.0, "stages", 2, segments=1, measured_costs=True)

    async def go():
        planner = MeasuringPlanner(0.0, segment)
        gate = BatchGate(lambda: 100, lambda: 0)
        ran = await run_planned(plan, Recorder(), gate, lambda ln, out: None, tick_s=0.01, planner=planner)
        return planner, ran

    planner, ran = asyncio.run(go())
    assert planner.seen == [] and ran.replan is None


def dispatched(numbers, measured: bool = False) -> LinePlan:
    """A dispatch plan: the lines in one queue for the router to place."""
    return LinePlan({ANY_REPLICA: deque([segment(numbers, None, "unmerged")])}, 1.0, "dispatch", 2, 1, measured)


def test_a_dispatch_plan_starts_lines_in_order_where_the_router_sends_them_bounded_by_the_gate_alone():
    rec = Recorder({n: 0.05 for n in range(1, 11)})
    done, steals = run(dispatched(range(1, 11)), rec)
    assert sorted(done) == list(range(1, 11)) and steals == 0
    assert {rec.ran[n][0] for n in done} == {None}  # no replica named
    assert rec.most[None] == 10  # not per_replica (2): the gate (100) holds them all
    assert sorted(done, key=lambda n: rec.ran[n][1]) == list(range(1, 11))


class DispatchingPlanner(MeasuringPlanner):
    async def plan(self, lines):
        self.seen.append([ln.line for ln in lines])
        return dispatched([ln.line for ln in lines], measured=True)


@pytest.mark.parametrize("dispatch_first", [True, False])
def test_a_new_plan_turns_router_placed_lines_into_stages_and_back(dispatch_first):
    """Two lines at a time (the gate); the costs are measured at 0.05 s while lines 1 and 2 run."""
    rec = Recorder({n: 0.1 for n in range(1, 11)})

    async def go():
        if dispatch_first:
            first, planner = dispatched(range(1, 11)), MeasuringPlanner(0.05, lambda ns: segment(ns, "a"))
        else:
            first = LinePlan({7: deque([segment(range(1, 11))])}, 9.0, "stages", 2, segments=1)
            planner = DispatchingPlanner(0.05, segment)
        gate = BatchGate(lambda: 2, lambda: 0)
        done: dict = {}
        ran = await run_planned(
            first, rec, gate, lambda ln, out: done.__setitem__(ln.line, out), tick_s=0.01, planner=planner
        )
        return planner, done, ran

    planner, done, ran = asyncio.run(go())
    assert planner.seen == [list(range(3, 11))] and sorted(done) == list(range(1, 11))
    where = {n: rec.ran[n][0] for n in done}
    if dispatch_first:  # the router placed 1 and 2; the stage plan names a replica for the rest
        assert [where[n] for n in (1, 2)] == [None, None]
        assert {where[n] for n in (3, 5, 7, 9)} == {7} and {where[n] for n in (4, 6, 8, 10)} == {9}
    else:  # replica 7 keeps 1 and 2, takes none of the rest from the router's queue
        assert [where[n] for n in (1, 2)] == [7, 7] and {where[n] for n in range(3, 11)} == {None}
    assert ran.repairs == 0


def random_plan(numbers, rids, rng, measured: bool) -> LinePlan:
    """Segments of 1-6 lines of random modes and adapters, on random replicas of `rids`; or, one
    time in four, a dispatch plan."""
    if rng.random() < 0.25:
        return dispatched(list(numbers), measured)
    queues: dict[int, deque[QueuedSegment]] = {r: deque() for r in rids}
    numbers = list(numbers)
    rng.shuffle(numbers)
    while numbers:
        size = rng.randint(1, 6)
        chunk, numbers = numbers[:size], numbers[size:]
        seg = segment(chunk, rng.choice(["a", "b", None]), rng.choice(["merged", "unmerged"]))
        queues[rng.choice(rids)].append(seg)
    return LinePlan(queues, 1.0, "stages", rng.randint(1, 4), measured_costs=measured)


class RandomPlanner:
    """Costs measured from `at` s on; plans the lines it is given at random, on random replicas,
    after a random delay (lines start and finish while it plans)."""

    def __init__(self, rng, at: float) -> None:
        self.rng, self.at, self.t0 = rng, at, asyncio.get_running_loop().time()

    def costs_measured(self) -> bool:
        return asyncio.get_running_loop().time() - self.t0 >= self.at

    async def plan(self, lines):
        await asyncio.sleep(self.rng.random() * 0.05)
        rids = self.rng.choice([[0, 1], [0], [1], [0, 1, 2]])
        return random_plan([ln.line for ln in lines], rids, self.rng, True)


@pytest.mark.parametrize("seed", range(40))
def test_every_line_runs_exactly_once_whatever_the_repairs_and_the_new_plan(seed):
    rng = random.Random(seed)
    n = rng.randint(5, 60)
    first = random_plan(range(1, n + 1), [0, 1], rng, False)
    rec = Recorder({i: rng.random() * 0.03 for i in range(1, n + 1)})
    calls: list[int] = []

    async def execute(ln):
        calls.append(ln.line)
        return await rec(ln)

    async def go():
        gate = BatchGate(lambda: rng.randint(2, 100), lambda: 0)
        planner = RandomPlanner(rng, rng.random() * 0.1)
        return await run_planned(first, execute, gate, lambda ln, out: None, tick_s=0.005, planner=planner)

    asyncio.run(go())
    assert sorted(calls) == list(range(1, n + 1))


def test_a_plan_made_while_requests_run_starts_each_replica_after_what_it_holds():
    from types import SimpleNamespace

    from dlora.batch.execute import ServerPlanner
    from dlora.config import BatchConfig
    from tests.cluster.balancer_factories import make_request

    state = SimpleNamespace(cfg=SimpleNamespace(engine=SimpleNamespace(max_num_seqs=4), batch=BatchConfig()))
    lines = [line(n) for n in range(1, 5)]
    works = [[RequestWork("a", 0, 16)] for _ in lines]
    p = CostParams(per_iteration_s=1, per_decode_token_s=0, per_prefill_token_s=0, max_batch=4, merged_ratio=0.5)
    # Replica 3 runs four requests of adapter "b" with 40 tokens each still to go (the only
    # longer length seen is 50, they have 10): 40 steps, merged (one adapter runs): 20 s.
    # Replica 5 holds nothing.
    held = {3: tuple(make_request(f"h{i}", "b", output=10, expected=50, running=True) for i in range(4)), 5: ()}
    ended = LengthHistory({"a": ((16, True),), "b": ((5, True), (50, True))})  # (length, ended by itself)
    plan = ServerPlanner(state)._plan(lines, works, {3: p, 5: p}, held, ended)
    # Sent at once, the lines would all go to idle replica 5 and end at 8 s there, which no stage
    # plan beats: a dispatch plan, leaving each line's replica to the router.
    assert plan.mode == "dispatch" and list(plan.queues) == [ANY_REPLICA]
    assert [ln.line for s in plan.queues[ANY_REPLICA] for ln in s.lines] == [1, 2, 3, 4]
    assert plan.predicted_s == pytest.approx(20)  # replica 3's held work ends last; replica 5's at 8
    idle = ServerPlanner(state)._plan(lines, works, {3: p, 5: p}, {3: (), 5: ()}, LengthHistory({"a": ((16, True),)}))
    assert idle.predicted_s == pytest.approx(8)  # as if nothing ran: half the lines on each, merged


def test_a_request_that_stopped_at_its_cap_only_says_its_length_is_longer():
    from types import SimpleNamespace

    from dlora.batch.execute import ServerPlanner
    from dlora.config import BatchConfig

    state = SimpleNamespace(cfg=SimpleNamespace(engine=SimpleNamespace(max_num_seqs=4), batch=BatchConfig()))
    lines = [line(n) for n in range(1, 5)]
    works = [[RequestWork("a", 0, 64)] for _ in lines]
    p = CostParams(per_iteration_s=1, per_decode_token_s=0, per_prefill_token_s=0, max_batch=4, merged_ratio=0.5)
    idle = {3: (), 5: ()}
    # One earlier request of "a" ended by itself after 16 tokens: each line is drawn at 16, 16
    # steps merged (8 s). One that ran to a cap of 16 is censored: nothing is known to end, so
    # each line runs to its own cap of 64 (32 s).
    planner, params = ServerPlanner(state), {3: p, 5: p}
    ended, capped = LengthHistory({"a": ((16, True),)}), LengthHistory({"a": ((16, False),)})
    assert planner._plan(lines, works, params, idle, ended).predicted_s == pytest.approx(8)
    assert planner._plan(lines, works, params, idle, capped).predicted_s == pytest.approx(32)
