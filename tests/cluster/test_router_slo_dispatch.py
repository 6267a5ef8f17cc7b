"""Aladdin's SLO-aware dispatch in the real router (toy replicas, the cost model's priors).

With a TPOT target of 10 ms and the prior step model (4 ms + 1 ms per sequence), a replica keeps
every request's TPOT with at most 6 decoding requests. `best_fit` packs requests onto the fullest
replica that still keeps them (6 on one, the rest on the other); `slo_feasible` takes the least
pending time among feasible replicas (it spreads them); a request no replica can keep is sent to
the least pending time and counted."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica
from dlora.slo.config import SloConfig


def burst_legs(mode: str, n: int, tpot_s: float = 0.010) -> tuple[list[int], Router]:
    """Dispatch `n` long base-model requests at once; the replica each one went to first."""

    async def run():
        replicas = [ToyReplica(i, step_s=0.0005) for i in range(2)]
        router = Router(replicas, cfg=RouterConfig(dispatch=mode, slo=SloConfig(ttft_s=60.0, tpot_s=tpot_s)))
        await router.start()
        first: dict[str, int] = {}
        choose = router._choose

        async def recording(state):
            slot = await choose(state)
            first.setdefault(state.request.request_id, slot.replica_id)
            return slot

        router._choose = recording  # type: ignore[method-assign]

        async def one(i: int) -> None:
            req = GenerateRequest(f"r{i:02d}", (1, 2, 3), SamplingSpec(max_tokens=100), None)
            async for _ in router.generate(req):
                pass

        tasks = []
        for i in range(n):  # one at a time, so each decision sees the ones before it running
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        return [first[f"r{i:02d}"] for i in range(n)], router

    return asyncio.run(run())


def test_best_fit_packs_the_fullest_replica_that_keeps_every_slo():
    legs, router = burst_legs("best_fit", 8)
    assert legs[:6] == [legs[0]] * 6  # 4 + 6 x 1 = 10 ms: the sixth still fits
    assert set(legs[6:]) == {1 - legs[0]}
    assert router.counters["slo_infeasible_dispatches"] == 0


def test_slo_feasible_spreads_requests_by_pending_time():
    legs, _ = burst_legs("slo_feasible", 8)
    assert legs.count(0) == legs.count(1) == 4


def test_a_request_no_replica_can_keep_goes_to_the_least_pending_time_and_is_counted():
    legs, router = burst_legs("best_fit", 14)  # 12 fit (6 each), then none does
    assert sorted(legs).count(0) in range(6, 9) and sorted(legs).count(1) in range(6, 9)
    assert router.counters["slo_infeasible_dispatches"] >= 2


def test_unknown_dispatch_modes_are_refused_naming_the_key():
    from dlora.config import ClusterConfig, ConfigError

    with pytest.raises(ConfigError, match="cluster.dispatch='fastest'"):
        ClusterConfig(dispatch="fastest")
    assert ClusterConfig(dispatch="best_fit").dispatch == "best_fit"
