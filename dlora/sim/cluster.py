"""The cluster's balancing policies at any replica count: the real router, dispatch and balancer over
simulated replicas.

The real-engine benchmark (bench/cluster_balancing) can run two replicas on this machine; dLoRA's
cluster figures come from more. Here `Router`, the dispatch policies and `Balancer` (co-migration ILP,
queued moves) run unchanged, in real time on one event loop, over `ToyReplica`s: each a queueing
model of an engine in which at most `max_running` requests generate at once, each at `step_s` per
token, the others wait in FIFO order (with `max_loras`, one whose adapter would be one adapter too
many is skipped for later ones, as vLLM does), and loading an adapter takes `load_s`. Left out: step
time growing with the batch, KV limits and merging; every replica may hold every adapter
(`adapter_slots` = the adapter count). The replicas' step time is one constant, not
`dlora.sim.step_costs`' batch-size model, because this simulation runs the real router in real time:
a queueing model is enough to exercise dispatch and migration, and the event-driven
`migration_bound` (with `StepCosts`) and `batching_sim` cover how step time grows with the batch.

The router is configured as a server with the policy's `cluster:` section would configure it
(`server_config`, through the server's own mapping `dlora.cluster.from_config.router_config`), so
the shipped dispatch defaults, the start slack included, are what runs. Its cost model is given the
replicas' true costs (a full batch's step shared by
`max_running` requests), which is what fitting measured steps converges to on a real engine. The
balancer's intervals are the real benchmark's in units of one request's service time
(`output_len` x `step_s`), so dispatch and migration react on the same relative time scale.

Queueing delay is the router's own measure (queue_time.py): seconds before a replica admitted the
request, summed over the replicas it was sent to, plus time held in the router.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from dlora.bench.popularity import zipf_weights
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.cluster.balancer import Balancer
from dlora.cluster.estimators.replica_cost import ReplicaCostModel
from dlora.cluster.from_config import router_config
from dlora.cluster.router import Replica, Router, static_home
from dlora.config import ClusterConfig, DloraConfig, EngineConfig
from dlora.cost.params import CostParams
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import VOCAB, ToyReplica

# name -> (dispatch, placement, migration), as bench/cluster_balancing's policies
POLICIES: dict[str, tuple[str, str, bool]] = {
    "round_robin_static": ("round_robin", "static", False),  # dLoRA's baseline: one home per adapter
    "round_robin": ("round_robin", "dynamic", False),  # every adapter everywhere, requests dealt in turn
    "proactive": ("proactive", "dynamic", False),
    "proactive_migration": ("proactive", "dynamic", True),  # dlora: + co-migration rounds and queued moves
}

# The real benchmark's balancer settings over its requests' service time (~4.4 s: 16 slots per
# replica at 3.6 req/s each): monitor every 0.5 s, a round at most every 2 s, queue trigger at 2 s.
MONITOR_PER_SERVICE = 0.5 / 4.4
ROUND_PER_SERVICE = 2.0 / 4.4


@dataclass(frozen=True)
class ClusterSimSpec:
    replicas: int = 8
    adapters: int = 32
    max_running: int = 8  # requests one replica generates at once (vLLM max_num_seqs)
    step_s: float = 0.02  # seconds per token of one request
    load_s: float = 0.05  # seconds to load an adapter on a replica
    max_loras: int | None = None  # distinct adapters one replica runs at once (vLLM max_loras; None: no limit)
    input_len: int = 48
    output_len: int = 32  # every request's max_tokens
    # Unknown lengths: adapter i's requests end like an EOS with probability 1/eos_means[i % len]
    # per token (geometric, capped at output_len); empty = every request runs to output_len.
    eos_means: tuple[int, ...] = ()
    alpha: float = 1.5  # Zipf skew over the adapters (a0 the most popular)
    cv: float = 3.0  # Gamma inter-arrival CV
    count_imbalance: int = 4

    @property
    def mean_output_len(self) -> float:
        if not self.eos_means:
            return float(self.output_len)
        cap = self.output_len
        means = [p * (1 - (1 - 1 / p) ** cap) for p in self.eos_means]  # a capped geometric's mean
        return statistics.fmean(means)

    @property
    def service_s(self) -> float:
        return self.mean_output_len * self.step_s

    @property
    def capacity_rps(self) -> float:
        """Requests per second the cluster completes when every slot is busy."""
        return self.replicas * self.max_running / self.service_s

    def names(self) -> list[str]:
        return [f"a{i}" for i in range(self.adapters)]


@dataclass
class RunResult:
    policy: str
    rate: float
    seed: int
    queue_s: list[float] = field(default_factory=list)  # per request
    ttft_s: list[float] = field(default_factory=list)
    latency_per_token_s: list[float] = field(default_factory=list)
    migrations: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict:
        q = sorted(self.queue_s)
        return {
            "policy": self.policy,
            "rate": self.rate,
            "seed": self.seed,
            "requests": len(q),
            "mean_queue_ms": 1000 * statistics.fmean(q),
            "p90_queue_ms": 1000 * q[int(0.9 * (len(q) - 1))],
            "mean_ttft_ms": 1000 * statistics.fmean(self.ttft_s),
            "mean_latency_per_token_ms": 1000 * statistics.fmean(self.latency_per_token_s),
            "migrations": self.migrations,
            "wall_s": self.wall_s,
        }


def adapter_refs(spec: ClusterSimSpec) -> dict[str, AdapterRef]:
    """a0 (the most popular) ... with registry ids 1, 2, ... (what static placement keys on)."""
    return {a: AdapterRef(a, i + 1, f"/sim/{a}") for i, a in enumerate(spec.names())}


def static_shares(spec: ClusterSimSpec) -> list[float]:
    """Each replica's share of the requests under static placement (Zipf popularity in name order)."""
    shares = [0.0] * spec.replicas
    for ref, w in zip(adapter_refs(spec).values(), zipf_weights(spec.adapters, spec.alpha)):
        shares[static_home(ref.int_id, spec.replicas)] += float(w)
    return shares


def cluster_config(spec: ClusterSimSpec, policy: str) -> ClusterConfig:
    dispatch, placement, migration = POLICIES[policy]
    service = spec.service_s
    return ClusterConfig(
        num_replicas=spec.replicas,
        dispatch=dispatch,
        placement=placement,
        migration=migration,
        monitor_interval_s=MONITOR_PER_SERVICE * service,
        migration_interval_s=ROUND_PER_SERVICE * service,
        queue_delay_s=ROUND_PER_SERVICE * service,
        count_imbalance=spec.count_imbalance,
        placement_interval_s=1e6,
    )


def server_config(spec: ClusterSimSpec, policy: str) -> DloraConfig:
    """The config of a server running `policy` over these replicas: its cluster section, and the
    toy replicas' limits as the engines' (every adapter may be resident; `max_loras` unset: every
    adapter may join a step)."""
    loras = spec.max_loras or spec.adapters
    engine = EngineConfig(max_cpu_loras=max(spec.adapters, loras), max_loras=loras, max_num_seqs=spec.max_running)
    return DloraConfig(cluster=cluster_config(spec, policy), engine=engine)


def make_requests(
    spec: ClusterSimSpec, rate: float, n: int, seed: int, refs: dict[str, AdapterRef]
) -> list[tuple[float, GenerateRequest]]:
    """(arrival second, request): Zipf adapters, Gamma arrivals (dlora bench's generator)."""
    work = generate_workload(
        WorkloadSpec(
            num_prompts=n,
            adapters=tuple(spec.names()),
            distribution="zipf",
            alpha=spec.alpha,
            cv=spec.cv,
            request_rate=rate,
            input_len=spec.input_len,
            output_len=spec.output_len,
            seed=seed,
        ),
        with_prompts=False,
    )
    ignore_eos = not spec.eos_means
    out = []
    for i, r in enumerate(work):
        assert r.adapter is not None  # the workload names adapters, so no request goes to the base
        prompt = tuple((i * 7919 + k) % VOCAB for k in range(spec.input_len))
        sampling = SamplingSpec(max_tokens=spec.output_len, ignore_eos=ignore_eos)
        out.append((r.arrival_time, GenerateRequest(f"{r.request_id}-s{seed}", prompt, sampling, refs[r.adapter])))
    return out


async def _client(router: Router, req: GenerateRequest, at: float, out: RunResult) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    sent, first, n = time.monotonic(), None, 0
    async for delta in router.generate(req):
        if delta.token_ids and first is None:
            first = time.monotonic()
        n += len(delta.token_ids)
    end = time.monotonic()
    out.ttft_s.append((first or end) - sent)
    out.latency_per_token_s.append((end - sent) / max(1, n))


async def simulate(spec: ClusterSimSpec, policy: str, rate: float, n: int, seed: int = 0) -> RunResult:
    """One policy on n requests at `rate` req/s; returns every request's queueing delay."""
    refs = adapter_refs(spec)
    eos: dict[str | None, int] = (
        {a: spec.eos_means[i % len(spec.eos_means)] for i, a in enumerate(refs)} if spec.eos_means else {}
    )
    replicas: list[Replica] = [
        ToyReplica(
            i,
            step_s=spec.step_s,
            max_running=spec.max_running,
            max_loras=spec.max_loras,
            load_s=spec.load_s,
            eos_period=eos,
        )
        for i in range(spec.replicas)
    ]
    cfg = server_config(spec, policy)
    router = Router(replicas, cfg=router_config(cfg))
    true_cost = CostParams(
        per_iteration_s=spec.step_s,
        per_decode_token_s=0.0,
        per_prefill_token_s=0.0,
        adapter_load_s=spec.load_s,
        max_batch=spec.max_running,
    )
    router.cost_models = {r.replica_id: ReplicaCostModel(true_cost) for r in replicas}
    result = RunResult(policy, rate, seed)
    router.queue_times.observer = lambda adapter, s: result.queue_s.append(s)
    await router.start()
    await asyncio.gather(*(router.load_everywhere(ref) for ref in refs.values()))
    balancer = Balancer(router, adapter_ref=refs.__getitem__, cfg=cfg.cluster)
    loop = asyncio.create_task(balancer.run())
    requests = make_requests(spec, rate, n, seed, refs)
    t0 = time.monotonic() + 0.05
    try:
        await asyncio.gather(*(_client(router, req, t0 + at, result) for at, req in requests))
    finally:
        loop.cancel()
    await router.refresh_stats()  # the replicas' last queue measurements
    await router.shutdown()
    result.wall_s = time.monotonic() - t0
    result.migrations = router.counters["migrations"]
    if len(result.queue_s) != n:
        raise RuntimeError(f"{policy}: {len(result.queue_s)} of {n} queueing delays observed")
    return result
