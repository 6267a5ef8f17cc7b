"""The router's SLO accounting on in-process replicas: every request that finished by itself is
judged once, by its adapter's SLO, with times from its arrival at the router; aborted ones are not;
isolated times come from the replicas' cost models; an unregistered adapter's counts go."""

from __future__ import annotations

import asyncio
import time

import pytest

from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica
from dlora.slo.config import AdapterSlo, SloConfig
from dlora.slo.isolated import isolated_times

A = AdapterRef("a", 1, "/x/a")
B = AdapterRef("b", 2, "/x/b")
LOOSE = AdapterSlo(ttft_s=60.0, tpot_s=10.0)  # met by any toy request
TIGHT = AdapterSlo(ttft_s=60.0, tpot_s=1e-6)  # no toy step is that short: missed on TPOT


def request(rid: str, adapter=A, n: int = 5, prompt=(1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(rid, tuple(prompt), SamplingSpec(max_tokens=n), adapter)


async def drain(router: Router, req: GenerateRequest) -> None:
    async for _ in router.generate(req):
        pass


def make(n: int = 1, step_s: float = 0.002, slo: SloConfig | None = None, **toy) -> tuple[Router, list[ToyReplica]]:
    replicas = [ToyReplica(i, step_s=step_s, **toy) for i in range(n)]
    return Router(replicas, cfg=RouterConfig(slo=slo or SloConfig())), replicas


def test_each_finished_request_is_judged_once_by_its_adapters_slo():
    async def run():
        router, _ = make()
        await router.start()
        router.slo.set_target("a", LOOSE)
        router.slo.set_target("b", TIGHT)
        await asyncio.gather(*(drain(router, request(f"a{i}")) for i in range(3)))
        await asyncio.gather(*(drain(router, request(f"b{i}", adapter=B)) for i in range(2)))
        counts = router.slo.counts()
        assert (counts["a"].requests, counts["a"].attained) == (3, 3)
        assert (counts["b"].requests, counts["b"].attained, counts["b"].ttft_met, counts["b"].tpot_met) == (2, 0, 2, 0)

    asyncio.run(run())


def test_times_run_from_arrival_and_normalized_latency_uses_the_cost_models():
    async def run():
        # One replica priced at 10 ms a step and 1 ms a prompt token: a 3-token prompt with 5 outputs
        # takes 0.013 + 4 x 0.011 = 0.057 s alone.
        router, _ = make(step_s=0.01)
        params = CostParams(per_iteration_s=0.01, per_decode_token_s=0.001, per_prefill_token_s=0.001)
        router.cost_models[0] = ReplicaCostModel(params)
        await router.refresh_stats()  # the accounting's basis follows the cost models
        assert router.slo.basis.per_iteration_s == pytest.approx(0.01)
        await router.start()
        t0 = time.monotonic()
        await drain(router, request("r", adapter=None, n=5))
        outer = time.monotonic() - t0
        c = router.slo.counts()[None]  # the base model is counted too
        iso = isolated_times(params, 3).execution_s(5)
        assert c.requests == 1 and c.mean_isolated_s == pytest.approx(iso)
        # the toy sleeps 10 ms per token: 5 tokens take at least 50 ms, and no more than the caller saw
        assert 0.05 / iso <= c.mean_normalized_latency <= outer / iso

    asyncio.run(run())


def test_relative_default_is_k_times_the_isolated_times():
    async def run():
        # Isolated TTFT 0.1 + 3 x 0.0002 and TPOT 0.1 + 0.001: k = 5 gives about 0.5 s each, which a
        # 2 ms toy step meets; with the cost-model priors (TTFT 4.6 ms, TPOT 5 ms: targets 23 and
        # 25 ms) a 50 ms toy step misses both.
        fast, _ = make(step_s=0.002)
        fast.cost_models[0] = ReplicaCostModel(CostParams(per_iteration_s=0.1))
        await fast.refresh_stats()
        slow, _ = make(step_s=0.05)
        for router in (fast, slow):
            await router.start()
            await drain(router, request("r", n=4))
        assert fast.slo.counts()["a"].attained == 1
        assert (slow.slo.counts()["a"].ttft_met, slow.slo.counts()["a"].tpot_met) == (0, 0)

    asyncio.run(run())


def test_absolute_default_applies_to_adapters_without_their_own():
    async def run():
        router, _ = make(slo=SloConfig(ttft_s=60.0, tpot_s=1e-6))
        await router.start()
        router.slo.set_target("b", LOOSE)
        await drain(router, request("a"))
        await drain(router, request("b", adapter=B))
        assert router.slo.counts()["a"].attained == 0 and router.slo.counts()["b"].attained == 1

    asyncio.run(run())


def test_a_migrated_request_is_judged_once_by_its_first_token():
    async def run():
        # 20 ms a token; moved after 10 tokens, so its second leg's first token comes >= 0.2 s after
        # arrival: a TTFT target of 0.15 s is met only if the first leg's first token counts.
        router, _ = make(n=2, step_s=0.02)
        router.slo.set_target("a", AdapterSlo(ttft_s=0.15, tpot_s=10.0))
        await router.start()
        task = asyncio.create_task(drain(router, request("m", n=30)))
        while len(router.requests["m"].generated if "m" in router.requests else []) < 10:
            await asyncio.sleep(0.001)
        src = router.requests["m"].slot.replica_id
        assert await router.migrate("m", 1 - src)
        await task
        assert router.counters["migrations"] == 1
        c = router.slo.counts()["a"]
        assert (c.requests, c.ttft_met, c.attained) == (1, 1, 1)
        assert c.latency_sum_s >= 30 * 0.02  # both legs: from arrival to the last token

    asyncio.run(run())


def test_aborted_requests_are_not_judged():
    async def run():
        router, _ = make(step_s=0.01)
        await router.start()
        await drain(router, request("done", n=2))
        gone = asyncio.create_task(drain(router, request("gone", n=200)))
        while not getattr(router.requests.get("gone"), "generated", None):  # it has produced a token
            await asyncio.sleep(0.001)
        gone.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert router.slo.counts()["a"].requests == 1  # "done" alone

    asyncio.run(run())


def test_a_forgotten_adapter_is_dropped_from_the_counts():
    async def run():
        router, _ = make()
        await router.start()
        router.slo.set_target("a", TIGHT)
        await drain(router, request("a"))
        await drain(router, request("b", adapter=B))
        router.slo.forget("a")
        assert set(router.slo.counts()) == {"b"} and router.slo.target("a") is None

    asyncio.run(run())
