"""A replica whose node cannot get an adapter's files fails only that adapter there: the router
places, loads and resubmits the adapter's requests on the other replicas, the replica keeps
serving everything else, and the error names the adapter and the node (in-process replicas)."""

from __future__ import annotations

import asyncio
import pickle
import re
from dataclasses import dataclass, field

import pytest
from ray.exceptions import RayTaskError

from dlora.cluster.router import Router, RouterConfig, preferred_replica
from dlora.replica.errors import AdapterUnavailable
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import RayReplica, stream_error
from dlora.sim.toy_replica import ToyReplica, reference_tokens

A = AdapterRef("a", 1, "/snap/a-1")
B = AdapterRef("b", 2, "/snap/b-2")
NODE = "10.0.0.9 (node 4f2a)"


@dataclass
class NodeWithout(ToyReplica):
    """A replica on a node that cannot get adapter "a"'s files: its load fails, and a request that
    reaches it with the adapter loaded elsewhere fails in its stream (as EngineHost.generate would)."""

    served: list[str] = field(default_factory=list)  # requests it generated for

    def lacks(self, ref: AdapterRef | None) -> bool:
        return ref is not None and ref.name == "a"

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        if self.lacks(ref):
            raise AdapterUnavailable(ref.name, NODE, "fetching its files failed: object lost")
        await super().add_adapter(ref, pinned)

    def generate(self, req: GenerateRequest):
        if not self.lacks(req.adapter):
            self.served.append(req.request_id)
            return super().generate(req)

        async def fail():
            raise stream_error(AdapterUnavailable("a", NODE, "object lost")).exception(self.replica_id)
            yield  # an async generator

        return fail()


def request(rid: str, adapter: AdapterRef | None, n: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), adapter)


async def collect(router: Router, req: GenerateRequest, on: int | None = None) -> list[int]:
    token = preferred_replica.set(on)
    try:
        return [t async for d in router.generate(req) for t in d.token_ids]
    finally:
        preferred_replica.reset(token)


def test_the_error_names_adapter_and_node_and_crosses_ray_and_the_output_stream():
    e = AdapterUnavailable("a", NODE, "the files fetched have digest 00, not 11")
    assert str(e) == f"adapter 'a' is unavailable on node {NODE}: the files fetched have digest 00, not 11"
    crossed = stream_error(e).exception(replica_id=1)
    assert isinstance(crossed, AdapterUnavailable)
    assert (crossed.name, crossed.node, crossed.why) == (e.name, NODE, e.why)

    class Actor:
        class add_adapter:  # noqa: N801  (an actor method's .remote)
            @staticmethod
            def remote(ref, pinned):
                async def raised():
                    raise RayTaskError("ReplicaActor.add_adapter", "...", pickle.loads(pickle.dumps(e)))

                return raised()

    with pytest.raises(AdapterUnavailable) as info:  # not a ReplicaFailure: the replica is fine
        asyncio.run(RayReplica(1, Actor()).add_adapter(A))
    assert info.value.node == NODE


def test_requests_for_an_adapter_a_node_lacks_run_on_the_other_replicas():
    async def run():
        lacking, good = NodeWithout(0), ToyReplica(1)
        router = Router([lacking, good], cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        # registration places it on the replica that can get it, although replica 0 comes first
        assert await router.place(A) == [1]
        assert await router.place(B) == [0]
        for i in range(4):  # sent to replica 0 by name and by turn: each completes on replica 1
            assert await collect(router, request(f"a{i}", A), on=0) == reference_tokens("a", (1, 2, 3), 8)
        assert await collect(router, request("b", B), on=0) == reference_tokens("b", (1, 2, 3), 8)
        assert await collect(router, request("base", None), on=0) == reference_tokens(None, (1, 2, 3), 8)
        assert router.slots[0].unavailable == {A.int_id} and all(s.healthy for s in router.slots)
        assert lacking.served == ["b", "base"]  # it still serves everything else
        await router.shutdown()

    asyncio.run(run())


def test_a_stream_that_cannot_get_its_adapter_is_resubmitted_and_pinned_loads_skip_that_node():
    async def run():
        lacking, good = NodeWithout(0), ToyReplica(1)
        router = Router([lacking, good], cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        await router.load_everywhere(A, pinned=True)  # loads on replica 1, replica 0 left out
        assert A.int_id in good.loaded and A.int_id not in lacking.loaded
        router.slots[0].unavailable.clear()
        router.slots[0].loaded[A.int_id] = "a"  # as if loaded there before its node lost the files
        assert await collect(router, request("s", A), on=0) == reference_tokens("a", (1, 2, 3), 8)
        assert router.slots[0].unavailable == {A.int_id} and router.counters["resubmissions"] == 1
        await router.shutdown()

    asyncio.run(run())


def test_an_adapter_no_node_can_get_fails_with_its_reason_not_as_unknown():
    async def run():
        router = Router([NodeWithout(0), NodeWithout(1)], cfg=RouterConfig(dispatch="round_robin"))
        await router.start()
        with pytest.raises(AdapterUnavailable, match=re.escape(f"adapter 'a' is unavailable on node {NODE}")):
            await router.place(A)
        with pytest.raises(AdapterUnavailable, match="adapter 'a' is unavailable"):
            await collect(router, request("x", A))
        assert all(s.healthy for s in router.slots)
        await router.shutdown()

    asyncio.run(run())
