"""Which replica a request's next leg goes to, counted there in the same step.

In order: a replica named for it (a move's target, or a batch plan's `preferred_replica`) while
it serves; under static placement its adapter's home; else the configured dispatch: Aladdin's
SLO-aware modes (`slo_feasible`, `best_fit`: dlora/cluster/feasible_dispatch.py), which check every
request in flight, or a policy of dlora/cluster/dispatch.py over the replicas' sums, the
proactive one standing in where no policy of that registry is named.
"""

from __future__ import annotations

from dlora.cluster import feasible_dispatch
from dlora.cluster.adapter_residency import AdapterResidency
from dlora.cluster.dispatch import make_dispatch_policy
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.policy_views import ReplicaView
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
        """The replica the dispatch policy picks for the request among `views`."""
        return self.dispatcher.choose(views, state.load(self.table.lengths), self.tally.cost_params()).replica_id

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
        load = state.load(lengths)
        assert self.slo_dispatch is not None  # called only in an SLO dispatch mode
        decision = feasible_dispatch.choose(
            replicas, load, lambda r: self.tally.slo.slo_of(r.adapter, r.prompt_tokens), now, self.slo_dispatch
        )
        if not decision.feasible:
            self.tally.counters["slo_infeasible_dispatches"] += 1
        return self.pool.slot(decision.replica_id)

    def assign(self, state: RequestState, slot: ReplicaSlot) -> ReplicaSlot:
        """Count the request on `slot` in the same step as the dispatch decision. Requests of a
        burst are dispatched each in its own task (the deadline's wait_for), so a request counted
        only when its stream opens would leave every other decision of the burst blind to it: all
        of them went to the same replica (56 of 64 base-model requests, on two replicas)."""
        state.slot, state.queued_since = slot, self.clock()
        self.table.recount(state)
        return slot
