"""The selective, aggregated co-migration problem, and the cost of a plan for it.

Why this shape (dLoRA §5.2, "Selective migration"): a per-request MILP over the whole
cluster takes seconds at 1,000 requests, so the problem is cut down before any solver sees it.
Only the top-K most loaded replicas (KV-full ones first) may send requests, and only to the K
least loaded; every other replica keeps its load and only bounds the makespan from below.
Requests on a sending replica are aggregated by adapter into `Group`s, whose size does not grow
with the number of requests. Both the ILP and the greedy fallback work on this object, and every
plan is scored by `evaluate`, so their results are directly comparable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dlora.cluster.estimators.replica_cost import (
    CostParams,
    pending_time,
    prefill_saved,
    recompute_s,
    request_work,
)
from dlora.cluster.policy_views import AdapterName, ClusterView, ReplicaView, RequestLoad

PLANNERS = ("auto", "highs", "cbc", "greedy")  # auto = HiGHS if highspy is installed, else CBC


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    top_k: int = 2  # replicas considered on each side (overloaded senders, underloaded receivers)
    migration_s: float = 0.05  # objective cost of one moved request: its re-prefill and the RPCs
    kv_high: float = 0.90  # a replica at or above this KV use is ranked overloaded first
    time_limit_s: float = 0.05  # solver deadline, from the start of the call
    fallback_limit_s: float = 0.02  # the greedy fallback's own budget after a solver failure
    solver: str = "auto"  # one of PLANNERS
    binary_adapters: bool = False  # y binary (a MILP) instead of relaxed and rounded
    mip_gap: float = 0.05
    # Seconds charged per KV token above a replica's capacity (vLLM preempts and recomputes);
    # None = the replica's prefill cost per token.
    overflow_s_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.time_limit_s <= 0 or self.fallback_limit_s <= 0 or self.migration_s < 0:
            raise ValueError(f"invalid MigrationConfig: {self}")
        if self.solver not in PLANNERS:
            raise ValueError(f"unknown migration solver {self.solver!r}: supported are {', '.join(PLANNERS)}")


@dataclass(slots=True)
class Group:
    """The requests of one adapter on one sending replica (cheapest to move first)."""

    src: int  # index into MigrationProblem.replicas
    adapter: AdapterName
    requests: list[RequestLoad]
    work: dict[int, list[float]]  # replica index -> per-request seconds if run there
    recompute: dict[int, list[float]]  # receiver index -> per-request re-prefill seconds
    mem: list[int]  # per-request KV tokens


@dataclass(slots=True)
class MigrationProblem:
    replicas: list[ReplicaView]  # senders first, then receivers
    senders: list[int]
    receivers: list[int]
    params: list[CostParams]
    load: list[float]  # current estimated pending seconds
    mem: list[float]  # current KV tokens (measured use + queued requests' context)
    floor: float  # the largest load among replicas outside the selection
    groups: list[Group]
    adapter_tokens: Mapping[str, int] = field(default_factory=dict)
    default_adapter_tokens: int = 0
    migration_s: float = 0.05
    overflow_s: list[float] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # free adapter slots per replica

    def adapter_size(self, adapter: AdapterName) -> int:
        return 0 if adapter is None else self.adapter_tokens.get(adapter, self.default_adapter_tokens)

    def needs_load(self, adapter: AdapterName, j: int) -> bool:
        return not self.replicas[j].holds(adapter)

    def free_slots(self, j: int) -> int:
        return self.slots[j]

    def batch_blocked(self, adapter: AdapterName, j: int) -> bool:
        """Receiver j's batch slots (max_loras) are all held by other adapters: a moved request of
        `adapter` would only wait there. Per move, so several new adapters may still share a
        receiver's last free slot; the next round corrects that."""
        return self.replicas[j].waits_for_batch_slot(adapter)


def _move_order(r: RequestLoad) -> tuple[bool, int, str]:
    """Queued requests first (nothing to recompute), then the shortest contexts."""
    return r.running, r.context_tokens, r.request_id


def _select(views: Sequence[ReplicaView], loads: Sequence[float], cfg: MigrationConfig) -> tuple[list[int], list[int]]:
    """Top-K overloaded (KV-full first, then by load) and top-K underloaded replica positions."""
    order = sorted(range(len(views)), key=lambda i: (views[i].kv_fraction >= cfg.kv_high, loads[i], -i), reverse=True)
    k = min(cfg.top_k, len(views) // 2)
    senders = [i for i in order[:k] if views[i].requests]
    receivers = sorted(order[k:], key=lambda i: (loads[i], i))[:k]
    return senders, receivers


def _movable(
    views: Sequence[ReplicaView], senders: Sequence[int], receivers: Sequence[int], kv_high: float
) -> set[str]:
    """The running requests a plan may move: the shortest contexts first, as many as the receivers
    have free running slots (max_running minus every request already there) and as fit in their KV
    room up to `kv_high`. A running request moved where no slot or no KV is free would wait in that
    replica's queue behind its own requests (vLLM admits only into free blocks), or preempt one of
    them: it gives up its place in a batch, pays a re-prefill and adds a second queueing delay, which
    the load balance the ILP optimises does not see, and the overflow term prices only as one
    re-prefill (with 20-block replicas that both sat near 90-100% KV, migration before this bound
    queued 1.13x longer than dispatch alone, median of 3 reps, 1.67x in the worst; bench/README.md,
    memory-bound run). Queued requests are always movable."""
    free = sum(max(0, views[j].max_running - views[j].num_requests) for j in receivers)
    room = sum(max(0.0, views[j].kv_room(kv_high)) for j in receivers)
    running = sorted((r for s in senders for r in views[s].requests if r.running), key=_move_order)
    movable: set[str] = set()
    for r in running[:free]:
        if r.context_tokens > room:
            break  # the rest are longer
        movable.add(r.request_id)
        room -= r.context_tokens
    return movable


def _group(p: MigrationProblem, s: int, adapter: AdapterName, reqs: list[RequestLoad]) -> Group:
    reqs.sort(key=_move_order)
    g = Group(src=s, adapter=adapter, requests=reqs, work={}, recompute={}, mem=[r.context_tokens for r in reqs])
    for j in [s, *p.receivers]:
        view, par = p.replicas[j], p.params[j]
        merged = adapter is not None and adapter == view.merged_adapter
        # a queued request's prefill, less the prompt prefix replica j probably has cached (so a
        # move away from its cached history costs that prefill)
        g.work[j] = [request_work(par, r, merged) - prefill_saved(par, r, view.replica_id, merged) for r in reqs]
        if j != s:
            g.recompute[j] = [recompute_s(par, r, view.replica_id) for r in reqs]
    return g


def build_problem(
    cluster: ClusterView, params: Mapping[int, CostParams], cfg: MigrationConfig
) -> MigrationProblem | None:
    """The selective problem, or None when fewer than two healthy replicas can take part."""
    views = cluster.healthy()
    pars = [params.get(v.replica_id, CostParams()) for v in views]
    loads = [pending_time(p, v) for p, v in zip(pars, views)]
    senders, receivers = _select(views, loads, cfg)
    if not senders or not receivers:
        return None
    chosen = senders + receivers
    rest = [loads[i] for i in range(len(views)) if i not in chosen]
    sel = [views[i] for i in chosen]
    sel_pars = [pars[i] for i in chosen]
    p = MigrationProblem(
        replicas=sel,
        senders=list(range(len(senders))),
        receivers=list(range(len(senders), len(chosen))),
        params=sel_pars,
        load=[loads[i] for i in chosen],
        mem=[v.kv_demand_tokens for v in sel],
        floor=max(rest, default=0.0),
        groups=[],
        adapter_tokens=cluster.adapter_tokens,
        default_adapter_tokens=cluster.default_adapter_tokens,
        migration_s=cfg.migration_s,
        overflow_s=[
            cfg.overflow_s_per_token if cfg.overflow_s_per_token is not None else q.per_prefill_token_s
            for q in sel_pars
        ],
        slots=[v.free_adapter_slots() for v in sel],
    )
    movable = _movable(sel, p.senders, p.receivers, cfg.kv_high)
    for s in p.senders:
        by_adapter: dict[AdapterName, list[RequestLoad]] = {}
        for r in sel[s].requests:
            if r.running and r.request_id not in movable:
                continue
            by_adapter.setdefault(r.adapter, []).append(r)
        p.groups.extend(_group(p, s, a, rs) for a, rs in sorted(by_adapter.items(), key=lambda kv: str(kv[0])))
    return p


@dataclass(frozen=True, slots=True)
class Score:
    """What a plan costs under the problem's model (lower is better)."""

    makespan: float
    migration: float
    overflow: float

    @property
    def objective(self) -> float:
        return self.makespan + self.migration + self.overflow


def evaluate(p: MigrationProblem, moves: Sequence[tuple[int, int, int]]) -> tuple[Score, list[tuple[AdapterName, int]]]:
    """Score a plan given as (group index, request index in group, receiver index) moves.

    Returns the score and the adapter loads the moves need (adapter absent on the receiver).
    """
    load, mem = list(p.load), list(p.mem)
    loads: dict[tuple[AdapterName, int], None] = {}
    for gi, ri, j in moves:
        g = p.groups[gi]
        load[g.src] -= g.work[g.src][ri]
        load[j] += g.work[j][ri] + g.recompute[j][ri]
        mem[g.src] -= g.mem[ri]
        mem[j] += g.mem[ri]
        if p.needs_load(g.adapter, j) and (g.adapter, j) not in loads:
            loads[(g.adapter, j)] = None
            load[j] += p.params[j].adapter_load_s
            mem[j] += p.adapter_size(g.adapter)
    overflow = sum(s * max(0.0, m - v.kv_capacity_tokens) for s, m, v in zip(p.overflow_s, mem, p.replicas))
    score = Score(max(max(load), p.floor), p.migration_s * len(moves), overflow)
    return score, list(loads)


def check_moves(p: MigrationProblem, moves: Sequence[tuple[int, int, int]]) -> None:
    """Raise ValueError unless each request moves once, to a receiver with a free adapter slot."""
    seen: set[tuple[int, int]] = set()
    new: dict[int, set[AdapterName]] = {}
    for gi, ri, j in moves:
        if (gi, ri) in seen or j not in p.receivers or not 0 <= ri < len(p.groups[gi].requests):
            raise ValueError(f"bad move {(gi, ri, j)}")
        seen.add((gi, ri))
        if p.needs_load(p.groups[gi].adapter, j):
            new.setdefault(j, set()).add(p.groups[gi].adapter)
    for j, adapters in new.items():
        if len(adapters) > p.free_slots(j):
            raise ValueError(f"receiver {j} needs {len(adapters)} adapter loads, has {p.free_slots(j)} slots")
