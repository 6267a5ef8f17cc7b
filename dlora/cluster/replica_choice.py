"""Which replica a request's next leg goes to, counted there in the same step.

In order: a replica named for it (a move's target, or a batch plan's `preferred_replica`) while
it serves; under static placement its adapter's home; else the configured dispatch: Aladdin's
SLO-aware modes (`slo_feasible`, `best_fit`: dlora/cluster/feasible_dispatch.py), which check every
request in flight, or a policy of dlora/cluster/dispatch.py over the replicas' sums, the
proactive one standing in where no policy of that registry is named. The modes that price work
(proactive and the SLO-aware ones) are told, per replica, how much of the prompt its prefix cache
probably holds (`prefix_locality.py`), recorded here as each leg is assigned and as it finishes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from dlora.cluster import feasible_dispatch
from dlora.cluster.adapter_residency import AdapterResidency
from dlora.cluster.dispatch import make_dispatch_policy
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.cluster.prefix_locality import (
    DEFAULT_BLOCK_TOKENS,
    PrefixLocality,
    PromptBlocks,
    prompt_blocks,
    weight_state,
)
from dlora.cluster.replica_pool import ReplicaPool
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.replica_views import ReplicaViews
from dlora.cluster.request_state import RequestState
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_config import RouterConfig
from dlora.cluster.router_counters import RouterCounters
from dlora.replica.errors import AdapterUnavailable


class ReplicaChooser:
    def __init__(
        self,
        cfg: RouterConfig,
        pool: ReplicaPool,
        residency: AdapterResidency,
        table: RequestTable,
        views: ReplicaViews,
        tally: RouterCounters,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.residency = residency
        self.table = table
        self.views = views
        self.tally = tally
        self.clock = views.clock
        # Aladdin's SLO-aware modes (`slo_choose`) need every request's state; the rest are policies
        # over the replicas' sums. Proactive dispatch is the fallback object either way.
        self.slo_dispatch = cfg.dispatch if cfg.dispatch in feasible_dispatch.MODES else None
        self.dispatcher = make_dispatch_policy(
            "proactive" if self.slo_dispatch else cfg.dispatch, cfg.dispatch_start_slack_s
        )
        self.prefixes = PrefixLocality()
        self.prefix_aware = cfg.prefix_aware and (self.slo_dispatch is not None or self.dispatcher.prices_work)

    async def choose(self, state: RequestState) -> ReplicaSlot:
        """The replica for the request's next leg, counted on it at once (`assign`)."""
        pool = self.pool
        if not any(s.serving for s in pool.slots):
            await pool.wait_for(pool.slots)
        if state.migrate_to is not None:
            target = pool.find_slot(state.migrate_to)
            state.migrate_to = None
            if target is not None and target.serving and self.may_serve(state, target):
                return self.assign(state, target)
        if self.cfg.static_placement and state.request.adapter is not None:
            home = self.residency.home(state.request.adapter)
            if not home.healthy:
                await pool.wait_for([home])
            if not self.may_serve(state, home):
                raise self._unavailable(state)
            return self.assign(state, home)
        if not any(s.serving and self.may_serve(state, s) for s in pool.slots):
            raise self._unavailable(state)
        if self.slo_dispatch is not None:
            return self.assign(state, self.slo_choose(state))
        views = [v for v in self.views.dispatch_views() if self.may_serve(state, pool.slot(v.replica_id))]
        return self.assign(state, pool.slot(self.dispatched(state, views)))

    @staticmethod
    def may_serve(state: RequestState, slot: ReplicaSlot) -> bool:
        """Whether the request's adapter can be loaded there (its node could get the files)."""
        adapter = state.request.adapter
        return adapter is None or adapter.int_id not in slot.unavailable

    @staticmethod
    def _unavailable(state: RequestState) -> AdapterUnavailable:
        adapter = state.request.adapter
        assert adapter is not None
        return AdapterUnavailable(adapter.name, "any serving replica's", "none of their nodes could get its files")

    def dispatched(self, state: RequestState, views: list[ReplicaView]) -> int:
        """The replica the dispatch policy picks for the request among `views`; counted as decided
        by locality where, blind to the prefix caches, it would have picked another."""
        load, params = state.load(self.table.lengths), self.tally.cost_params()
        aware = self._with_cached_prefix(state, load, (self.pool.slot(v.replica_id) for v in views))
        pick = self.dispatcher.choose(views, aware, params).replica_id
        if aware.cached_prefix and self.dispatcher.choose(views, load, params).replica_id != pick:
            self.tally.counters["locality_dispatches"] += 1
        return pick

    # ---- prefix locality ---------------------------------------------------------------------
    def _with_cached_prefix(self, state: RequestState, load: RequestLoad, slots: Iterable[ReplicaSlot]) -> RequestLoad:
        """`load` with the prompt tokens each of `slots` probably has cached for it (none when
        dispatch is blind to prefix caches)."""
        if not self.prefix_aware:
            return load
        blocks = self._blocks(state)
        cached = tuple(
            (s.replica_id, n)
            for s in slots
            if (n := self.prefixes.cached_tokens(s.replica_id, blocks, weight_state(_merged(s)))) > 0
        )
        return dataclasses.replace(load, cached_prefix=cached) if cached else load

    def with_cached_prefixes(self, views: list[ReplicaView]) -> list[ReplicaView]:
        """`views` with each request's cached prefix on every replica, for the balancer's moves:
        a move away from a request's cached history costs its prefill (O(requests x replicas))."""
        if not self.prefix_aware:
            return views
        slots = [self.pool.slot(v.replica_id) for v in views]
        states = self.table.requests

        def priced(r: RequestLoad) -> RequestLoad:
            st = states.get(r.request_id)
            return r if st is None else self._with_cached_prefix(st, r, slots)

        return [dataclasses.replace(v, requests=tuple(priced(r) for r in v.requests)) for v in views]

    def _blocks(self, state: RequestState, tokens: Sequence[int] | None = None) -> PromptBlocks:
        """The request's prompt (or `tokens`: its context so far) as prefix-cache blocks, under its
        adapter's version; the prompt's are computed once per request."""
        if tokens is None and state.prompt_blocks is not None:
            return state.prompt_blocks
        adapter = state.request.adapter
        blocks = prompt_blocks(
            state.request.prompt_token_ids if tokens is None else tokens,
            None if adapter is None else adapter.name,
            "" if adapter is None else adapter.digest,
            self._block_tokens(),
        )
        if tokens is None:
            state.prompt_blocks = blocks
        return blocks

    def _block_tokens(self) -> int:
        """The engines' KV block size, as the first replica to report one reports it."""
        for s in self.pool.slots:
            if s.batching is not None and s.batching.kv_block_tokens:
                return s.batching.kv_block_tokens
        return DEFAULT_BLOCK_TOKENS

    def record_context(self, state: RequestState, slot: ReplicaSlot, tokens: Sequence[int] | None = None) -> None:
        """The replica computed (or reused) the request's prompt, or `tokens` (prompt and output
        once it finished): its prefix cache probably holds them now."""
        if not self.prefix_aware:
            return
        capacity = self.views.kv_capacity_tokens(slot)
        self.prefixes.record(slot.replica_id, self._blocks(state, tokens), weight_state(_merged(slot)), capacity)

    def drain_target(self, state: RequestState) -> int | None:
        """Where a drained replica's request goes: dispatch's choice among the serving replicas."""
        views = self.views.dispatch_views()
        return self.dispatched(state, views) if views else None

    def slo_choose(self, state: RequestState) -> ReplicaSlot:
        """Aladdin's dispatch (dlora/cluster/feasible_dispatch.py): the replicas where every request,
        the new one included, keeps its SLO, the least pending time among them (`slo_feasible`) or
        the fullest (`best_fit`); the least pending time when none is feasible (counted in
        /metrics). O(requests in flight): the checks need each request, not the replicas' sums."""
        now = self.clock()
        lengths = self.table.lengths
        on: dict[int, list[RequestState]] = {s.replica_id: [] for s in self.pool.slots}
        for st in self.table.requests.values():
            if st.slot is not None and st is not state:
                on[st.slot.replica_id].append(st)
        params = self.tally.cost_params()
        replicas = [
            feasible_dispatch.SloReplica(
                self.views.view(s, tuple(st.load(lengths) for st in on[s.replica_id])),
                params.get(s.replica_id, CostParams()),
                {st.request.request_id: now - st.first_token_at for st in on[s.replica_id] if st.first_token_at},
            )
            for s in self.pool.slots
            if s.serving and self.may_serve(state, s)
        ]
        blind = state.load(lengths)
        load = self._with_cached_prefix(state, blind, (self.pool.slot(r.view.replica_id) for r in replicas))
        mode = self.slo_dispatch
        assert mode is not None  # called only in an SLO dispatch mode

        def decide(load: RequestLoad) -> feasible_dispatch.SloDispatchDecision:
            return feasible_dispatch.choose(
                replicas, load, lambda r: self.tally.slo.slo_of(r.adapter, r.prompt_tokens), now, mode
            )

        decision = decide(load)
        if not decision.feasible:
            self.tally.counters["slo_infeasible_dispatches"] += 1
        if load.cached_prefix and decide(blind).replica_id != decision.replica_id:
            self.tally.counters["locality_dispatches"] += 1
        return self.pool.slot(decision.replica_id)

    def assign(self, state: RequestState, slot: ReplicaSlot) -> ReplicaSlot:
        """Count the request on `slot` in the same step as the dispatch decision. Requests of a
        burst are dispatched each in its own task (the deadline's wait_for), so a request counted
        only when its stream opens would leave every other decision of the burst blind to it: all
        of them went to the same replica (56 of 64 base-model requests, on two replicas)."""
        state.slot, state.queued_since = slot, self.clock()
        self.table.recount(state)
        self.record_context(state, slot, state.context_token_ids if state.generated else None)
        return slot


def _merged(slot: ReplicaSlot) -> str | None:
    """The adapter merged into the replica's weights at its last stats read."""
    return slot.batching.merged_adapter if slot.batching else None
