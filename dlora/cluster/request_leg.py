"""One leg of a request: on one replica, from its adapter load to the end of its stream.

The leg counts on its replica's dispatch sums from the moment it is assigned there, and its
tokens are added to the request's as they come; it ends with the replica's stream: finished, moved
away (an abort while `migrate_to` is set, which the client never sees), or failed (ReplicaFailure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable

from dlora.cluster.adapter_residency import AdapterResidency
from dlora.cluster.deadlines import Deadlines
from dlora.cluster.interruptible import InterruptibleStream
from dlora.cluster.queue_time import QueueTimes
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.request_state import RequestState
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_counters import RouterCounters
from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import Delta, GenerateRequest


class LegRunner:
    def __init__(
        self,
        residency: AdapterResidency,
        table: RequestTable,
        tally: RouterCounters,
        queue_times: QueueTimes,
        deadlines: Deadlines,
        clock: Callable[[], float],
    ) -> None:
        self.residency = residency
        self.table = table
        self.tally = tally
        self.queue_times = queue_times
        self.deadlines = deadlines
        self.clock = clock
        # The balancer's wake-ups for event-triggered moves: a leg's stream ended (a slot may be
        # free there), a leg was sent to its replica (it may queue there).
        self.on_ended: Callable[[int], None] = lambda replica_id: None
        self.on_sent: Callable[[], None] = lambda: None

    async def run(self, slot: ReplicaSlot, req: GenerateRequest, state: RequestState) -> AsyncGenerator[Delta]:
        """Deltas from one replica; returns without a finished delta when the request was migrated."""
        state.slot, state.queued_since = slot, self.clock()  # its load counts on `slot` from now
        self.table.recount(state)
        lost = False
        try:
            if req.adapter is not None and req.adapter.int_id not in slot.loaded:
                await self.deadlines.in_time(state, self.residency.load(slot, req.adapter))
            if req.adapter is not None and slot.cache is not None:
                slot.cache.touch(req.adapter.int_id)
            if self.deadlines.passed(state):
                raise self.deadlines.error()
            self._sent(state, req.request_id)
            first = True
            state.leg = InterruptibleStream(slot.replica.generate(req))
            async for delta in state.leg:
                if first and delta.token_ids:
                    first = False
                    state.admitted = True
                    self.queue_times.first_token(req.request_id)
                if delta.token_ids:  # a step of this replica just ended; the next one starts now
                    slot.step_started_at = self.clock()
                state.generated.extend(delta.token_ids)
                self.tally.output_tokens_total += len(delta.token_ids)
                self.table.recount(state)
                if delta.finished and delta.finish_reason == "abort" and state.migrate_to is not None:
                    state.migrated = True
                    if delta.token_ids:
                        yield dataclasses.replace(delta, finished=False, finish_reason=None)
                    return
                yield delta
        except ReplicaFailure:
            lost = True  # the replica's measurement of this request will not come
            raise
        finally:
            if state.leg is not None:
                leg, state.leg = state.leg, None
                await leg.close()  # the replica's stream is closed: the engine aborts the request
            # Between legs the request is on no replica: the next one is priced with its re-prefill.
            state.slot, state.engine_request_id, state.admitted, state.preempted = None, None, False, False
            self.table.recount(state)
            self.queue_times.stream_ended(req.request_id, lost)
            self.on_ended(slot.replica_id)

    def _sent(self, state: RequestState, engine_id: str) -> None:
        """The current leg goes to its replica as `engine_id`: it waits in that engine's queue until
        admitted, and from now on it can be moved (`Router.migrate` aborts it by this id)."""
        state.engine_request_id, state.admitted, state.queued_since = engine_id, False, self.clock()
        state.preempted = False
        self.table.recount(state)
        slot = state.slot
        totals = None if slot is None else self.table.totals.get(slot.replica_id)
        if slot is not None and totals is not None and totals.requests <= 1:  # it reaches an idle engine
            slot.step_started_at = state.queued_since
        self.queue_times.sent(state.request.request_id, engine_id)
        self.on_sent()
