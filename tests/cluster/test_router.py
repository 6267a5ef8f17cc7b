"""Router behaviour on in-process replicas: dispatch, migration, crash recovery, adapter loads."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from dlora.cluster.balancer import Balancer
from dlora.cluster.router import Router, RouterConfig
from dlora.config import ClusterConfig
from dlora.replica.messages import AdapterRef, BatchingState, GenerateRequest, ReplicaStats, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens

A = AdapterRef("a", 1, "/x/a")
B = AdapterRef("b", 2, "/x/b")


def request(rid: str, adapter=A, n: int = 20, prompt=(1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingSpec(max_tokens=n), adapter)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    out, finished = [], 0
    async for d in router.generate(req):
        out += d.token_ids
        finished += d.finished
    assert finished == 1  # exactly one final delta reaches the client
    return out


def make(n=2, step_s=0.002, dispatch="proactive", pinned=()):
    replicas = [ToyReplica(i, step_s=step_s) for i in range(n)]
    router = Router(replicas, pinned_adapters=lambda: list(pinned), cfg=RouterConfig(dispatch=dispatch))
    return router, replicas


def test_requests_complete_and_adapters_load_once_per_replica():
    async def run():
        router, replicas = make(n=1)
        await router.start()
        outs = await asyncio.gather(*(collect(router, request(f"r{i}")) for i in range(5)))
        assert all(o == reference_tokens("a", (1, 2, 3), 20) for o in outs)
        assert replicas[0].add_calls == 1
        assert router.requests == {} and not router.inflight_by_adapter

    asyncio.run(run())


def test_migration_continues_the_stream_exactly():
    async def run():
        router, replicas = make()
        await router.start()
        req = request("m", n=40)
        task = asyncio.create_task(collect(router, req))
        while len(router.requests.get("m").generated if "m" in router.requests else []) < 5:
            await asyncio.sleep(0.001)
        src = router.requests["m"].slot.replica_id
        assert await router.migrate("m", 1 - src)
        out = await task
        assert out == reference_tokens("a", (1, 2, 3), 40)
        assert router.counters["migrations"] == 1
        assert A.int_id in replicas[1 - src].loaded  # the adapter was loaded on the target

    asyncio.run(run())


def test_migrate_refuses_unknown_same_or_unhealthy_targets():
    async def run():
        router, _ = make()
        await router.start()
        assert not await router.migrate("nope", 1)
        task = asyncio.create_task(collect(router, request("x", n=30)))
        while "x" not in router.requests or router.requests["x"].slot is None:
            await asyncio.sleep(0.001)
        here = router.requests["x"].slot.replica_id
        assert not await router.migrate("x", here)
        router.slot(1 - here).healthy = False
        assert not await router.migrate("x", 1 - here)
        router.slot(1 - here).healthy = True
        assert await task == reference_tokens("a", (1, 2, 3), 30)

    asyncio.run(run())


def test_killed_replica_loses_no_request_and_comes_back():
    async def run():
        router, replicas = make(pinned=[B])
        await router.start()
        reqs = [request(f"k{i}", adapter=[A, B, None][i % 3], n=30, prompt=(i, 7)) for i in range(6)]
        tasks = [asyncio.create_task(collect(router, r)) for r in reqs]
        await asyncio.sleep(0.02)
        replicas[0].kill()
        outs = await asyncio.gather(*tasks)
        for r, out in zip(reqs, outs):
            assert out == reference_tokens(r.adapter.name if r.adapter else None, r.prompt_token_ids, 30)
        assert router.counters["resubmissions"] >= 1
        for _ in range(200):
            if router.slots[0].healthy:
                break
            await asyncio.sleep(0.01)
        assert router.slots[0].healthy and replicas[0].started == 2
        assert B.int_id in replicas[0].loaded  # pinned adapters are restored on restart

    asyncio.run(run())


class RecordingReplica(ToyReplica):
    """Records every leg it is sent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.legs: list[GenerateRequest] = []

    def generate(self, req):
        self.legs.append(req)
        return super().generate(req)


def test_every_leg_carries_the_requests_first_arrival():
    """A migrated and then resubmitted request's legs all carry the arrival time it first reached
    the router with (its replica queues it by that), and one stamped by the caller keeps its own."""

    async def run():
        replicas = [RecordingReplica(i, step_s=0.002) for i in range(2)]
        router = Router(replicas)
        await router.start()
        before = time.time()
        task = asyncio.create_task(collect(router, request("m", n=60)))
        while len(router.requests["m"].generated if "m" in router.requests else []) < 5:
            await asyncio.sleep(0.001)
        src = router.requests["m"].slot.replica_id
        assert await router.migrate("m", 1 - src)
        while len(router.requests["m"].generated) < 20:
            await asyncio.sleep(0.001)
        replicas[router.requests["m"].slot.replica_id].kill()
        out = await task
        assert out == reference_tokens("a", (1, 2, 3), 60)
        legs = [leg for r in replicas for leg in r.legs if leg.request_id.startswith("m")]
        assert len(legs) == 3 and len({leg.request_id for leg in legs}) == 3  # first leg, migrated, resubmitted
        assert len({leg.arrival_time for leg in legs}) == 1 and before <= legs[0].arrival_time <= time.time()
        stamped = dataclasses.replace(request("s", n=3), arrival_time=12.5)
        await collect(router, stamped)
        assert [leg.arrival_time for r in replicas for leg in r.legs if leg.request_id == "s"] == [12.5]

    asyncio.run(run())


def test_all_replicas_dead_waits_for_recovery():
    async def run():
        router, replicas = make(n=1)
        await router.start()
        task = asyncio.create_task(collect(router, request("w", n=25)))
        await asyncio.sleep(0.01)
        replicas[0].kill()
        assert await task == reference_tokens("a", (1, 2, 3), 25)

    asyncio.run(run())


def test_proactive_dispatch_prefers_the_holder_until_it_is_busy():
    async def run():
        router, replicas = make(step_s=0.01)
        await router.start()
        await router.load_on(1, B)
        first = asyncio.create_task(collect(router, request("b0", adapter=B, n=10)))
        await asyncio.sleep(0.005)
        assert router.requests["b0"].slot.replica_id == 1  # replica 1 holds b: no load needed
        await first

    asyncio.run(run())


def test_views_carry_the_engines_batch_adapter_slots():
    router = Router([ToyReplica(0), ToyReplica(1)], cfg=RouterConfig(batch_adapter_slots=3))
    assert [v.batch_adapter_slots for v in router.views()] == [3, 3]


def test_views_carry_each_engines_reported_kv_capacity_else_the_configs():
    replicas = [ToyReplica(0, kv_capacity_tokens=46_000), ToyReplica(1)]
    router = Router(replicas, cfg=RouterConfig(kv_capacity_tokens=1000))

    async def run():
        await router.start()
        before = [v.kv_capacity_tokens for v in router.views()]  # no stats read yet
        await router.refresh_stats()
        return before, [v.kv_capacity_tokens for v in router.views()]

    assert asyncio.run(run()) == ([1000, 1000], [46_000, 1000])


def test_balancer_moves_work_from_the_busy_replica():
    async def run():
        router, replicas = make(step_s=0.001, dispatch="round_robin")
        await router.start()
        cfg = ClusterConfig(num_replicas=2, migration_interval_s=0.01, count_imbalance=4)
        balancer = Balancer(router, adapter_ref=lambda n: {"a": A, "b": B}[n], cfg=cfg)
        router.slot(1).healthy = False  # everything lands on replica 0 ...
        # long requests: the priors then value moving some at well above 0.05 s each
        tasks = [asyncio.create_task(collect(router, request(f"q{i}", n=600, prompt=(i,)))) for i in range(10)]
        await asyncio.sleep(0.02)
        router.slot(1).healthy = True  # ... until replica 1 comes back idle
        done = await balancer.maybe_migrate()
        assert done is not None and done.trigger.reason == "count"
        assert done.moved > 0 and all(dst == 1 for _, _, dst in done.plan.moves)
        outs = await asyncio.gather(*tasks)
        assert outs == [reference_tokens("a", (i,), 600) for i in range(10)]
        assert router.counters["migrations"] == done.moved

    asyncio.run(run())


def test_static_placement_keeps_each_adapter_on_its_home_replica():
    async def run():
        replicas = [ToyReplica(i) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin", static_placement=True))
        await router.start()
        await router.load_everywhere(A)
        await router.load_everywhere(B)
        assert list(replicas[0].loaded) == [B.int_id] and list(replicas[1].loaded) == [A.int_id]
        seen = []

        async def one(i):
            req = request(f"s{i}", adapter=A, n=5)
            task = asyncio.create_task(collect(router, req))
            while f"s{i}" not in router.requests or router.requests[f"s{i}"].slot is None:
                await asyncio.sleep(0.001)
            seen.append(router.requests[f"s{i}"].slot.replica_id)
            await task

        await asyncio.gather(*(one(i) for i in range(4)))
        assert seen == [1, 1, 1, 1]

    asyncio.run(run())


def test_preload_copies_the_hot_adapter_to_the_replica_without_it():
    async def run():
        router, replicas = make()
        await router.start()
        await router.load_on(0, A)
        await router.load_on(0, B)
        await router.load_on(1, B)
        cfg = ClusterConfig(num_replicas=2, placement_interval_s=5.0)
        balancer = Balancer(router, adapter_ref=lambda n: {"a": A, "b": B}[n], cfg=cfg)
        for i in range(6):  # "a" is hot, and only replica 0 holds it
            await collect(router, request(f"p{i}", adapter=A, n=2))
        await collect(router, request("pb", adapter=B, n=2))
        plan = await balancer.maybe_preload()
        assert ("a", 1) in plan.loads and plan.min_tolerance_after > plan.min_tolerance_before
        assert A.int_id in replicas[1].loaded
        assert await balancer.maybe_preload() is None  # not again within the interval

    asyncio.run(run())


class MeasuringReplica(ToyReplica):
    """Reports what the engine's scheduler measures, drained per read, as the engine does: steps, and
    with `wait_s` a queue wait of that many seconds for every request it was given."""

    def __init__(self, replica_id: int, steps=(), wait_s: float | None = None) -> None:
        super().__init__(replica_id)
        self.steps, self.wait_s, self.waits = list(steps), wait_s, []

    async def generate(self, req):
        if self.wait_s is not None:
            self.waits.append((req.request_id, self.wait_s))
        async for d in super().generate(req):
            yield d

    async def stats(self) -> ReplicaStats:
        st = await super().stats()
        steps, self.steps = tuple(self.steps), []
        waits, self.waits = tuple(self.waits), []
        st.batching = BatchingState(
            policy="dlora",
            mode="unmerged",
            merged_adapter=None,
            num_switches=0,
            merge_failures=0,
            switch_times={},
            iterations=steps,
            queue_waits=waits,
        )
        return st


def test_router_fits_each_replicas_cost_model_from_its_measured_steps():
    # Replica 0 measures t = 0.03 + 0.002 * decode (a SmolLM2-sized step, 8x the tiny priors);
    # merged steps at 0.4 of that. Replica 1 reports nothing and keeps the priors.
    steps = [(n, 0, n, 0.03 + 0.002 * n, False) for n in (2, 4, 8, 16) * 3]
    steps += [(n, 0, n, 0.4 * (0.03 + 0.002 * n), True) for n in (4, 8, 16)]

    async def main():
        router = Router([MeasuringReplica(0, steps), ToyReplica(1)], cfg=RouterConfig(max_batch=16))
        await router.start()
        prior = router.cost_params()[1]
        await router.refresh_stats()
        await router.refresh_stats()  # nothing new: the fit must not change
        fitted = router.cost_params()
        assert fitted[1] == prior
        assert fitted[0].per_iteration_s == pytest.approx(0.03, rel=0.05)
        assert fitted[0].per_decode_token_s == pytest.approx(0.002, rel=0.05)
        assert fitted[0].merged_ratio == pytest.approx(0.4, rel=0.02)
        assert fitted[0].max_batch == 16
        await router.shutdown()

    asyncio.run(main())


def test_idle_replica_that_fails_its_stats_read_is_rebuilt_before_any_request_needs_it():
    async def run():
        router, replicas = make(pinned=[B])
        await router.start()
        replicas[1].kill()  # e.g. Ray restarted the actor process: the engine is gone
        await router.refresh_stats()
        for _ in range(200):
            if router.slots[1].healthy and replicas[1].started == 2:
                break
            await asyncio.sleep(0.01)
        assert router.slots[1].healthy and replicas[1].started == 2
        assert B.int_id in replicas[1].loaded
        await router.shutdown()

    asyncio.run(run())


def test_router_feeds_finished_output_lengths_per_adapter():
    async def run():
        replicas = [ToyReplica(i, step_s=0.001, eos_period={"a": 7}) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        reqs = [request(f"e{i}", n=60, prompt=(i, 5)) for i in range(6)] + [request("cap", adapter=B, n=9)]
        outs = await asyncio.gather(*(collect(router, r) for r in reqs))
        for r, out in zip(reqs[:6], outs):  # "a" stops at its EOS, "b" (no EOS rule) at its cap
            assert out == reference_tokens("a", r.prompt_token_ids, 60, {"a": 7})
        assert sorted(router.output_lengths.samples("a")) == sorted(len(o) for o in outs[:6])
        assert len(set(router.output_lengths.samples("a"))) > 1  # really variable
        assert router.output_lengths.samples("b") == [9]
        # A stop at EOS is an end; a stop at the cap is censored (its true length is longer).
        ends = sorted((len(o), len(o) < 60) for o in outs[:6])
        own = router.output_lengths.history(["a", "b"]).own
        assert sorted(own["a"]) == ends and own["b"] == ((9, False),)

    asyncio.run(run())


def test_a_migrated_request_is_recorded_once_with_its_whole_length():
    async def run():
        router, replicas = make()
        await router.start()
        task = asyncio.create_task(collect(router, request("m", n=40)))
        while len(router.requests["m"].generated if "m" in router.requests else []) < 5:
            await asyncio.sleep(0.001)
        assert await router.migrate("m", 1 - router.requests["m"].slot.replica_id)
        assert len(await task) == 40
        assert router.counters["migrations"] == 1 and router.output_lengths.samples("a") == [40]

    asyncio.run(run())


def test_queue_time_sums_each_replicas_wait_once_per_request_across_a_migration():
    async def run():
        replicas = [MeasuringReplica(0, wait_s=0.25), MeasuringReplica(1, wait_s=0.5)]
        router = Router(replicas)
        seen = []
        router.queue_times.observer = lambda adapter, s: seen.append((adapter, s))
        await router.start()
        task = asyncio.create_task(collect(router, request("m", n=40)))
        while len(router.requests["m"].generated if "m" in router.requests else []) < 5:
            await asyncio.sleep(0.001)
        assert await router.migrate("m", 1 - router.requests["m"].slot.replica_id)
        await asyncio.gather(task, collect(router, request("s", adapter=None, n=5)))
        s_wait = next(r.wait_s for r in replicas if any(rid == "s" for rid, _ in r.waits))
        assert seen == []  # the replicas' measurements arrive with their stats
        await router.refresh_stats()
        # "m" waited on both replicas (its continuation is "m-r1"); the router's own wait is ~0
        assert len(seen) == 2 and dict(seen) == {
            "a": pytest.approx(0.75, abs=0.02),
            None: pytest.approx(s_wait, abs=0.02),
        }
        await router.refresh_stats()
        assert len(seen) == 2 and router.queue_times.pending == 0

    asyncio.run(run())


def find_load(router: Router, rid: str):
    """What the balancer sees of request `rid` (None while it is on no replica)."""
    return next((r for v in router.views() for r in v.requests if r.request_id == rid), None)


def tokens(router: Router, rid: str) -> int:
    return len(router.requests[rid].generated) if rid in router.requests else 0


async def until(cond, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_running_means_admitted_on_the_current_replica():
    async def run():
        replicas = [ToyReplica(i, step_s=0.02, max_running=1) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        router.slot(1).healthy = False
        x = asyncio.create_task(collect(router, request("x", n=30)))
        y = asyncio.create_task(collect(router, request("y", n=5)))  # queued behind x on replica 0
        await until(lambda: tokens(router, "x") >= 2)
        assert find_load(router, "x").running and not find_load(router, "y").running
        router.slot(0).healthy, router.slot(1).healthy = False, True
        z = asyncio.create_task(collect(router, request("z", n=15)))  # runs on replica 1
        await until(lambda: tokens(router, "z") > 0)
        router.slot(0).healthy = True
        before, n = router.clock(), len(router.requests["x"].generated)
        assert await router.migrate("x", 1)
        await until(lambda: router.requests["x"].engine_request_id == "x-r1")
        # tokens generated on replica 0, but it waits behind z in replica 1's queue
        moved = find_load(router, "x")
        assert not moved.running and moved.output_tokens >= n and moved.queued_since >= before
        # admitted as soon as replica 1 reports its wait, before its first token there (a step later)
        while not router.requests["x"].admitted:
            await router.refresh_stats()
            await asyncio.sleep(0.002)
        assert find_load(router, "x").running and len(router.requests["x"].generated) == moved.output_tokens
        assert await x == reference_tokens("a", (1, 2, 3), 30)
        await asyncio.gather(y, z)

    asyncio.run(run())


class PreemptingReplica(ToyReplica):
    """Reports `preempted` (engine request ids its scheduler put back in the waiting queue) with its stats."""

    def __init__(self, replica_id: int, **kw) -> None:
        super().__init__(replica_id, **kw)
        self.preempted: tuple[str, ...] = ()

    async def stats(self) -> ReplicaStats:
        st = await super().stats()
        st.batching = BatchingState(
            policy="dlora",
            mode="unmerged",
            merged_adapter=None,
            num_switches=0,
            merge_failures=0,
            switch_times={},
            preempted=self.preempted,
        )
        return st


def test_a_preempted_request_counts_as_queued_until_its_replica_resumes_it():
    async def run():
        replicas = [PreemptingReplica(0, step_s=0.02), PreemptingReplica(1, step_s=0.02)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        router.slot(1).healthy = False  # x runs on replica 0
        x = asyncio.create_task(collect(router, request("x", n=40)))
        await until(lambda: tokens(router, "x") >= 3)
        assert find_load(router, "x").running
        replicas[1].preempted = ("x",)  # another replica's report names no leg of its own
        await router.refresh_stats()
        assert find_load(router, "x").running
        replicas[0].preempted = ("x",)
        await router.refresh_stats()
        load = find_load(router, "x")
        # queued again: priced with a prefill of its whole context, and movable by queued moves
        assert not load.running and load.output_tokens >= 3
        replicas[0].preempted = ()
        await router.refresh_stats()
        assert find_load(router, "x").running
        assert await x == reference_tokens("a", (1, 2, 3), 40)

    asyncio.run(run())


class GatedLoads(ToyReplica):
    """Adapter loads wait for `gate`."""

    def __init__(self, replica_id: int) -> None:
        super().__init__(replica_id)
        self.gate = asyncio.Event()

    async def add_adapter(self, ref, pinned=False):
        await self.gate.wait()
        await super().add_adapter(ref, pinned)


def test_a_request_still_loading_its_adapter_is_not_moved():
    async def run():
        replicas = [ToyReplica(0), GatedLoads(1)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        router.slot(0).healthy = False
        task = asyncio.create_task(collect(router, request("g", n=10)))
        await until(lambda: "g" in router.requests and router.requests["g"].slot is not None)
        router.slot(0).healthy = True
        assert not await router.migrate("g", 0)  # the abort would miss it: not sent yet
        assert router.requests["g"].migrate_to is None
        replicas[1].gate.set()
        await until(lambda: router.requests["g"].engine_request_id is not None)
        assert await router.migrate("g", 0)  # sent: it can move
        assert await task == reference_tokens("a", (1, 2, 3), 10)
        assert router.counters["migrations"] == 1

    asyncio.run(run())


async def _two_toy_replicas(max_running: int, **cluster) -> tuple[Router, Balancer]:
    """A started round-robin router over two sim replicas that run `max_running` requests at once
    (5 ms a token), and a balancer that looks every 10 ms and moves requests queued 20 ms."""
    replicas = [ToyReplica(i, step_s=0.005, max_running=max_running) for i in range(2)]
    router = Router(replicas, cfg=RouterConfig(dispatch="round_robin", max_batch=max_running))
    await router.start()
    cfg = ClusterConfig(num_replicas=2, monitor_interval_s=0.01, queued_min_wait_s=0.02, **cluster)
    return router, Balancer(router, adapter_ref=lambda n: {"a": A, "b": B}[n], cfg=cfg)


async def _queued_run(migrate_queued: bool):
    """Four requests on replica 0, which runs two at a time, while replica 1 is down; then replica 1
    comes back idle and the balancer loop runs."""
    router, balancer = await _two_toy_replicas(max_running=2, migrate_queued=migrate_queued)
    waits = []
    router.queue_times.observer = lambda adapter, s: waits.append(s)
    router.slot(1).healthy = False
    reqs = [request(f"q{i}", n=100, prompt=(i,)) for i in range(4)]
    tasks = [asyncio.create_task(collect(router, r)) for r in reqs]
    await until(lambda: all(tokens(router, f"q{i}") for i in range(2)))
    router.slot(1).healthy = True
    loop = asyncio.create_task(balancer.run())
    outs = await asyncio.gather(*tasks)
    loop.cancel()
    await router.refresh_stats()
    assert outs == [reference_tokens("a", (i,), 100) for i in range(4)]
    assert len(waits) == 4
    return balancer, router, sum(waits)


def test_the_balancer_moves_queued_requests_to_an_idle_replica_every_tick():
    async def run():
        balancer, router, waited = await _queued_run(migrate_queued=True)
        moves = [m for r in balancer.rounds for m in r.plan.moves]
        assert {r.trigger.reason for r in balancer.rounds} == {"queued"}
        assert sorted(moves) == [("q2", 0, 1), ("q3", 0, 1)]  # the two waiting ones, nothing running
        assert router.counters["migrations"] == 2
        off, off_router, waited_off = await _queued_run(migrate_queued=False)
        assert not off.rounds and off_router.counters["migrations"] == 0
        # without the move q2 and q3 wait for a whole request (~0.5 s) each; with it, ~a tick
        assert waited < 0.5 * waited_off

    asyncio.run(run())


async def _rebalance_run(gain_s: float | None):
    """Replica 0 runs one of five requests and queues four; replica 1 runs one: no replica can
    start a queued request now, so only the rebalancer can move them (one slot each, 40 tokens)."""
    router, balancer = await _two_toy_replicas(max_running=1, rebalance_min_gain_s=gain_s)
    router.slot(1).healthy = False
    reqs = [request(f"q{i}", n=40, prompt=(i,)) for i in range(5)]
    tasks = [asyncio.create_task(collect(router, r)) for r in reqs]
    await until(lambda: tokens(router, "q0"))
    router.slot(1).healthy, router.slot(0).healthy = True, False
    tasks.append(asyncio.create_task(collect(router, request("other", n=40, prompt=(9,)))))
    await until(lambda: tokens(router, "other"))
    router.slot(0).healthy = True
    loop = asyncio.create_task(balancer.run())
    outs = await asyncio.gather(*tasks)
    loop.cancel()
    await router.refresh_stats()
    assert outs == [reference_tokens("a", (i,), 40) for i in (0, 1, 2, 3, 4, 9)]
    return balancer


def test_the_balancer_moves_the_newest_queued_requests_to_a_busy_replica_where_they_start_sooner():
    async def run():
        balancer = await _rebalance_run(gain_s=0.05)
        assert {r.trigger.reason for r in balancer.rounds} == {"rebalance"}
        moves = [m for r in balancer.rounds for m in r.plan.moves]
        # replica 0 would start q1..q4 after 1, 2, 3, 4 requests, replica 1 after "other": q4 (then
        # q3, unless "other" started far behind q0) start sooner there; q1 and q2 do not
        assert moves[0] == ("q4", 0, 1) and set(moves) <= {("q4", 0, 1), ("q3", 0, 1)}
        # off: q1..q4 wait on replica 0 until replica 1 is idle (then the queued planner moves one)
        off = await _rebalance_run(gain_s=None)
        assert {r.trigger.reason for r in off.rounds} <= {"queued"}

    asyncio.run(run())


def test_a_request_for_a_superseded_adapter_version_runs_on_the_version_that_replaced_it():
    """An in-place update unloads the old version once no request holds it; a request that took the
    old version just before the update but reaches the router only now must not load it again."""

    async def run():
        replicas = [RecordingReplica(0, step_s=0.001)]
        router = Router(replicas)
        await router.start()
        v1, v2, v3 = AdapterRef("a", 1, "/x/a-1"), AdapterRef("a", 7, "/x/a-2", 2), AdapterRef("a", 9, "/x/a-3", 3)
        router.superseded[v1.int_id] = v2
        router.superseded[v2.int_id] = v3  # updated twice meanwhile: the newest version
        assert await collect(router, request("late", adapter=v1, n=5)) == reference_tokens("a", (1, 2, 3), 5)
        assert [leg.adapter for leg in replicas[0].legs] == [v3]
        assert set(replicas[0].loaded) == {v3.int_id}
        assert router.inflight_with(v3.int_id) == 0

    asyncio.run(run())


def test_dispatch_prices_a_load_at_the_replicas_measured_load_time():
    """Replica 0 loads adapters in 0.3 s, replica 1 in 0.01 s. Once each has loaded one, a request
    for an adapter neither holds goes to the replica that loads it sooner; with both priced at the
    prior it would go to replica 0 (ties go to the lower id)."""

    async def run(measured_first: bool) -> int:
        replicas = [ToyReplica(0, load_s=0.3), ToyReplica(1, load_s=0.01)]
        router = Router(replicas, cfg=RouterConfig(dispatch="proactive"))
        await router.start()
        if not measured_first:
            await collect(router, request("b", B, n=5))
            holders = [s.replica_id for s in router.slots if B.int_id in s.loaded]
            await router.shutdown()
            return holders[0]
        await asyncio.gather(router.load_on(0, A), router.load_on(1, A))
        params = router.cost_params()
        assert params[0].adapter_load_s == pytest.approx(0.3, abs=0.05)
        assert params[1].adapter_load_s == pytest.approx(0.01, abs=0.05)
        await collect(router, request("b", B, n=5))
        holders = [s.replica_id for s in router.slots if B.int_id in s.loaded]
        await router.shutdown()
        return holders[0]

    assert asyncio.run(run(measured_first=False)) == 0
    assert asyncio.run(run(measured_first=True)) == 1


@pytest.mark.parametrize("timeout_s", [None, 600.0])
def test_a_burst_is_spread_over_the_replicas_with_or_without_a_deadline(timeout_s):
    # 64 base-model requests at once. With a deadline each dispatch runs in its own task
    # (asyncio.wait_for); every decision must still see the requests dispatched before it.
    async def run():
        replicas = [ToyReplica(i, step_s=0.001) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(request_timeout_s=timeout_s))
        await router.start()
        first_leg: dict[str, int] = {}
        choose = router._choose

        async def recording(state):
            slot = await choose(state)
            first_leg.setdefault(state.request.request_id, slot.replica_id)
            return slot

        router._choose = recording  # type: ignore[method-assign]
        outs = await asyncio.gather(*(collect(router, request(f"r{i}", adapter=None, n=8)) for i in range(64)))
        assert all(len(o) == 8 for o in outs)
        per_replica = [sum(1 for r in first_leg.values() if r == i) for i in range(2)]
        assert min(per_replica) >= 28, per_replica  # about half each, not 56 and 8
        assert all(t.requests == 0 for t in router.totals.values())  # nothing left counted

    asyncio.run(run())


def test_adaptive_period_grows_while_traffic_holds_and_shrinks_when_it_moves():
    # SeaLLM Eq. 8 with beta 0.1, first period 10 s: the same arrival rate (and attainment) as the
    # period before -> 11 s; then three times the rate (error 2 > 0.1) -> 11 * 0.9 = 9.9 s.
    async def run():
        clock = [0.0]
        router = Router([ToyReplica(0), ToyReplica(1)], clock=lambda: clock[0])
        await router.start()
        cfg = ClusterConfig(num_replicas=2, reoptimize="adaptive", migration_interval_s=10.0, migration=False)
        balancer = Balancer(router, adapter_ref=lambda n: {"a": A, "b": B}[n], cfg=cfg)

        async def period(arrivals: int, length: float) -> None:
            await asyncio.gather(*(collect(router, request(f"p{clock[0]}-{i}", n=2)) for i in range(arrivals)))
            clock[0] += length
            await balancer.maybe_reoptimize()

        await balancer.maybe_reoptimize()  # the first period starts
        await period(10, 10.0)  # measured, nothing to compare with yet: still 10 s
        assert balancer.reopt.period_s == pytest.approx(10.0)
        await period(10, 10.0)
        assert balancer.reopt.period_s == pytest.approx(11.0)
        await period(33, 11.0)
        assert balancer.reopt.period_s == pytest.approx(9.9)
        await period(1, 5.0)  # before the period is over: nothing changes
        assert balancer.reopt.period_s == pytest.approx(9.9)

    asyncio.run(run())


def test_reoptimize_settings_are_checked():
    from dlora.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.reoptimize='sometimes'"):
        ClusterConfig(reoptimize="sometimes")
    with pytest.raises(ConfigError, match="cluster.reoptimize_min_s"):
        ClusterConfig(reoptimize="adaptive", reoptimize_min_s=20.0, migration_interval_s=10.0)


def test_merged_steps_are_priced_by_the_lora_backends_prior_until_measured():
    from dlora import config
    from dlora.server.state import router_config

    router = Router([ToyReplica(0)], cfg=RouterConfig(merged_ratio_prior=0.85))
    assert router.cost_params()[0].merged_ratio == 0.85
    einsum = config.from_dict({"engine": {"lora_backend": "einsum"}})
    assert router_config(einsum).merged_ratio_prior == 0.85  # scheduling.merged_cost_ratio unset: einsum's
    chosen = config.from_dict({"engine": {"lora_backend": "einsum"}, "scheduling": {"merged_cost_ratio": 0.7}})
    assert router_config(chosen).merged_ratio_prior == 0.7


@pytest.mark.parametrize("draws", [0, 16])
def test_a_round_whose_moves_are_simulated_to_cost_more_than_they_save_is_not_run(draws):
    # Ten long-prompt requests on replica 0, replica 1 idle: the ILP, pricing each by its mean
    # remaining output (1 in 50 of this adapter's requests ran 3000 tokens, so about 70), moves
    # some. Sampled, nine draws in ten have every request end within 10 tokens, where re-prefilling
    # 1000-token contexts costs more than the smaller batches save: with the check, nothing moves.
    async def run():
        router, _ = make(step_s=0.01, dispatch="round_robin")
        await router.start()
        for n in [10] * 49 + [3000]:
            router.output_lengths.observe("a", n)
        cfg = ClusterConfig(num_replicas=2, migration_interval_s=0.01, count_imbalance=4, migration_check_draws=draws)
        balancer = Balancer(router, adapter_ref=lambda n: {"a": A, "b": B}[n], cfg=cfg)
        router.slot(1).healthy = False
        tasks = [asyncio.create_task(collect(router, request(f"q{i}", n=3000, prompt=(i,) * 1000))) for i in range(10)]
        await asyncio.sleep(0.03)
        router.slot(1).healthy = True
        done = await balancer.maybe_migrate()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return done

    done = asyncio.run(run())
    assert done is not None and done.trigger.reason == "count"
    if draws:
        assert done.plan.moves == () and done.moved == 0 and "not run: simulated gain" in done.plan.status
    else:
        assert done.moved > 0


def test_a_continuation_carries_the_sampling_but_not_the_prompts_logprobs():
    """A moved request's next leg keeps what samples its tokens and counts what is left; once a leg
    has given tokens (and with the first, the prompt's logprobs) the next does not ask for them again."""
    from dlora.cluster.router import RequestState

    spec = SamplingSpec(
        max_tokens=10,
        min_tokens=4,
        prompt_logprobs=1,
        logit_bias=((3, 2.0),),
        allowed_token_ids=(3, 4),
        seed=5,
        structured_outputs='{"regex": "[ab]+"}',
    )
    state = RequestState(GenerateRequest("r", (1, 2), spec), arrival=0.0)
    first = state.continuation().sampling  # moved before its first output
    assert first.prompt_logprobs == 1 and first.generated_before == 0
    state.generated.extend([3, 4, 3])
    nxt = state.continuation()
    assert nxt.prompt_token_ids == (1, 2, 3, 4, 3)
    # the grammar resumes after the 3 generated tokens, however many moves it took
    want = dataclasses.replace(spec, max_tokens=7, min_tokens=1, prompt_logprobs=None, generated_before=3)
    assert nxt.sampling == want
