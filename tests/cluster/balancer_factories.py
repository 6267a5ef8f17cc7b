"""Factories and plan checks for the balancer tests (dispatch, placement, co-migration)."""

from __future__ import annotations

from dlora.cluster.migration.ilp import MigrationPlan
from dlora.cluster.policy_views import ClusterView, ReplicaView, RequestLoad


def make_request(
    rid: str,
    adapter: str | None = "a",
    *,
    prompt: int = 100,
    output: int = 0,
    expected: int = 100,
    running: bool = False,
    queued_since: float = 0.0,
    arrival: float | None = None,
) -> RequestLoad:
    """`arrival` defaults to `queued_since` (a request that was never moved)."""
    return RequestLoad(
        rid, adapter, prompt, output, expected, running, queued_since, queued_since if arrival is None else arrival
    )


def make_replica(rid: int, requests=(), resident=(), **kw) -> ReplicaView:
    return ReplicaView(replica_id=rid, requests=tuple(requests), resident_adapters=frozenset(resident), **kw)


def many(prefix: str, n: int, adapter: str | None = "a", **kw) -> list[RequestLoad]:
    return [make_request(f"{prefix}{i}", adapter, **kw) for i in range(n)]


def check_plan(cluster: ClusterView, plan: MigrationPlan) -> None:
    """Every move names a request on its source, moves it once to another healthy replica where
    its adapter is resident or loaded by the plan; loads fit the receivers' free slots."""
    where = {r.request_id: (v.replica_id, r.adapter) for v in cluster.replicas for r in v.requests}
    views = {v.replica_id: v for v in cluster.replicas}
    loads = set(plan.loads)
    assert len(loads) == len(plan.loads), "duplicate adapter loads"
    for adapter, j in loads:
        assert adapter not in views[j].resident_adapters, f"{adapter} already resident on {j}"
    moved = set()
    for rid, src, dst in plan.moves:
        assert rid not in moved, f"{rid} moved twice"
        moved.add(rid)
        assert where[rid][0] == src, f"{rid} is not on {src}"
        assert src != dst and views[dst].healthy
        adapter = where[rid][1]
        assert views[dst].holds(adapter) or (adapter, dst) in loads, f"{rid}: {adapter} absent on {dst}"
    for j, view in views.items():
        new = sum(1 for _, jj in loads if jj == j)
        assert new <= view.free_adapter_slots(), f"replica {j}: {new} loads > {view.free_adapter_slots()} slots"
