"""Reading the replicas' stats and feeding them to the scheduling state: the cost models' measured
steps, which requests their engines admitted or preempted, the queue waits. The balancer's loop
reads (`refresh`); /metrics only renders what the last read stored (`reported_stats`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from dlora.cluster.queue_time import QueueTimes
from dlora.cluster.replica_pool import ReplicaPool
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_counters import RouterCounters
from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import ReplicaStats

log = logging.getLogger(__name__)


class StatsReader:
    def __init__(self, pool: ReplicaPool, table: RequestTable, tally: RouterCounters, queue_times: QueueTimes) -> None:
        self.pool = pool
        self.table = table
        self.tally = tally
        self.queue_times = queue_times
        # Each replica's last stats read by `refresh` (the balancer's loop): what /metrics shows.
        self.reported: dict[int, ReplicaStats] = {}

    async def _read(self, s: ReplicaSlot) -> ReplicaStats | None:
        """The replica's stats, or None: unhealthy, failed now, or busy (its read, still pending,
        is awaited again by the next refresh instead of being asked twice)."""
        if not s.healthy:
            return None
        loop = asyncio.get_running_loop()
        if s.stats_call is None or s.stats_call.done():
            s.stats_call, s.stats_asked_at = asyncio.ensure_future(s.replica.stats()), loop.time()
        try:
            return await asyncio.wait_for(asyncio.shield(s.stats_call), self.pool.cfg.actor_call_timeout_s)
        except TimeoutError:
            try:
                await self.pool.check_alive(s, s.stats_asked_at)
            except ReplicaFailure as e:
                self._failed(s, e)
        except ReplicaFailure as e:  # e.g. Ray restarted the actor: rebuild it before a request finds out
            self._failed(s, e)
        except Exception as e:
            log.warning("replica %d: stats read failed: %s", s.replica_id, e)
        return None

    def _failed(self, s: ReplicaSlot, e: ReplicaFailure) -> None:
        log.warning("replica %d failed its stats read (%s); rebuilding it", s.replica_id, e)
        self.pool.mark_failed(s)

    async def refresh(self) -> list[ReplicaStats]:
        """Read every replica's stats (at once: a hung one costs one deadline, not one per replica)
        and feed them to the scheduling state."""
        out = []
        slots = list(self.pool.slots)  # a replica added or removed meanwhile is read next time
        for s, st in zip(slots, await asyncio.gather(*(self._read(s) for s in slots))):
            if st is None and s.healthy and s.replica_id in self.reported:
                out.append(self.reported[s.replica_id])  # busy: its last report stands until the read answers
                continue
            st = st or ReplicaStats(replica_id=s.replica_id, num_unfinished=0, healthy=False)
            s.last_stats = st if st.healthy else s.last_stats
            if s not in self.pool.slots:
                continue  # removed while its stats were read
            if st.batching is not None:
                self.tally.observe_iterations(s.replica_id, st.batching.iterations)
                self.table.admit(st.batching.queue_waits)
                self.table.mark_preempted(s, st.batching.preempted)
                self.queue_times.report(st.batching.queue_waits)
            self.reported[s.replica_id] = st
            out.append(st)
        self.queue_times.expire()
        self.tally.slo.basis = self.tally.isolated_basis()  # the cost models were refitted from these steps
        self.tally.counters["stats_reads"] += 1
        return out

    def reported_stats(self) -> list[ReplicaStats]:
        """Each replica's stats as last read by `refresh`, marked unhealthy where the replica is down
        now. No replica call: a scrape must answer whatever the replicas do."""
        out = []
        for s in self.pool.slots:
            st = self.reported.get(s.replica_id) or ReplicaStats(
                replica_id=s.replica_id, num_unfinished=0, healthy=False
            )
            out.append(st if s.healthy else dataclasses.replace(st, healthy=False))
        return out
