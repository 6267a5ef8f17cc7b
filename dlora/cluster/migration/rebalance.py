"""Even out backlogged queues: move queued requests to where they would start sooner.

Why: the queued-request planner (migration/queued.py) only moves a request to a replica
that can start it now. When every replica is busy, dispatch's wrong guesses about output lengths
still leave one queue longer than another (the count trigger fired at 31 vs 23 unfinished requests
with nothing movable), and the co-migration ILP, which balances estimated work, sees no imbalance
when the work it expects is even. Moving a request that has not started costs nothing (no KV to
rebuild; its prefill happens wherever it runs) and, because every leg keeps its first arrival, it
takes its fair place in the receiver's queue.

A move is made when it lowers the summed estimated wait of the two replicas' queued requests
(estimators/wait_estimate.py) by at least `min_gain_s`: that counts the moved request's gain and what the
requests behind it on the source gain, against what the receiver's later arrivals lose. Candidates:
from each of the `top_k` replicas with the longest estimated waits, its newest queued requests that
waited at least `min_wait_s` (the oldest are next in line where they are), one per adapter group
(the newest whose adapter already runs on the receiver, and the newest overall); receivers are the
`top_k` replicas with the shortest. At most `max_moves` per tick, the best first; the views are
updated after each so the next move sees it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.estimators.wait_estimate import queue_order, start_times, total_wait
from dlora.cluster.migration.queued import QueuedPlan, is_queued, main_source
from dlora.cluster.migration.trigger import Trigger
from dlora.cluster.policy_views import ReplicaView, RequestLoad


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    min_wait_s: float = 1.0  # a request counts as queued from this wait on (as migration/queued.py)
    kv_high: float = 0.90  # a replica past this KV use admits nothing new until a request ends
    min_gain_s: float = 1.0  # summed wait a move must save: a margin for the estimates' error
    max_moves: int = 4  # per tick
    top_k: int = 2  # sources and receivers considered


@dataclass(frozen=True, slots=True)
class _Move:
    gain_s: float
    request: RequestLoad
    src: int
    dst: int


def _accepts(dst: ReplicaView, r: RequestLoad) -> bool:
    """A merged receiver runs only its merged adapter's requests until it unmerges; an absent
    adapter needs a slot that no adapter with requests there holds."""
    return dst.can_take(r.adapter) and (dst.merged_adapter is None or r.adapter == dst.merged_adapter)


def _candidates(src: ReplicaView, dst: ReplicaView, now: float, cfg: RebalanceConfig) -> list[RequestLoad]:
    movable = [r for r in reversed(queue_order(src)) if is_queued(r, now, cfg.min_wait_s) and _accepts(dst, r)]
    if not movable:
        return []
    in_use = dst.adapters_in_use()
    affine = next((r for r in movable if r.adapter is None or r.adapter in in_use), None)
    return [movable[0]] + ([affine] if affine is not None and affine is not movable[0] else [])


def _moved(src: ReplicaView, dst: ReplicaView, r: RequestLoad, now: float) -> tuple[ReplicaView, ReplicaView]:
    """Both views after `r` moves (it waits on `dst` from now, its first arrival kept, its adapter
    loaded there)."""
    left = tuple(x for x in src.requests if x.request_id != r.request_id)
    arrived = dataclasses.replace(r, running=False, queued_since=now)
    resident = dst.resident_adapters | ({r.adapter} if r.adapter is not None else set())
    return (
        dataclasses.replace(src, requests=left),
        dataclasses.replace(dst, requests=dst.requests + (arrived,), resident_adapters=resident),
    )


def _best_move(
    views: dict[int, ReplicaView], params: Mapping[int, CostParams], now: float, cfg: RebalanceConfig
) -> _Move | None:
    cost = {i: params.get(i, CostParams()) for i in views}
    waits = {i: start_times(v, cost[i], cfg.kv_high) for i, v in views.items() if v.healthy}
    if len(waits) < 2:
        return None
    tail = {i: max(w.values(), default=0.0) for i, w in waits.items()}  # the last queued request's wait
    longest = sorted(tail, key=lambda i: -tail[i])[: cfg.top_k]
    shortest = sorted(tail, key=lambda i: tail[i])[: cfg.top_k]
    best = None
    for s in longest:
        for d in shortest:
            if s == d:
                continue
            before = sum(waits[s].values()) + sum(waits[d].values())
            for r in _candidates(views[s], views[d], now, cfg):
                src, dst = _moved(views[s], views[d], r, now)
                gain = before - total_wait(src, cost[s], cfg.kv_high) - total_wait(dst, cost[d], cfg.kv_high)
                if gain >= cfg.min_gain_s and (best is None or gain > best.gain_s):
                    best = _Move(gain, r, s, d)
    return best


def plan_rebalance(
    views: Sequence[ReplicaView], params: Mapping[int, CostParams], now: float, cfg: RebalanceConfig | None = None
) -> QueuedPlan:
    """Moves of queued requests that shorten the summed estimated wait (empty when none does).

    Adapters a move needs are loaded on the receiver first (`loads`), as the balancer does for
    every plan; an adapter still absent when the request gets there is loaded by the router."""
    cfg = cfg or RebalanceConfig()
    current = {v.replica_id: v for v in views}
    moves: list[tuple[str, int, int]] = []
    loads: list[tuple[str, int]] = []
    oldest = 0.0
    for _ in range(cfg.max_moves):
        move = _best_move(current, params, now, cfg)
        if move is None:
            break
        r, dst = move.request, current[move.dst]
        if r.adapter is not None and not dst.holds(r.adapter):  # the base model (None) is never loaded
            loads.append((r.adapter, move.dst))
        current[move.src], current[move.dst] = _moved(current[move.src], dst, r, now)
        moves.append((r.request_id, move.src, move.dst))
        oldest = max(oldest, now - r.queued_since)
    return QueuedPlan(tuple(moves), tuple(loads), oldest)


def rebalance_trigger(plan: QueuedPlan, cfg: RebalanceConfig) -> Trigger:
    """What the balancer records for a round of these moves (reason "rebalance")."""
    return Trigger(
        "rebalance",
        main_source(plan),
        f"{len(plan.moves)} queued request(s) start sooner elsewhere "
        f"(>= {cfg.min_gain_s:g} s saved each), oldest {plan.oldest_wait_s:.2f} s",
    )
