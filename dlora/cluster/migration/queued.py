"""Move requests stuck in one replica's queue to replicas that can start them now.

Why (dLoRA's reason for migrating at all): output lengths are unknown at dispatch,
so dispatch-time estimates go wrong, and one replica's queue backs up while another's drains. The
co-migration round (migration/ilp.py) balances total pending work at most once per
`migration_interval_s`; a request that has not started costs almost nothing to move (no KV to
rebuild, its continuation is the request itself), so the balancer runs this planner on every
monitor tick instead, and each replica that could start requests right now takes the oldest ones
queued elsewhere.

Queued = not admitted by its current replica's engine (`RequestLoad.running` is False) and
waiting there at least `min_wait_s`: a younger one may simply not have met the engine's next step
or the next stats read yet (its admission is only known from those), so it proves no backlog.

A receiver is a healthy replica with no such backlog of its own. Its free starts are its running
slots left (`max_running` minus its admitted requests and the young ones queued there, which start
first), bounded by the KV room up to `kv_high` (each request needs its context's KV). A request
of an adapter that has no request there yet also needs a free batch slot (vLLM's max_loras), and a
load needs a free adapter slot. A receiver with an adapter merged takes only that adapter's
requests: with mixed steps off it runs nothing else until it unmerges.

Order: the oldest request first (`queued_since`), to the receiver that already runs its adapter,
else holds it, else any that can load it; ties go to the receiver with the most free starts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from dlora.cluster.migration.trigger import Trigger
from dlora.cluster.policy_views import AdapterName, ReplicaView, RequestLoad


@dataclass(frozen=True, slots=True)
class QueuedConfig:
    min_wait_s: float = 1.0  # a request counts as queued from this wait on (one monitor interval)
    kv_high: float = 0.90  # a receiver's KV use may rise up to this (the KV trigger's threshold)


@dataclass(frozen=True, slots=True)
class QueuedPlan:
    moves: tuple[tuple[str, int, int], ...] = ()  # (request_id, src replica_id, dst replica_id)
    loads: tuple[tuple[str, int], ...] = ()  # (adapter, replica_id) to load before the moves
    oldest_wait_s: float = 0.0  # of the requests moved


@dataclass(slots=True)
class _Receiver:
    """A receiver's room, shrinking as the plan fills it."""

    view: ReplicaView
    starts: int
    kv_tokens: float
    in_use: set[str] = field(default_factory=set)  # adapters with requests here (planned ones included)
    loads: set[str] = field(default_factory=set)  # adapters the plan loads here

    def holds(self, adapter: AdapterName) -> bool:
        return self.view.holds(adapter) or adapter in self.loads

    def can_start(self, r: RequestLoad) -> bool:
        view, a = self.view, r.adapter
        if self.starts < 1 or r.context_tokens > self.kv_tokens:
            return False
        if view.merged_adapter is not None and a != view.merged_adapter:
            return False
        if a is None or a in self.in_use:
            return True
        if len(self.in_use) >= view.batch_adapter_slots:
            return False
        return self.holds(a) or len(self.in_use) < view.adapter_slots  # a load evicts an idle adapter

    def rank(self, adapter: AdapterName) -> tuple[int, int, int]:
        affinity = 0 if adapter is None or adapter in self.in_use else 1 if self.holds(adapter) else 2
        return affinity, -self.starts, self.view.replica_id

    def take(self, r: RequestLoad) -> bool:
        """Book `r` here; True when its adapter must be loaded first."""
        load = not self.holds(r.adapter)
        self.starts -= 1
        self.kv_tokens -= r.context_tokens
        if r.adapter is not None:
            self.in_use.add(r.adapter)
            if load:
                self.loads.add(r.adapter)
        return load


def is_queued(r: RequestLoad, now: float, min_wait_s: float) -> bool:
    return not r.running and now - r.queued_since >= min_wait_s


def _receiver(view: ReplicaView, now: float, cfg: QueuedConfig) -> _Receiver | None:
    if not view.healthy or any(is_queued(r, now, cfg.min_wait_s) for r in view.requests):
        return None
    starts = view.max_running - view.num_requests  # its own (young) queued requests start first
    kv = view.kv_room(cfg.kv_high)
    if starts < 1 or kv <= 0:
        return None
    return _Receiver(view, starts, kv, in_use=set(view.adapters_in_use()))


def plan_queued(
    views: Sequence[ReplicaView],
    now: float,
    cfg: QueuedConfig | None = None,
    receivers_from: Collection[int] | None = None,
) -> QueuedPlan:
    """The moves that let free replicas start requests queued elsewhere (empty when none can).
    `receivers_from`: only these replicas may receive (None: any)."""
    cfg = cfg or QueuedConfig()
    receivers = [
        rc
        for v in views
        if (receivers_from is None or v.replica_id in receivers_from) and (rc := _receiver(v, now, cfg)) is not None
    ]
    if not receivers:
        return QueuedPlan()
    queued = sorted(
        ((r, v.replica_id) for v in views if v.healthy for r in v.requests if is_queued(r, now, cfg.min_wait_s)),
        key=lambda rv: (rv[0].queued_since, rv[0].request_id),
    )
    moves: list[tuple[str, int, int]] = []
    loads: list[tuple[str, int]] = []
    oldest = 0.0
    for r, src in queued:
        able = [rc for rc in receivers if rc.can_start(r)]
        if not able:
            continue
        dst = min(able, key=lambda rc: rc.rank(r.adapter))
        if dst.take(r) and r.adapter is not None:  # the base model (None) is never loaded
            loads.append((r.adapter, dst.view.replica_id))
        moves.append((r.request_id, src, dst.view.replica_id))
        oldest = max(oldest, now - r.queued_since)
        if all(rc.starts < 1 for rc in receivers):
            break
    return QueuedPlan(tuple(moves), tuple(loads), oldest)


def main_source(plan: QueuedPlan) -> int:
    """The replica most of the plan's moves leave (what its round is recorded against)."""
    return Counter(src for _, src, _ in plan.moves).most_common(1)[0][0]


def queued_trigger(plan: QueuedPlan, cfg: QueuedConfig) -> Trigger:
    """What the balancer records for a round of these moves (reason "queued")."""
    return Trigger(
        "queued",
        main_source(plan),
        f"{len(plan.moves)} request(s) queued >= {cfg.min_wait_s:g} s, oldest {plan.oldest_wait_s:.2f} s",
    )
