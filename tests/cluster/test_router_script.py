"""The router over toy replicas through a fixed script, against a recorded run.

Dispatch across adapters in a held burst (every request placed before any token flows), direct
moves, a balancer round that re-sums the dispatch sums before it plans (expected lengths moved as
other requests finished), a balancer round of queued moves, an adapter unload under a host cache counted in bytes, a
replica killed and rebuilt under load, a replica added and drained with work on it, and the SLO
and static-placement dispatch branches. After each phase the router's counters, sums and views
are compared with `data/router_script.json`, so any change to what the router decides or counts
shows up as a difference. The router's clock is the script's; adapter loads are priced at a fixed
time (their measured duration is wall-clock); the replicas emit tokens without sleeping, so the
order of events is the event loop's alone. Rewrite the record, from a build known to be right,
with `python -m tests.cluster.test_router_script`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlora.cluster.balancer import Balancer
from dlora.cluster.estimators.replica_cost import ReplicaCostModel
from dlora.cluster.router import Router, RouterConfig, preferred_replica
from dlora.config import ClusterConfig
from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica, reference_tokens
from dlora.slo.config import SloConfig

GOLDEN = Path(__file__).parent / "data" / "router_script.json"

P = AdapterRef("p", 9, "/x/p", size_bytes=50)  # pinned on every replica
A = AdapterRef("a", 1, "/x/a", size_bytes=100)
B = AdapterRef("b", 2, "/x/b", size_bytes=100)
C = AdapterRef("c", 3, "/x/c", size_bytes=120)
D = AdapterRef("d", 4, "/x/d", size_bytes=100)  # a fifth adapter: a load must unload another
REFS = {r.name: r for r in (P, A, B, C, D)}
EOS = {"b": 7, None: 11}  # b's and the base model's requests end early, each at its own length
LOAD_S = 0.01  # what every adapter load is measured to take


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class HeldReplica(ToyReplica):
    """A toy replica that, while `holding`, keeps each new request before its engine sees it, until
    `release`: a burst is placed whole before any token flows. A held request can be aborted (its
    stream ends "abort", as a queued one's does) and fails with the replica."""

    holding: bool = False
    held: dict[str, asyncio.Future] = field(default_factory=dict)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        self._check()
        if self.holding:
            fut = asyncio.get_running_loop().create_future()
            self.held[req.request_id] = fut
            try:
                go = await fut
            finally:
                self.held.pop(req.request_id, None)
            if not go:
                yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
                return
        async for d in super().generate(req):
            yield d

    def release(self) -> None:
        self.holding = False
        for fut in self.held.values():
            if not fut.done():
                fut.set_result(True)

    async def abort(self, request_id: str) -> None:
        fut = self.held.get(request_id)
        if fut is None:
            await super().abort(request_id)
            return
        self._check()
        if not fut.done():
            fut.set_result(False)

    def kill(self) -> None:
        super().kill()
        for fut in self.held.values():
            if not fut.done():
                fut.set_exception(ReplicaFailure(f"replica {self.replica_id} is dead"))


def plain(x: Any) -> Any:
    """JSON-ready, order-stable, floats rounded (sums kept in different orders differ in the last bits)."""
    if isinstance(x, float):
        return x if math.isinf(x) else round(x, 9)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=str)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def snapshot(router: Router, replicas: list[HeldReplica], views: bool = True) -> dict[str, Any]:
    """What the router counts and shows. `views`: also the balancer's per-request views."""
    out: dict[str, Any] = {
        "counters": dict(router.counters),
        "arrivals_total": router.arrivals_total,
        "output_tokens_total": router.output_tokens_total,
        "finished_total": router.finished_total,
        "finished_tokens_total": router.finished_tokens_total,
        "in_flight": sorted(router.requests),
        "inflight_by_adapter": dict(router.inflight_by_adapter),
        "routed_counts": router.routed_counts(),
        "serving_ids": router.serving_ids(),
        "may_serve_soon": router.may_serve_soon(),
        "next_replica_id": router.next_replica_id,
        "adapter_rates": router.adapter_rates(60.0),
        "cost_params": router.cost_params(),
        "slo_counts": router.slo.counts(),
        "output_lengths": {a: router.output_lengths.samples(a) for a in (None, "a", "b", "c", "d", "p")},
        "slots": [
            {
                "replica_id": s.replica_id,
                "healthy": s.healthy,
                "draining": s.draining,
                "restarts": s.restarts,
                "failed_restarts": s.failed_restarts,
                "gave_up": s.gave_up,
                "loaded": s.loaded,
                "cache": None if s.cache is None else (s.cache.ids(), s.cache.used_bytes),
                "in_use": router.in_use_on(s),
                "state": s.state(False),
            }
            for s in router.slots
        ],
        "replicas": [
            {"id": r.replica_id, "started": r.started, "loaded": r.loaded, "adds": r.add_calls} for r in replicas
        ],
        "reported": [
            (st.replica_id, st.healthy, st.num_unfinished, st.resident_adapter_ids) for st in router.reported_stats()
        ],
        "host_bytes": [router.host_bytes(st) for st in router.reported_stats()],
        "dispatch_views": router.dispatch_views(),
    }
    if views:
        out["views"] = router.views()
    return plain(out)


def request(rid: str, adapter: AdapterRef | None, n: int, prompt: tuple[int, ...]) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingSpec(max_tokens=n), adapter)


async def run_one(router: Router, req: GenerateRequest, placed: dict[str, int]) -> dict[str, Any]:
    """The request's stream: where its first leg went, its tokens (checked against an undisturbed
    run) and how it ended."""
    tokens: list[int] = []
    reason = None
    async for d in router.generate(req):
        if req.request_id not in placed and req.request_id in router.requests:
            slot = router.requests[req.request_id].slot
            placed[req.request_id] = -1 if slot is None else slot.replica_id
        tokens += d.token_ids
        reason = d.finish_reason if d.finished else reason
    name = req.adapter.name if req.adapter else None
    assert tokens == reference_tokens(name, req.prompt_token_ids, req.sampling.max_tokens, EOS)
    return {"tokens": len(tokens), "finish": reason}


async def until(cond) -> None:
    """Turn the event loop until `cond()` holds (the replicas never sleep: only turns count)."""
    for _ in range(100_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the script stalled")


def sent(router: Router, rids) -> bool:
    return all(rid in router.requests and router.requests[rid].engine_request_id is not None for rid in rids)


def burst(prefix: str, n: int, adapters: list[AdapterRef | None], base: int = 0) -> list[GenerateRequest]:
    return [
        request(f"{prefix}{i}", adapters[i % len(adapters)], 8 + 5 * ((i * 7) % 6), (base + i, 2, 3 + i % 4))
        for i in range(n)
    ]


async def main_script() -> dict[str, Any]:
    clock = Clock()
    replicas = [HeldReplica(i, step_s=0.0, eos_period=EOS) for i in range(2)]
    cfg = RouterConfig(dispatch="proactive", host_cache_bytes=400, adapter_slots=4)
    router = Router(replicas, pinned_adapters=lambda: [P], cfg=cfg, clock=clock)
    record: dict[str, Any] = {}
    placed: dict[str, int] = {}

    await router.start()
    record["started"] = snapshot(router, replicas)

    record["placed"] = {r.name: await router.place(r) for r in (A, B, C)}
    await router.refresh_stats()
    record["after_place"] = snapshot(router, replicas)

    # A held burst: each dispatch decision sees the ones before it.
    for r in replicas:
        r.holding = True
    reqs = burst("h", 10, [A, B, C, None, P])
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in reqs]
    for i in range(len(reqs)):
        await until(lambda i=i: sent(router, [reqs[i].request_id]))
        clock.advance(0.25)
    await router.refresh_stats()
    record["burst_held"] = snapshot(router, replicas)
    record["burst_placed"] = {rid: router.requests[rid].slot.replica_id for rid in sorted(router.requests)}
    # Direct moves of held requests, then everything runs.
    moves = {}
    for rid in ("h1", "h4"):
        src = router.requests[rid].slot.replica_id
        moves[rid] = await router.migrate(rid, 1 - src)
    record["moves"] = moves
    clock.advance(1.0)
    for r in replicas:
        r.release()
    record["burst_results"] = dict(zip([q.request_id for q in reqs], await asyncio.gather(*tasks)))
    await router.refresh_stats()
    record["after_burst"] = snapshot(router, replicas)

    balancer = Balancer(
        router,
        adapter_ref=lambda name: REFS[name],
        cfg=ClusterConfig(num_replicas=2, monitor_interval_s=1.0, event_moves_min_wait_s=None),
    )
    # A balancer round plans from exact sums: requests held on replica 0 were priced before others
    # finished on replica 1 and moved the expected lengths; nobody has waited long enough to move.
    replicas[0].holding = True
    token = preferred_replica.set(0)
    held = burst("r", 3, [A, None], base=20)
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in held]
    preferred_replica.reset(token)
    await until(lambda: sent(router, [q.request_id for q in held]))
    token = preferred_replica.set(1)
    done = burst("f", 4, [B, None, P], base=30)
    record["finished_meanwhile"] = dict(
        zip([q.request_id for q in done], await asyncio.gather(*(run_one(router, q, placed) for q in done)))
    )
    preferred_replica.reset(token)
    record["sums_before_round"] = plain(router.dispatch_views())
    assert await balancer.move_queued() is None
    record["sums_after_round"] = plain(router.dispatch_views())
    replicas[0].release()
    record["held_results"] = dict(zip([q.request_id for q in held], await asyncio.gather(*tasks)))

    # A balancer round: requests queued on replica 0 move to replica 1, which can start them.
    replicas[0].holding = True
    token = preferred_replica.set(0)
    reqs = burst("q", 4, [A, None, D])
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in reqs]
    preferred_replica.reset(token)
    await until(lambda: sent(router, [q.request_id for q in reqs]))
    clock.advance(2.0)
    queued_round = await balancer.move_queued()
    assert queued_round is not None
    record["queued_round"] = plain(
        {
            "trigger": queued_round.trigger.reason,
            "moves": queued_round.plan.moves,
            "loads": queued_round.plan.loads,
            "moved": queued_round.moved,
        }
    )
    replicas[0].release()
    record["queued_results"] = dict(zip([q.request_id for q in reqs], await asyncio.gather(*tasks)))
    await router.refresh_stats()
    record["after_queued"] = snapshot(router, replicas)

    # An unload: b leaves every replica and its host caches.
    clock.advance(1.0)
    await router.unload_everywhere(B.int_id)
    record["after_unload"] = snapshot(router, replicas)

    # A replica killed under load; it is rebuilt and its requests continue elsewhere.
    reqs = burst("k", 6, [A, B, None], base=40)
    reqs = [dataclasses.replace(q, sampling=SamplingSpec(max_tokens=60)) for q in reqs]
    for r in replicas:
        r.holding = True
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in reqs]
    await until(lambda: sent(router, [q.request_id for q in reqs]))
    record["kill_placed"] = {q.request_id: router.requests[q.request_id].slot.replica_id for q in reqs}
    record["kill_dispatch_views"] = plain(router.dispatch_views())
    victim = router.requests["k0"].slot.replica_id
    for r in replicas:
        r.release()
    await until(lambda: len(router.requests["k0"].generated) >= 3)
    replicas[victim].kill()
    clock.advance(1.0)
    record["kill_results"] = dict(zip([q.request_id for q in reqs], await asyncio.gather(*tasks)))
    await until(lambda: all(s.healthy for s in router.slots))
    await router.refresh_stats()
    record["after_kill"] = snapshot(router, replicas)

    # A replica added (a preloaded) and drained with held work on it.
    extra = HeldReplica(router.next_replica_id, step_s=0.0, eos_period=EOS)
    replicas.append(extra)
    await router.add_replica(extra, preload=[A])
    await router.refresh_stats()
    record["after_add"] = snapshot(router, replicas)
    extra.holding = True
    token = preferred_replica.set(extra.replica_id)
    reqs = burst("d", 3, [A, None], base=80)
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in reqs]
    preferred_replica.reset(token)
    await until(lambda: sent(router, [q.request_id for q in reqs]))
    drained = await router.drain(extra.replica_id)
    record["drained"] = plain(drained)
    record["drain_results"] = dict(zip([q.request_id for q in reqs], await asyncio.gather(*tasks)))
    await router.refresh_stats()
    record["after_drain"] = snapshot(router, replicas)
    record["first_legs"] = dict(sorted(placed.items()))
    await router.shutdown()
    return record


async def slo_script() -> dict[str, Any]:
    """Aladdin's SLO-aware dispatch over a held burst, with one replica slower than the other."""
    clock = Clock()
    replicas = [HeldReplica(i, step_s=0.0, eos_period=EOS) for i in range(2)]
    router = Router(
        replicas,
        pinned_adapters=lambda: [A],
        cfg=RouterConfig(dispatch="slo_feasible", slo=SloConfig(ttft_s=0.3, tpot_s=0.008)),
        clock=clock,
    )
    await router.start()
    router.cost_models[1] = ReplicaCostModel(dataclasses.replace(router.cost_models[1].params, per_iteration_s=0.03))
    for r in replicas:
        r.holding = True
    reqs = [request(f"s{i}", A if i % 2 else None, 20 + 10 * i, (i, 5)) for i in range(8)]
    placed: dict[str, int] = {}
    tasks = [asyncio.create_task(run_one(router, q, placed)) for q in reqs]
    for q in reqs:
        await until(lambda q=q: sent(router, [q.request_id]))
        clock.advance(0.1)
    record = {"placed": {q.request_id: router.requests[q.request_id].slot.replica_id for q in reqs}}
    record["held"] = snapshot(router, replicas, views=False)
    for r in replicas:
        r.release()
    record["results"] = dict(zip([q.request_id for q in reqs], await asyncio.gather(*tasks)))
    record["after"] = snapshot(router, replicas)
    await router.shutdown()
    return record


async def static_script() -> dict[str, Any]:
    """Static placement: every adapter on its one home replica (id mod N), its requests there."""
    clock = Clock()
    replicas = [HeldReplica(i, step_s=0.0, eos_period=EOS) for i in range(3)]
    router = Router(replicas, pinned_adapters=lambda: [P], cfg=RouterConfig(static_placement=True), clock=clock)
    await router.start()
    record: dict[str, Any] = {"placed": {r.name: await router.place(r) for r in (A, B, C)}}
    reqs = burst("t", 6, [A, B, C, None])
    placed: dict[str, int] = {}
    record["results"] = dict(
        zip([q.request_id for q in reqs], await asyncio.gather(*(run_one(router, q, placed) for q in reqs)))
    )
    record["first_legs"] = dict(sorted(placed.items()))
    record["after"] = snapshot(router, replicas)
    await router.shutdown()
    return record


def run_script() -> dict[str, Any]:
    original = ReplicaCostModel.observe_load

    def fixed(self: ReplicaCostModel, seconds: float) -> None:
        original(self, LOAD_S)

    ReplicaCostModel.observe_load = fixed  # type: ignore[method-assign]
    try:
        return json.loads(
            json.dumps(
                {
                    "main": asyncio.run(main_script()),
                    "slo": asyncio.run(slo_script()),
                    "static": asyncio.run(static_script()),
                }
            )
        )
    finally:
        ReplicaCostModel.observe_load = original  # type: ignore[method-assign]


def test_the_scripted_run_matches_the_recorded_one():
    got = run_script()
    want = json.loads(GOLDEN.read_text())
    for part in want:
        for phase in want[part]:
            assert got[part][phase] == want[part][phase], f"{part}/{phase} differs"
    assert got == want


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(run_script(), indent=1, sort_keys=True) + "\n")
