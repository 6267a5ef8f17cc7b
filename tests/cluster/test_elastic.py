"""Adding and removing replicas under load (Router.add_replica / Router.drain) and the autoscaler's
controller (dlora/cluster/elastic.py), on toy replicas whose next token is a pure function of the
context: a request moved mid-stream must end with exactly the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.autoscale import AutoscaleConfig
from dlora.cluster.elastic import ElasticCluster
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens

A = AdapterRef("a", 1, "/x/a")
B = AdapterRef("b", 2, "/x/b")
P = AdapterRef("p", 3, "/x/p")


def request(rid: str, adapter=A, n: int = 60) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), adapter)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    out, finished = [], 0
    async for d in router.generate(req):
        out += d.token_ids
        finished += d.finished
    assert finished == 1
    return out


def make(n: int = 2, max_running: int | None = 2, pinned=()) -> tuple[Router, list[ToyReplica]]:
    replicas = [ToyReplica(i, step_s=0.003, max_running=max_running) for i in range(n)]
    return Router(replicas, pinned_adapters=lambda: list(pinned), cfg=RouterConfig()), replicas


async def until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.002)


def on(router: Router, replica_id: int) -> list[str]:
    return [rid for rid, st in router.requests.items() if st.slot is not None and st.slot.replica_id == replica_id]


def test_draining_a_replica_moves_its_streams_and_loses_no_token():
    async def run():
        router, replicas = make()
        await router.start()
        reqs = [request(f"r{i}") for i in range(6)]
        tasks = [asyncio.create_task(collect(router, r)) for r in reqs]
        # requests running and queued on replica 0, some tokens streamed already
        await until(lambda: len(on(router, 0)) >= 2 and any(len(st.generated) >= 5 for st in router.requests.values()))
        result = await router.drain(0)
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 60) for o in outs)
        assert result.moved >= 2 and result.forced == 0
        assert [s.replica_id for s in router.slots] == [1]
        assert not replicas[0]._alive  # stopped once empty
        assert set(router.totals) == {1} and set(router.cost_models) == {1}
        assert router.counters["drain_moves"] == result.moved

    asyncio.run(run())


def test_the_last_serving_replica_cannot_be_drained():
    async def run():
        router, _ = make(n=1)
        await router.start()
        with pytest.raises(ValueError, match="last serving replica"):
            await router.drain(0)
        assert router.slots[0].serving

    asyncio.run(run())


def test_nothing_new_goes_to_a_draining_replica():
    async def run():
        router, _ = make()
        await router.start()
        long = asyncio.create_task(collect(router, request("long", n=400)))
        await until(lambda: on(router, 0) or on(router, 1))
        busy = router.requests["long"].slot.replica_id
        draining = asyncio.create_task(router.drain(busy))
        await until(lambda: router.slot(busy).draining)
        later = [asyncio.create_task(collect(router, request(f"new{i}", n=5))) for i in range(4)]
        while not all(t.done() for t in later):  # at every look, none of them is on the draining replica
            assert not any(rid.startswith("new") for rid in on(router, busy))
            await asyncio.sleep(0.001)
        await asyncio.gather(*later, long)
        await draining
        assert [s.replica_id for s in router.slots] == [1 - busy]

    asyncio.run(run())


def test_a_replica_failing_during_its_drain_loses_nothing_and_is_not_rebuilt():
    async def run():
        router, replicas = make(max_running=4)
        await router.start()
        tasks = [asyncio.create_task(collect(router, request(f"r{i}", n=300))) for i in range(6)]
        await until(lambda: len(on(router, 0)) >= 2 and any(len(st.generated) >= 3 for st in router.requests.values()))
        replicas[0].step_s = 0.05  # slow, so the drain is still under way when it dies
        draining = asyncio.create_task(router.drain(0))
        await until(lambda: router.slot(0).draining)
        replicas[0].kill()
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 300) for o in outs)
        await draining
        assert [s.replica_id for s in router.slots] == [1]
        assert replicas[0].started == 1  # never rebuilt

    asyncio.run(run())


def test_a_cancelled_drain_puts_the_replica_back_into_service():
    async def run():
        router, replicas = make(max_running=1)
        await router.start()
        replicas[1].step_s = 0.02
        tasks = [asyncio.create_task(collect(router, request(f"r{i}", n=30))) for i in range(4)]
        await until(lambda: len(on(router, 0)) >= 1 and len(on(router, 1)) >= 1)
        draining = asyncio.create_task(router.drain(0))
        await until(lambda: router.slot(0).draining)
        draining.cancel()
        with pytest.raises(asyncio.CancelledError):
            await draining
        assert router.slot(0).serving and replicas[0]._alive
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 30) for o in outs)

    asyncio.run(run())


def test_an_added_replica_starts_with_the_pinned_and_preloaded_adapters_and_takes_requests():
    async def run():
        router, _ = make(n=1, max_running=1, pinned=[P])
        await router.start()
        assert router.next_replica_id == 1
        new = ToyReplica(1, step_s=0.003, max_running=1)
        slot = await router.add_replica(new, preload=[B])
        assert slot.serving and set(new.loaded) == {P.int_id, B.int_id}
        assert router.next_replica_id == 2 and 1 in router.cost_models and 1 in router.totals
        outs = await asyncio.gather(*(collect(router, request(f"r{i}", n=30)) for i in range(4)))
        assert all(o == reference_tokens("a", (1, 2, 3), 30) for o in outs)
        assert new.add_calls >= 3  # P, B, then A for the requests dispatch sent it

    asyncio.run(run())


def test_a_replica_that_fails_to_start_is_not_added():
    class Broken(ToyReplica):
        async def start(self) -> None:
            raise RuntimeError("no GPU left")

    async def run():
        router, _ = make(n=1)
        await router.start()
        with pytest.raises(RuntimeError, match="no GPU left"):
            await router.add_replica(Broken(1))
        assert [s.replica_id for s in router.slots] == [0] and set(router.totals) == {0}

    asyncio.run(run())


# ---- the controller -------------------------------------------------------------------------------


def elastic(router: Router, made: list[ToyReplica], **cfg) -> ElasticCluster:
    defaults = dict(
        min_replicas=1,
        max_replicas=2,
        heartbeat_s=0.1,
        rate_window_s=0.3,
        min_arrivals=1000,  # the rate rule stays off: only the reactive term and idleness decide
        max_queue_wait_s=0.05,
        scale_out_cooldown_s=0.0,
        scale_in_cooldown_s=0.3,
    )

    def make_replica(rid: int) -> ToyReplica:
        made.append(ToyReplica(rid, step_s=0.003, max_running=1))
        return made[-1]

    return ElasticCluster(router, AutoscaleConfig(**(defaults | cfg)), make_replica, tick_s=0.02)


def test_a_heartbeat_measures_the_window_from_the_routers_totals():
    async def run():
        router, _ = make(n=1, max_running=None)
        await router.start()
        ec = elastic(router, [])
        await asyncio.gather(*(collect(router, request(f"r{i}", n=7)) for i in range(3)))
        ec.tick()
        s = ec.sample()
        assert (s.arrivals, s.completions, s.tokens, s.finished_tokens) == (3, 3, 21, 21)
        assert s.replicas == 1 and not s.saturated and s.mean_queue_wait_s is None
        assert s.slo_attainment is not None  # judged against the default SLO
        again = ec.sample()
        assert (again.arrivals, again.completions, again.tokens) == (0, 0, 0)

    asyncio.run(run())


def test_queueing_scales_out_and_idleness_scales_back_in_with_every_stream_intact():
    async def run():
        router, first = make(n=1, max_running=1)
        await router.start()
        made: list[ToyReplica] = []
        ec = elastic(router, made)
        loop = asyncio.create_task(ec.run())
        outs = await asyncio.gather(*(collect(router, request(f"r{i}", n=40)) for i in range(8)))
        assert all(o == reference_tokens("a", (1, 2, 3), 40) for o in outs)
        await until(lambda: [e.direction for e in ec.events] == ["out", "in"], timeout_s=10)
        out, in_ = ec.events
        assert out.reason == "queue" and (out.replicas_before, out.replicas_after) == (1, 2) and out.ok
        assert in_.reason == "idle" and (in_.replicas_before, in_.replicas_after) == (2, 1)
        assert len(made) == 1 and made[0].started == 1
        assert len(router.slots) == 1 and not ec.starting and not ec.draining
        loop.cancel()
        await ec.close()

    asyncio.run(run())


async def streams_on_both(
    count: int = 4, n: int = 20, max_running: int = 1, step_s: float = 0.02
) -> tuple[Router, list[asyncio.Task]]:
    """Two started replicas, each with some of `count` streams of `n` tokens on it."""
    router, replicas = make(max_running=max_running)
    await router.start()
    replicas[0].step_s = replicas[1].step_s = step_s
    tasks = [asyncio.create_task(collect(router, request(f"r{i}", n=n))) for i in range(count)]
    await until(lambda: len(on(router, 0)) >= 1 and len(on(router, 1)) >= 1)
    return router, tasks


def test_scale_out_while_draining_takes_the_draining_replica_back():
    async def run():
        router, tasks = await streams_on_both()
        ec = elastic(router, [])
        gone = ec.scale_in("idle")
        assert gone is not None and ec.serving() == 1
        assert ec.scale_out("queue") == gone
        await until(lambda: router.slot(gone).serving)
        assert ec.serving() == 2 and not ec.starting
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 20) for o in outs)
        assert [e.direction for e in ec.events] == ["out"]

    asyncio.run(run())


def test_an_operator_drain_moves_the_named_replicas_streams_and_removes_it():
    async def run():
        router, tasks = await streams_on_both(n=40, max_running=2, step_s=0.01)
        ec = elastic(router, [])
        busiest = max((0, 1), key=lambda r: len(on(router, r)))
        ec.drain(busiest)
        assert ec.serving() == 1 and not router.slot(busiest).serving
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 40) for o in outs)
        await until(lambda: router.find_slot(busiest) is None)
        (event,) = ec.events
        assert (event.direction, event.reason, event.replica_id) == ("in", "operator", busiest)
        assert event.moved >= 1 and (event.replicas_before, event.replicas_after) == (2, 1)

    asyncio.run(run())


def test_an_operator_drain_refuses_an_unknown_a_draining_and_the_last_replica():
    async def run():
        router, replicas = make(max_running=1)
        await router.start()
        replicas[0].step_s = replicas[1].step_s = 0.02
        task = asyncio.create_task(collect(router, request("r0", n=30)))
        ec = elastic(router, [])
        with pytest.raises(LookupError, match="no replica 7"):
            ec.drain(7)
        ec.drain(0)
        with pytest.raises(ValueError, match="not serving"):
            ec.drain(0)
        with pytest.raises(ValueError, match="last serving replica"):
            ec.drain(1)
        assert await task == reference_tokens("a", (1, 2, 3), 30)

    asyncio.run(run())


def test_a_scale_out_starts_a_new_replica_rather_than_take_back_an_operator_drain():
    async def run():
        router, tasks = await streams_on_both()
        made: list[ToyReplica] = []
        ec = elastic(router, made, max_replicas=3)
        ec.drain(0)
        new = ec.scale_out("queue")
        assert new not in (0, 1) and 0 in ec.draining
        outs = await asyncio.gather(*tasks)
        assert all(o == reference_tokens("a", (1, 2, 3), 20) for o in outs)
        await until(lambda: router.find_slot(0) is None and new not in ec.starting)
        assert sorted(s.replica_id for s in router.slots) == [1, new] and len(made) == 1

    asyncio.run(run())
