"""Queued-request moves on events (`cluster.event_moves_min_wait_s`): between the balancer's
monitor ticks, a freed slot or a long wait moves a queued request at once (toy replicas)."""

from __future__ import annotations

import asyncio

from dlora.cluster.balancer import Balancer
from dlora.cluster.router import Router, RouterConfig
from dlora.config import ClusterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens

A = AdapterRef("a", 1, "/x/a")


def request(rid: str, n: int) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), A)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    return [t async for d in router.generate(req) for t in d.token_ids]


def run_with(event_wait: float | None) -> tuple[float, int, list[list[int]]]:
    """Replica 0 runs a long request and has a second queued behind it; replica 1 runs a short one.
    Returns when the queued request started (s after it was sent), its replica, and the outputs."""

    async def run():
        replicas = [ToyReplica(i, step_s=0.01, max_running=1) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        cfg = ClusterConfig(num_replicas=2, monitor_interval_s=30.0, event_moves_min_wait_s=event_wait)
        balancer = Balancer(router, adapter_ref=lambda n: A, cfg=cfg)
        loop_task = asyncio.create_task(balancer.run())
        await asyncio.sleep(0.05)  # the first stats read
        long = asyncio.create_task(collect(router, request("long", 60)))  # replica 0, 0.6 s
        await asyncio.sleep(0.005)
        short = asyncio.create_task(collect(router, request("short", 10)))  # replica 1, 0.1 s
        await asyncio.sleep(0.005)
        sent = asyncio.get_running_loop().time()
        queued = asyncio.create_task(collect(router, request("queued", 5)))  # round robin: replica 0, queued
        while "queued" not in router.requests or not router.requests["queued"].generated:
            await asyncio.sleep(0.002)
        started = asyncio.get_running_loop().time() - sent
        where = router.requests["queued"].slot.replica_id
        outs = await asyncio.gather(long, short, queued)
        loop_task.cancel()
        return started, where, outs

    return asyncio.run(run())


def test_a_freed_slot_moves_the_queued_request_without_waiting_for_a_tick():
    started, where, outs = run_with(0.05)
    assert where == 1 and started < 0.35  # replica 1 freed its slot at ~0.1 s; the tick is 30 s away
    assert outs == [reference_tokens("a", (1, 2, 3), n) for n in (60, 10, 5)]


def test_with_event_moves_off_it_waits_behind_the_long_request():
    started, where, _ = run_with(None)
    assert where == 0 and started >= 0.5
