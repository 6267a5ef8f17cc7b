"""The cluster simulator: real router, dispatch and balancer over queueing-model replicas."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from dlora.sim.cluster import ClusterSimSpec, cluster_config, simulate, static_shares

# Two replicas of two slots, 20 tokens at 5 ms: 0.1 s per request, 40 req/s in all. Zipf(3) over
# 4 adapters sends 85% of the requests to a0, which static placement keeps on replica 1 alone.
SPEC = ClusterSimSpec(replicas=2, adapters=4, max_running=2, step_s=0.005, load_s=0.0, output_len=20, alpha=3.0, cv=1.0)


def test_capacity_and_service_time_of_fixed_and_unknown_lengths():
    assert SPEC.service_s == pytest.approx(0.1) and SPEC.capacity_rps == pytest.approx(40.0)
    eos = dataclasses.replace(SPEC, eos_means=(10,))
    assert eos.mean_output_len == pytest.approx(10 * (1 - 0.9**20))  # geometric(1/10) capped at 20


def test_balancer_intervals_scale_with_the_service_time():
    fast, slow = (
        cluster_config(SPEC, "proactive_migration"),
        cluster_config(dataclasses.replace(SPEC, step_s=0.05), "proactive_migration"),
    )
    assert slow.monitor_interval_s == pytest.approx(10 * fast.monitor_interval_s)
    assert slow.migration_interval_s == pytest.approx(10 * fast.migration_interval_s)
    assert fast.migration and not cluster_config(SPEC, "proactive").migration
    assert cluster_config(SPEC, "round_robin_static").placement == "static"


def test_static_shares_follow_the_home_replicas():
    shares = static_shares(SPEC)
    assert sum(shares) == pytest.approx(1.0)
    assert shares[1] > 0.85  # a0 and a2 live on replica 1


def test_every_request_is_measured_and_static_placement_queues_where_dispatch_does_not():
    rate = 0.6 * SPEC.capacity_rps  # replica 1 alone would get ~1.1x its capacity under static placement
    static = asyncio.run(simulate(SPEC, "round_robin_static", rate, 60, seed=1))
    proactive = asyncio.run(simulate(SPEC, "proactive", rate, 60, seed=1))
    for r in (static, proactive):
        assert len(r.queue_s) == len(r.ttft_s) == 60 and min(r.queue_s) >= 0
        assert all(t >= q for t, q in zip(sorted(r.ttft_s), sorted(r.queue_s)))  # a first token follows the wait
    s, p = static.summary(), proactive.summary()
    assert p["mean_queue_ms"] < 0.5 * s["mean_queue_ms"], (p, s)


def test_toy_replica_skips_a_request_whose_adapter_finds_every_lora_slot_taken():
    """max_loras 1 and three running slots: a1 holds the only LoRA slot, so b1 waits for it to finish
    although slots are free, while the base-model request queued behind b1 starts at once."""
    from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
    from dlora.sim.toy_replica import ToyReplica

    rep = ToyReplica(0, step_s=0.01, max_running=3, max_loras=1)
    a, b = AdapterRef("a", 1, "/a"), AdapterRef("b", 2, "/b")
    started: dict[str, float] = {}

    async def one(rid, adapter, n):
        t0 = asyncio.get_running_loop().time()
        async for _ in rep.generate(GenerateRequest(rid, (1,), SamplingSpec(max_tokens=n, ignore_eos=True), adapter)):
            started.setdefault(rid, asyncio.get_running_loop().time() - t0)

    async def run():
        await rep.start()
        await rep.add_adapter(a)
        await rep.add_adapter(b)
        first = asyncio.create_task(one("a1", a, 10))
        await asyncio.sleep(0)
        await asyncio.gather(first, one("b1", b, 2), one("base", None, 2))

    asyncio.run(run())
    assert started["base"] < 0.05  # not held behind b1: skipped past it
    assert started["b1"] >= 0.09  # waited for a1 (10 tokens x 10 ms) to free the LoRA slot


def test_toy_replica_admits_by_priority_then_first_arrival_not_by_when_a_request_came():
    """One running slot: a request moved here (first arrival 100 s ago) is admitted before one that
    came earlier to this replica but first arrived later, and one with a lower priority before both,
    as the engine's priority queue does."""
    import time

    from dlora.replica.messages import GenerateRequest, SamplingSpec
    from dlora.sim.toy_replica import ToyReplica

    rep = ToyReplica(0, step_s=0.005, max_running=1)
    order: list[str] = []

    async def one(rid, arrival_time=None, priority=0):
        req = GenerateRequest(rid, (1,), SamplingSpec(max_tokens=3, ignore_eos=True), None, arrival_time, priority)
        async for _ in rep.generate(req):
            if rid not in order:
                order.append(rid)

    async def run():
        await rep.start()
        running = asyncio.create_task(one("running"))
        await asyncio.sleep(0)
        new = asyncio.create_task(one("new"))
        await asyncio.sleep(0)
        moved = asyncio.create_task(one("moved", time.time() - 100.0))
        await asyncio.sleep(0)
        await asyncio.gather(running, new, moved, one("urgent", priority=-1))

    asyncio.run(run())
    assert order == ["running", "urgent", "moved", "new"]
