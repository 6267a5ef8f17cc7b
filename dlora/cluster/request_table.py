"""The requests in flight and, per replica, the sums of their loads that dispatch reads.

Why sums: dispatch runs once per request, so it reads `LoadTotals` the table keeps request by
request (`recount` at each change of a request: replica, tokens, admitted, preempted), and a
dispatch costs the same however many requests are in flight. A request's expected output moves as
other requests finish (the output-length history), which a per-request update does not see until
that request changes again: `recount_all` prices every request afresh and rebuilds the sums exactly
(the balancer does it before it plans). `loads_by_replica` is a pure snapshot for the views.
"""

from __future__ import annotations

from collections import Counter

from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.policy_views import LoadTotals, RequestLoad
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.request_state import RequestState
from dlora.replica.errors import ReplicaFailure


class RequestTable:
    def __init__(self, lengths: OutputLengthEstimator, replica_ids: list[int]) -> None:
        self.lengths = lengths
        self.requests: dict[str, RequestState] = {}
        self.inflight_by_adapter: Counter[str] = Counter()
        # Per replica, its requests' sums for dispatch.
        self.totals: dict[int, LoadTotals] = {rid: LoadTotals() for rid in replica_ids}

    def add(self, state: RequestState) -> None:
        self.requests[state.request.request_id] = state
        self.inflight_by_adapter[state.adapter or ""] += 1

    def remove(self, state: RequestState) -> None:
        """The request ended: off its replica's sums (if still counted) and out of the table."""
        if state.slot is not None:  # assigned, but its stream never opened (deadline, cancel)
            state.slot = None
            self.recount(state)
        del self.requests[state.request.request_id]
        adapter = state.adapter or ""
        self.inflight_by_adapter[adapter] -= 1
        if self.inflight_by_adapter[adapter] <= 0:
            del self.inflight_by_adapter[adapter]

    # ---- the dispatch sums ------------------------------------------------------------------
    def recount(self, state: RequestState) -> None:
        """The request changed (replica, tokens, admitted, preempted): update its replica's sums."""
        if state.counted is not None and state.counted_on in self.totals:
            self.totals[state.counted_on].remove(state.counted)
        state.counted = state.counted_on = None
        if state.slot is not None:
            state.counted, state.counted_on = state.load(self.lengths), state.slot.replica_id
            self.totals[state.counted_on].add(state.counted)

    def recount_all(self, replica_ids: list[int]) -> None:
        """Price every request afresh and rebuild each replica's sums from them (O(requests))."""
        by_replica: dict[int, list[RequestLoad]] = {rid: [] for rid in replica_ids}
        for st in self.requests.values():
            st.counted = st.counted_on = None
            if st.slot is not None:
                st.counted, st.counted_on = st.load(self.lengths), st.slot.replica_id
                by_replica[st.slot.replica_id].append(st.counted)
        self.totals.clear()
        self.totals.update((rid, LoadTotals.of(loads)) for rid, loads in by_replica.items())

    def loads_by_replica(self, replica_ids: list[int]) -> dict[int, list[RequestLoad]]:
        """Each replica's requests as the balancer sees them now; changes nothing."""
        by_replica: dict[int, list[RequestLoad]] = {rid: [] for rid in replica_ids}
        for st in self.requests.values():
            if st.slot is not None:
                by_replica[st.slot.replica_id].append(st.load(self.lengths))
        return by_replica

    def track(self, replica_id: int) -> None:
        self.totals[replica_id] = LoadTotals()

    def untrack(self, replica_id: int) -> None:
        self.totals.pop(replica_id, None)

    def routed_counts(self) -> dict[int, int]:
        """Requests the router has on each replica now."""
        return {rid: totals.requests for rid, totals in self.totals.items()}

    # ---- requests by replica ----------------------------------------------------------------
    def on(self, slot: ReplicaSlot) -> list[RequestState]:
        """The requests whose current leg is on `slot`."""
        return [st for st in self.requests.values() if st.slot is slot]

    def in_use_on(self, slot: ReplicaSlot) -> set[int]:
        """Adapter ids of the requests whose current leg is on `slot` (loading, queued or running)."""
        return {st.request.adapter.int_id for st in self.requests.values() if st.slot is slot and st.request.adapter}

    def inflight_with(self, adapter_int_id: int) -> int:
        """Requests in flight on this adapter version (O(requests): for admin operations)."""
        return sum(
            1 for st in self.requests.values() if st.request.adapter and st.request.adapter.int_id == adapter_int_id
        )

    def waiting_since(self) -> list[float]:
        """When each request on a replica but not admitted there yet started its wait."""
        return [st.queued_since for st in self.requests.values() if st.slot is not None and not st.admitted]

    def below_priority(self, priority: int) -> int:
        """Requests in flight with a priority value below `priority` (admitted before it)."""
        return sum(1 for st in self.requests.values() if st.request.priority < priority)

    def interrupt(self, slot: ReplicaSlot) -> None:
        """The replica failed: its open streams end at once (they may wait forever on a hung engine)."""
        for st in list(self.requests.values()):
            if st.slot is slot and st.leg is not None:
                st.leg.interrupt(ReplicaFailure(f"replica {slot.replica_id} failed"))

    # ---- what the replicas report -----------------------------------------------------------
    def admit(self, waits: tuple[tuple[str, float], ...]) -> None:
        """A replica reported these engine requests' queue waits: each left its waiting queue
        (admitted, or aborted, which ends its leg anyway). Reports of earlier legs match nothing."""
        if not waits:
            return
        legs = {st.engine_request_id: st for st in self.requests.values() if st.engine_request_id is not None}
        for engine_id, _ in waits:
            st = legs.get(engine_id)
            if st is not None and not st.admitted:
                st.admitted = True
                self.recount(st)

    def mark_preempted(self, slot: ReplicaSlot, engine_ids: tuple[str, ...]) -> None:
        """The replica's preempted-and-waiting requests as of this read; a resumed one is running again."""
        preempted = set(engine_ids)
        for st in self.requests.values():
            if (
                st.slot is slot
                and st.engine_request_id is not None
                and st.preempted != (st.engine_request_id in preempted)
            ):
                st.preempted = not st.preempted
                self.recount(st)
