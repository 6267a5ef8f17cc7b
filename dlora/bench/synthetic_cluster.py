"""Synthetic, skewed cluster snapshots for the co-migration tests and the `ilp_solve` benchmark.

Why synthetic: the solver must be judged at sizes (1,000 requests x 32 replicas x 128 adapters)
no CPU test cluster reaches. The shape: Zipf(1.1) adapter popularity, prompt and output lengths
uniform in [16, 512), and a skewed Dirichlet(0.7) split of requests over replicas, so a few
replicas hold most of the work. Requests sit on replicas that hold their adapter, as proactive
dispatch would leave them.
"""

from __future__ import annotations

import numpy as np

from dlora.cluster.policy_views import ClusterView, ReplicaView, RequestLoad


def adapter_name(k: int) -> str:
    return f"lora-{k:03d}"


def skewed_cluster(
    num_requests: int,
    num_replicas: int,
    num_adapters: int,
    seed: int = 0,
    kv_capacity_tokens: int = 32768,
    adapter_slots: int = 64,
    skew: float = 0.7,
) -> ClusterView:
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_adapters + 1) ** 1.1
    adapters = rng.choice(num_adapters, size=num_requests, p=popularity / popularity.sum())
    where = rng.choice(num_replicas, size=num_requests, p=rng.dirichlet([skew] * num_replicas))
    per_replica: list[list[RequestLoad]] = [[] for _ in range(num_replicas)]
    for i, (k, j) in enumerate(zip(adapters, where)):
        expected = int(rng.integers(16, 512))
        running = bool(rng.random() < 0.7)
        per_replica[j].append(
            RequestLoad(
                request_id=f"req-{i}",
                adapter=adapter_name(int(k)),
                prompt_tokens=int(rng.integers(16, 512)),
                output_tokens=int(rng.integers(0, expected)) if running else 0,
                expected_output_tokens=expected,
                running=running,
                queued_since=float(i) * 1e-3,
            )
        )
    views = []
    for j, reqs in enumerate(per_replica):
        in_use = {r.adapter for r in reqs if r.adapter is not None}
        extra = {adapter_name(int(k)) for k in rng.choice(num_adapters, size=4, replace=False)}
        resident = frozenset(sorted(in_use | extra)[: max(adapter_slots, len(in_use))])
        views.append(
            ReplicaView(
                replica_id=j,
                requests=tuple(reqs),
                resident_adapters=resident,
                kv_capacity_tokens=kv_capacity_tokens,
                adapter_slots=adapter_slots,
            )
        )
    return ClusterView(replicas=tuple(views), default_adapter_tokens=64)
