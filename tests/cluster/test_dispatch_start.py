"""Dispatch by when a replica would start a request (`cluster.dispatch_start_slack_s`): the router
times each replica's steps from the tokens it streams (toy replicas, one slow and one fast)."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.router import Router, RouterConfig, preferred_replica
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens

SLOW_STEP_S, FAST_STEP_S = 0.5, 0.02


def request(rid: str, n: int) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), None)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    return [t async for d in router.generate(req) for t in d.token_ids]


def start_on(router: Router, replica_id: int, req: GenerateRequest) -> asyncio.Task:
    token = preferred_replica.set(replica_id)  # the task copies the context as it is now
    try:
        return asyncio.create_task(collect(router, req))
    finally:
        preferred_replica.reset(token)


def run_with(slack: float | None) -> tuple[float, float, int, list[list[int]]]:
    """Replica 0 (0.5 s steps) runs a short request, replica 1 (20 ms steps) a long one. Just after
    replica 0 streamed a token, a new request comes. Returns both replicas' step_left_s then, where
    the new request went, and every output."""

    async def run():
        replicas = [ToyReplica(0, step_s=SLOW_STEP_S), ToyReplica(1, step_s=FAST_STEP_S)]
        router = Router(replicas, cfg=RouterConfig(dispatch_start_slack_s=slack))
        await router.start()
        for rid, step_s in ((0, SLOW_STEP_S), (1, FAST_STEP_S)):  # what fitting their measured steps gives
            router.cost_models[rid] = ReplicaCostModel(CostParams(per_iteration_s=step_s, per_decode_token_s=0.0))
        short = start_on(router, 0, request("short", 4))
        long = start_on(router, 1, request("long", 150))

        def streaming(rid: str) -> bool:
            return rid in router.requests and bool(router.requests[rid].generated)

        while not (streaming("short") and streaming("long")):
            await asyncio.sleep(0.002)
        left = {v.replica_id: v.step_left_s for v in router.dispatch_views()}
        new = asyncio.create_task(collect(router, request("new", 2)))
        while "new" not in router.requests or router.requests["new"].slot is None:
            await asyncio.sleep(0.001)
        where = router.requests["new"].slot.replica_id
        outs = await asyncio.gather(short, long, new)
        await router.shutdown()
        return left[0], left[1], where, outs

    return asyncio.run(run())


def test_the_router_sends_a_request_to_the_replica_whose_step_ends_first():
    left_slow, left_fast, where, outs = run_with(0.05)
    # replica 0 streamed its token a moment ago: most of its 0.5 s step is still ahead
    assert 0.2 < left_slow <= SLOW_STEP_S
    assert left_fast <= FAST_STEP_S
    assert where == 1
    assert outs == [reference_tokens(None, (1, 2, 3), n) for n in (4, 150, 2)]


def test_without_the_slack_pending_time_alone_picks_the_lighter_replica():
    _, _, where, _ = run_with(None)
    assert where == 0  # 3 tokens left there against 149 on replica 1


@pytest.mark.parametrize("slack", [0.05, None])
def test_an_idle_replica_has_no_step_left(slack):
    async def run():
        router = Router([ToyReplica(0), ToyReplica(1)], cfg=RouterConfig(dispatch_start_slack_s=slack))
        await router.start()
        left = [v.step_left_s for v in router.dispatch_views()]
        await router.shutdown()
        return left

    assert asyncio.run(run()) == [0.0, 0.0]
