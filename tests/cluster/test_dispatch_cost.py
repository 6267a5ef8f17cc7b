"""Dispatch reads per-replica sums, so its cost does not grow with the requests in flight, and the
sums price a replica exactly as its full per-request view does."""

from __future__ import annotations

import asyncio
import random

import pytest

from dlora.cluster import router as router_mod
from dlora.cluster.dispatch import estimate
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.policy_views import LoadTotals, ReplicaView, RequestLoad
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica

ADAPTERS = [None, "a", "b", "c", "d", "e"]


def random_load(rng: random.Random, i: int) -> RequestLoad:
    out = rng.randrange(0, 50)
    return RequestLoad(
        f"r{i}",
        rng.choice(ADAPTERS),
        prompt_tokens=rng.randrange(1, 300),
        output_tokens=out,
        expected_output_tokens=out + rng.uniform(0, 200),
        running=rng.random() < 0.5,
    )


@pytest.mark.parametrize("seed", range(20))
def test_sums_price_a_replica_as_its_requests_do(seed):
    rng = random.Random(seed)
    loads = [random_load(rng, i) for i in range(rng.randrange(0, 40))]
    extra = [random_load(rng, 1000 + i) for i in range(5)]
    totals = LoadTotals.of(loads + extra)
    for r in extra:  # what came and went is forgotten
        totals.remove(r)
    p = CostParams(per_iteration_s=rng.uniform(0.001, 0.01), merged_ratio=rng.uniform(0.3, 0.9))
    common = dict(
        replica_id=0,
        resident_adapters=frozenset({"a", "b", "c"}),
        merged_adapter=rng.choice([None, "a", "b"]),
        batch_adapter_slots=rng.choice([2, 3, 8]),
        adapter_slots=rng.choice([3, 6]),
        kv_capacity_tokens=5000,
    )
    full = ReplicaView(requests=tuple(loads), **common)
    summed = ReplicaView(totals=totals, **common)
    assert (summed.num_requests, summed.num_queued, summed.kv_used_tokens) == (
        full.num_requests,
        full.num_queued,
        full.kv_used_tokens,
    )
    assert summed.kv_demand_tokens == pytest.approx(full.kv_demand_tokens)
    assert summed.adapters_in_use() == full.adapters_in_use()
    for adapter in ADAPTERS + ["z"]:
        new = RequestLoad("new", adapter, prompt_tokens=20, output_tokens=0, expected_output_tokens=64, running=False)
        assert summed.can_take(adapter) == full.can_take(adapter)
        assert estimate(summed, new, p) == pytest.approx(estimate(full, new, p), rel=1e-9, abs=1e-12)


async def _dispatch_all(n: int) -> tuple[int, Router]:
    """Send `n` requests that stay in flight; return how many RequestLoads the router built meanwhile."""
    replicas = [ToyReplica(i, step_s=60.0) for i in range(4)]  # nobody finishes during the test
    router = Router(replicas, cfg=RouterConfig(dispatch="proactive"))
    await router.start()
    a = AdapterRef("a", 1, "/x/a")
    await router.load_everywhere(a)
    built = 0
    load = router_mod.RequestState.load

    def counting(self, lengths=None):
        nonlocal built
        built += 1
        return load(self, lengths)

    router_mod.RequestState.load = counting
    try:

        async def one(i: int) -> None:
            req = GenerateRequest(f"q{i}", (1, 2, 3), SamplingSpec(max_tokens=4), a if i % 2 else None)
            async for _ in router.generate(req):
                pass

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        while sum(st.engine_request_id is not None for st in router.requests.values()) < n:
            await asyncio.sleep(0.05)
        dispatched = built
    finally:
        router_mod.RequestState.load = load
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return dispatched, router


def test_dispatching_n_requests_costs_o_of_n():
    """Before, each dispatch rebuilt every in-flight request's load: n(n-1)/2 of them for n requests
    (50 million for 10,000), which froze the event loop for minutes."""
    for n in (1_000, 10_000):
        built, router = asyncio.run(_dispatch_all(n))
        assert built <= 4 * n, (n, built)  # its own price, then recounts when it lands and is sent
        per_replica = router.routed_counts()
        assert sum(per_replica.values()) == 0  # every request left its replica's sums when cancelled
