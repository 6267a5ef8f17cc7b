"""The router's prefix-aware dispatch over toy replicas: a repeated prompt goes back to the
replica that computed it while that replica's backlog costs less than the prefill it saves; the
same text under another adapter gets no credit; locality-blind dispatch modes ignore it."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica

B = AdapterRef("b", 2, "/x/b", digest="b" * 64)
HISTORY = tuple(range(1000, 1512))  # four 128-token blocks
# Prefill priced high, so the 512 cached tokens (5.1 s) outweigh any toy backlog
SLOW_PREFILL = CostParams(per_prefill_token_s=0.01)


def request(rid: str, prompt=HISTORY, adapter=None, n: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingSpec(max_tokens=n), adapter)


async def drain(router: Router, req: GenerateRequest) -> None:
    async for _ in router.generate(req):
        pass


async def scenario(dispatch: str, prefix_aware: bool) -> tuple[Router, dict[str, int]]:
    router = Router(
        [ToyReplica(i, step_s=0.002) for i in range(2)],
        cfg=RouterConfig(dispatch=dispatch, prefix_aware=prefix_aware),
    )
    router.cost_models = {i: ReplicaCostModel(SLOW_PREFILL) for i in range(2)}
    await router.start()
    placed: dict[str, int] = {}

    async def send(req: GenerateRequest) -> asyncio.Task:
        task = asyncio.create_task(drain(router, req))
        while req.request_id not in router.requests or router.requests[req.request_id].slot is None:
            await asyncio.sleep(0.001)
        placed[req.request_id] = router.requests[req.request_id].slot.replica_id
        return task

    await (await send(request("first")))
    busy = await send(request("busy", prompt=range(5000, 5010), n=300))  # a backlog where "first" ran
    again = await send(request("again"))
    # the balancer's views carry it too, for the moves it plans
    placed["again_cached_in_views"] = next(
        r.cached_on(placed["first"]) for v in router.views() for r in v.requests if r.request_id == "again"
    )
    other = await send(request("other-adapter", adapter=B))
    await asyncio.gather(busy, again, other)
    await router.shutdown()
    return router, placed


@pytest.mark.parametrize("dispatch", ["proactive", "slo_feasible"])
def test_a_repeated_prompt_returns_to_its_replica_despite_its_backlog(dispatch):
    router, placed = asyncio.run(scenario(dispatch, prefix_aware=True))
    assert placed["busy"] == placed["first"]  # nothing cached for it anywhere: the lower id of two idle
    assert placed["again"] == placed["first"]  # its history is cached there: worth the wait
    assert placed["again_cached_in_views"] == len(HISTORY) - 128  # vLLM computes its last block again
    assert placed["other-adapter"] != placed["first"]  # the same text under adapter b: no credit
    assert router.counters["locality_dispatches"] == 1  # blind to the caches, "again" would have gone elsewhere


def test_without_prefix_awareness_the_repeat_goes_to_the_idle_replica():
    router, placed = asyncio.run(scenario("proactive", prefix_aware=False))
    assert placed["again"] != placed["first"]
    assert router.counters["locality_dispatches"] == 0


def test_least_loaded_stays_blind_to_prefix_caches():
    router, placed = asyncio.run(scenario("least_loaded", prefix_aware=True))
    assert placed["again"] != placed["first"]
    assert router.counters["locality_dispatches"] == 0
