"""Where the router loads adapters: one replica at registration, more by demand, a byte-counted LRU."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.balancer import Balancer
from dlora.cluster.dispatch import NoEligibleReplica
from dlora.cluster.host_cache import AdapterTooLarge
from dlora.cluster.router import Router, RouterConfig
from dlora.config import ClusterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens

A = AdapterRef("a", 1, "/x/a", size_bytes=60)
B = AdapterRef("b", 2, "/x/b", size_bytes=60)
C = AdapterRef("c", 3, "/x/c", size_bytes=60)
P = AdapterRef("p", 4, "/x/p", size_bytes=30)


def request(rid: str, adapter: AdapterRef | None, n: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), adapter)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    return [t async for d in router.generate(req) for t in d.token_ids]


def make(n: int = 2, host_cache_bytes: int | None = None, step_s: float = 0.001, **cfg):
    replicas = [ToyReplica(i, step_s=step_s) for i in range(n)]
    rcfg = RouterConfig(**({"dispatch": "round_robin", "host_cache_bytes": host_cache_bytes} | cfg))
    return Router(replicas, cfg=rcfg), replicas


def test_an_unpinned_adapter_starts_on_one_replica_the_emptiest():
    async def run():
        router, replicas = make()
        await router.start()
        assert await router.place(A) == [0]  # a tie: the lowest id
        assert await router.place(B) == [1]  # replica 1 holds fewer
        assert await router.place(C) == [0]
        assert [sorted(r.loaded) for r in replicas] == [[A.int_id, C.int_id], [B.int_id]]

    asyncio.run(run())


def test_pinned_adapters_start_everywhere_and_static_placement_on_their_home():
    async def run():
        router, replicas = make()
        await router.start()
        assert await router.place(P, pinned=True) == [0, 1]
        assert all(P.int_id in r.loaded for r in replicas)
        static, sreplicas = make(static_placement=True)
        await static.start()
        assert await static.place(A) == [1]  # id 1 mod 2
        assert [list(r.loaded) for r in sreplicas] == [[], [A.int_id]]

    asyncio.run(run())


def test_a_new_version_starts_where_the_old_one_is_loaded():
    async def run():
        router, replicas = make(n=3)
        await router.start()
        await router.place(A)
        await router.load_on(2, A)  # a request took it to replica 2 as well
        A2 = AdapterRef("a", 9, "/x/a2", version=2, size_bytes=60)
        assert await router.place(A2, replacing=A.int_id) == [0, 2]
        assert [A2.int_id in r.loaded for r in replicas] == [True, False, True]
        # The old version was loaded nowhere (an engine rebuilt meanwhile): one replica still checks it
        A3 = AdapterRef("a", 10, "/x/a3", version=3, size_bytes=60)
        assert await router.place(A3, replacing=77) == [1]

    asyncio.run(run())


def test_a_request_on_a_replica_without_its_adapter_loads_it_there_first():
    async def run():
        router, replicas = make(dispatch="least_loaded")
        await router.start()
        await router.place(A)  # replica 0 only
        # Two at once: the second goes to the replica with fewer requests, which lacks the adapter
        outs = await asyncio.gather(*(collect(router, request(f"r{i}", A)) for i in range(2)))
        assert outs == [reference_tokens("a", (1, 2, 3), 4)] * 2
        assert [r.add_calls for r in replicas] == [1, 1]
        assert all(A.int_id in r.loaded for r in replicas)
        await router.unload_everywhere(A.int_id)
        assert not any(A.int_id in r.loaded for r in replicas) and not any(s.loaded for s in router.slots)

    asyncio.run(run())


def test_the_least_recently_used_adapter_is_unloaded_to_make_room_and_comes_back_on_demand():
    async def run():
        router, (replica,) = make(n=1, host_cache_bytes=130)  # two of A, B, C (60 bytes each) fit
        await router.start()
        await router.place(A)
        await router.place(B)  # 120 of 130
        await collect(router, request("a1", A))  # A is now the most recent use
        await router.place(C)  # evicts B, the least recently used
        assert sorted(replica.loaded) == [A.int_id, C.int_id]
        assert router.slots[0].cache.ids() == [A.int_id, C.int_id]
        assert B.int_id not in router.slots[0].loaded
        assert await collect(router, request("b1", B)) == reference_tokens("b", (1, 2, 3), 4)  # loaded again
        assert sorted(replica.loaded) == [B.int_id, C.int_id]  # ... in place of A, used before C
        stats = await replica.stats()
        assert router.host_bytes(stats) == 120

    asyncio.run(run())


def test_pinned_and_busy_adapters_stay_and_a_load_with_no_room_fails_as_a_503():
    async def run():
        router, (replica,) = make(n=1, host_cache_bytes=150, step_s=0.01)
        await router.start()
        await router.place(P, pinned=True)  # 30, never evicted
        await router.place(A)  # 90 of 150
        long_a = asyncio.create_task(collect(router, request("long", A, n=100)))
        while A.int_id not in router.in_use_on(router.slots[0]):
            await asyncio.sleep(0.001)
        await collect(router, request("b", B))  # 150 of 150: fits
        await collect(router, request("c", C))  # B goes: P is pinned, A busy
        assert sorted(replica.loaded) == [A.int_id, C.int_id, P.int_id]
        busy_c = asyncio.create_task(collect(router, request("long-c", C, n=100)))
        while C.int_id not in router.in_use_on(router.slots[0]):
            await asyncio.sleep(0.001)
        # dispatch sees that no replica could free B's bytes (P pinned, A and C busy): refused
        # before any engine call, as a 503 the client may retry
        with pytest.raises(NoEligibleReplica, match="retry later") as refused:
            await collect(router, request("b2", B))
        assert refused.value.http_status == 503
        assert sorted(replica.loaded) == [A.int_id, C.int_id, P.int_id]  # nothing was unloaded for it
        assert await long_a == reference_tokens("a", (1, 2, 3), 100)
        await busy_c
        assert await collect(router, request("b3", B)) == reference_tokens("b", (1, 2, 3), 4)  # A may go now
        assert P.int_id in replica.loaded

    asyncio.run(run())


def test_an_adapter_larger_than_the_budget_is_refused_before_any_engine_call():
    async def run():
        router, replicas = make(host_cache_bytes=50)
        await router.start()
        with pytest.raises(AdapterTooLarge, match="engine.max_cpu_lora_mib"):
            await router.place(A)
        assert all(r.add_calls == 0 for r in replicas)

    asyncio.run(run())


async def hot(router: Router, on_0: AdapterRef, on_1: AdapterRef) -> None:
    """Requests for `on_0` on replica 0 only, and fewer for `on_1` on replica 1 only."""
    for rid, ref, n in ((0, on_0, 4), (1, on_1, 1)):
        router.slot(1 - rid).healthy = False
        for i in range(n):
            await collect(router, request(f"{ref.name}{i}", ref, n=1))
        router.slot(1 - rid).healthy = True


def test_preload_counts_bytes_when_the_cache_has_a_budget():
    """The hot adapter is too big for the bytes replica 1 has left (its adapter has traffic too, so
    it is not free to go), though a slot is free there."""

    async def run():
        big = AdapterRef("big", 5, "/x/big", size_bytes=100)
        router, replicas = make(host_cache_bytes=120)
        await router.start()
        await router.load_on(0, big)
        await router.load_on(1, A)  # 60 of 120: 60 left for a 100-byte copy
        refs = {"big": big, "a": A}
        balancer = Balancer(router, adapter_ref=lambda n: refs[n], cfg=ClusterConfig(num_replicas=2))
        await hot(router, big, A)
        plan = await balancer.maybe_preload()
        assert plan is not None and plan.loads == ()
        assert big.int_id not in replicas[1].loaded

        slots, sreplicas = make()  # counted in slots, the copy fits
        await slots.start()
        await slots.load_on(0, big)
        await slots.load_on(1, A)
        sbalancer = Balancer(slots, adapter_ref=lambda n: refs[n], cfg=ClusterConfig(num_replicas=2))
        await hot(slots, big, A)
        assert (await sbalancer.maybe_preload()).loads == (("big", 1),)

    asyncio.run(run())


def test_requests_started_with_a_preferred_replica_go_there_unless_it_stopped_serving():
    """A batch plan's placement reaches the router through `preferred_replica`, set in the task that
    sends the request; round-robin dispatch would have spread them."""
    from dlora.cluster.router import preferred_replica

    async def where(router: Router, req: GenerateRequest, rid: int | None) -> int:
        preferred_replica.set(rid)
        seen = None
        async for _ in router.generate(req):
            seen = seen if seen is not None else router.requests[req.request_id].slot.replica_id
        return seen

    async def run():
        router, replicas = make(n=3)
        await router.start()
        placed = await asyncio.gather(*(asyncio.create_task(where(router, request(f"r{i}", A), 2)) for i in range(4)))
        assert placed == [2, 2, 2, 2]
        assert [A.int_id in r.loaded for r in replicas] == [False, False, True]  # loaded where they went
        router.slot(2).healthy = False
        assert await asyncio.create_task(where(router, request("r9", None), 2)) in (0, 1)
        assert await asyncio.create_task(where(router, request("r10", None), None)) in (0, 1)

    asyncio.run(run())
