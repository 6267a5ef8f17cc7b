"""The `ReplicaView`s the policies read, built from the replica pool, the request table and the
fitted costs. Building one changes nothing."""

from __future__ import annotations

from collections.abc import Callable

from dlora.cluster.estimators.replica_cost import step_left
from dlora.cluster.policy_views import LoadTotals, ReplicaView, RequestLoad
from dlora.cluster.replica_pool import ReplicaPool
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_config import RouterConfig
from dlora.cluster.router_counters import RouterCounters


class ReplicaViews:
    def __init__(
        self,
        cfg: RouterConfig,
        pool: ReplicaPool,
        table: RequestTable,
        tally: RouterCounters,
        clock: Callable[[], float],
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.table = table
        self.tally = tally
        self.clock = clock

    def views(self) -> list[ReplicaView]:
        """Every replica with each of its requests (O(requests): the balancer's periodic rounds)."""
        slots = self.pool.slots
        by_replica = self.table.loads_by_replica([s.replica_id for s in slots])
        return [self.view(s, tuple(by_replica[s.replica_id])) for s in slots]

    def dispatch_views(self) -> list[ReplicaView]:
        """The serving replicas as dispatch sees them: sums instead of requests (O(replicas))."""
        return [self.view(s, (), self.table.totals[s.replica_id]) for s in self.pool.slots if s.serving]

    def view(
        self, slot: ReplicaSlot, requests: tuple[RequestLoad, ...], totals: LoadTotals | None = None
    ) -> ReplicaView:
        batching = slot.batching
        return ReplicaView(
            replica_id=slot.replica_id,
            requests=requests,
            totals=totals,
            resident_adapters=frozenset(slot.loaded.values()),
            merged_adapter=batching.merged_adapter if batching else None,
            kv_usage=batching.kv_usage if batching else None,
            kv_capacity_tokens=self.kv_capacity_tokens(slot),
            adapter_slots=self.cfg.adapter_slots,
            batch_adapter_slots=self.cfg.batch_adapter_slots,
            max_running=self.cfg.max_batch,
            healthy=slot.serving,  # planners move nothing to a draining replica
            adapter_bytes_free=self._cache_room(slot, totals),
            step_left_s=0.0 if totals is None else self._step_left(slot, totals),
        )

    def kv_capacity_tokens(self, slot: ReplicaSlot) -> int:
        """Tokens the replica's KV blocks hold, as its engine last reported (the config's until then)."""
        batching = slot.batching
        return batching.kv_capacity_tokens if batching and batching.kv_capacity_tokens else self.cfg.kv_capacity_tokens

    def _step_left(self, slot: ReplicaSlot, totals: LoadTotals) -> float:
        """`ReplicaView.step_left_s` for dispatch: the step under way, priced by the replica's costs."""
        p = self.tally.cost_models[slot.replica_id].params
        running = totals.requests - totals.queued
        return step_left(p, slot.step_started_at, self.clock(), running, totals.queued_context_tokens)

    def _cache_room(self, slot: ReplicaSlot, totals: LoadTotals | None) -> int | None:
        """`ReplicaView.adapter_bytes_free`: the slot's host cache room, its adapters with requests
        kept (from the replica's sums where dispatch has them; else every request's current leg)."""
        if slot.cache is None:
            return None
        if totals is None:
            return slot.cache.room(self.table.in_use_on(slot))
        busy = totals.adapters_in_use()
        return slot.cache.room({i for i, name in slot.loaded.items() if name in busy})
