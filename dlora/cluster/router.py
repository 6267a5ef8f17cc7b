"""The router: picks a replica for each request, owns its token state, moves it when told to.

NOTE on the request life cycle: the router keeps the prompt ids and every token id received. A
request leaves its replica in two ways, and both continue the same way — it is resubmitted to
another replica as `prompt + generated` with `max_tokens` reduced by what was generated, so the
client's stream goes on with no duplicated or missing tokens:
  * migration: the balancer sets `migrate_to` and aborts the request on its replica; the engine
    ends the stream with finish_reason "abort", which the router swallows;
  * failure: the replica's actor died or restarted, or its engine died (`ReplicaFailure`), or it
    stopped answering (replica_pool.py says when a slow replica counts as failed). A failed
    replica is rebuilt in the background and its pinned adapters are loaded again. A request is
    resubmitted after at most `max_resubmissions` failures, then fails (`ResubmissionLimit`): it
    may be what kills them.
Bounds: a request that passes its deadline (`request_timeout_s`) is aborted and fails with
`RequestTimeout`; with no replica up, a request waits `recovery_grace_s` at most, then fails with
`NoReplicaError`; a replica that fails `max_restart_attempts` rebuilds in a row is reported as
given up (`ReplicaSlot.gave_up`) and retried only every `GAVE_UP_RETRY_S`.
Elastic clusters (dlora/cluster/elastic.py) add replicas (`add_replica`) and remove them
(`drain`): a draining replica takes nothing new, and its requests move by the same abort and
continuation as a migration before it stops, so scaling in ends no stream.
A request that finishes by itself is judged against its adapter's SLO (`slo`, dlora/slo/accounting.py)
with its times from reaching the router to its first and last token, whatever replicas it ran on.

The router composes one piece per job and itself only generates, migrates and drains:
  * `pool` (replica_pool.py): the replicas, calls with deadlines, failures and rebuilds;
  * `residency` (adapter_residency.py): which adapter is loaded where, host caches in bytes;
  * `table` (request_table.py): the requests in flight and the per-replica sums dispatch reads;
  * `replica_views` (replica_views.py): the `ReplicaView`s the policies read, changing nothing;
  * `chooser` (replica_choice.py): the replica for each leg (dispatch policies, the SLO modes);
  * `tally` (router_counters.py): counters, fitted step costs, output lengths, SLO attainment;
  * `stats` (stats_reader.py): the replicas' stats, read by the balancer's loop;
  * `legs` (request_leg.py): one leg of a request on one replica; `deadlines` (deadlines.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from dlora.cluster.adapter_residency import AdapterResidency, static_home
from dlora.cluster.deadlines import Deadlines
from dlora.cluster.errors import NoReplicaError, RequestTimeout, ResubmissionLimit
from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.policy_views import ReplicaView
from dlora.cluster.queue_time import QueueTimes
from dlora.cluster.replica_choice import ReplicaChooser
from dlora.cluster.replica_pool import GAVE_UP_RETRY_S, ReplicaPool
from dlora.cluster.replica_slot import Replica, ReplicaSlot
from dlora.cluster.replica_views import ReplicaViews
from dlora.cluster.request_leg import LegRunner
from dlora.cluster.request_state import RequestState
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_config import RouterConfig
from dlora.cluster.router_counters import RouterCounters
from dlora.cluster.stats_reader import StatsReader
from dlora.replica.errors import AdapterUnavailable, ReplicaFailure
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, ReplicaStats

log = logging.getLogger(__name__)

# The replica that requests started in this context go to first (a batch plan's placement, set by
# dlora/batch/planned.py in each line's task); dispatch decides when it is None or not serving. A
# context variable because the request reaches the router through the online routes' handlers.
preferred_replica: ContextVar[int | None] = ContextVar("dlora_preferred_replica", default=None)

__all__ = [
    "GAVE_UP_RETRY_S",
    "NoReplicaError",
    "Replica",
    "ReplicaSlot",
    "RequestState",
    "RequestTimeout",
    "ResubmissionLimit",
    "Router",
    "RouterConfig",
    "static_home",
]

# How often a drain looks again for requests left on its replica (moves take one abort each).
DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class DrainResult:
    replica_id: int
    moved: int  # requests moved off it (queued ones resubmitted, running ones co-migrated)
    seconds: float
    forced: int = 0  # requests still there at the deadline, which failed over when it stopped


class Router:
    def __init__(
        self,
        replicas: list[Replica],
        pinned_adapters: Callable[[], list[AdapterRef]] = list,
        cfg: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg = cfg or RouterConfig()
        self.clock = clock
        self.tally = RouterCounters(cfg, [r.replica_id for r in replicas], clock)
        self.pool = ReplicaPool(replicas, cfg, self.tally.counters)
        self.table = RequestTable(self.tally.output_lengths, [s.replica_id for s in self.pool.slots])
        self.residency = AdapterResidency(cfg, self.pool, self.table, self.tally, pinned_adapters)
        self.replica_views = ReplicaViews(cfg, self.pool, self.table, self.tally, clock)
        self.chooser = ReplicaChooser(cfg, self.pool, self.residency, self.table, self.replica_views, self.tally)
        # Each request's queueing delay, from the replicas' measurements (set its observer for /metrics).
        self.queue_times = QueueTimes(clock)
        self.stats = StatsReader(self.pool, self.table, self.tally, self.queue_times)
        self.deadlines = Deadlines(cfg.request_timeout_s)
        self.legs = LegRunner(self.residency, self.table, self.tally, self.queue_times, self.deadlines, clock)
        self.pool.prepare = self.residency.load_pinned
        self.pool.on_failed = self._replica_failed
        # The pieces' state under the names the server reads (the same objects, never rebound).
        self.slots = self.pool.slots
        self.requests = self.table.requests
        self.inflight_by_adapter = self.table.inflight_by_adapter
        self.totals = self.table.totals
        self.counters = self.tally.counters
        self.output_lengths = self.tally.output_lengths
        self.slo = self.tally.slo
        self.prefix_cache = self.tally.prefix_cache
        self.superseded = self.residency.superseded
        self.reported = self.stats.reported

    @property
    def cost_models(self) -> dict[int, ReplicaCostModel]:
        return self.tally.cost_models

    @cost_models.setter
    def cost_models(self, models: dict[int, ReplicaCostModel]) -> None:
        self.tally.cost_models = models

    @property
    def next_replica_id(self) -> int:
        return self.pool.next_replica_id

    @property
    def arrivals_total(self) -> int:
        return self.tally.arrivals_total

    @property
    def output_tokens_total(self) -> int:
        return self.tally.output_tokens_total

    @property
    def finished_total(self) -> int:
        return self.tally.finished_total

    @property
    def finished_tokens_total(self) -> int:
        return self.tally.finished_tokens_total

    # ---- the pieces' operations, as the server calls them -----------------------------------
    async def start(self) -> None:
        await self.pool.start()

    async def shutdown(self) -> None:
        await self.pool.shutdown()

    def slot(self, replica_id: int) -> ReplicaSlot:
        return self.pool.slot(replica_id)

    def find_slot(self, replica_id: int) -> ReplicaSlot | None:
        return self.pool.find_slot(replica_id)

    def serving_ids(self) -> list[int]:
        return self.pool.serving_ids()

    def may_serve_soon(self) -> bool:
        return self.pool.may_serve_soon()

    async def place(self, ref: AdapterRef, pinned: bool = False, replacing: int | None = None) -> list[int]:
        return await self.residency.place(ref, pinned, replacing)

    async def load_on(self, replica_id: int, ref: AdapterRef) -> None:
        await self.residency.load_on(replica_id, ref)

    async def load_everywhere(self, ref: AdapterRef, pinned: bool = False) -> None:
        await self.residency.load_everywhere(ref, pinned)

    async def unload_everywhere(self, int_id: int) -> None:
        await self.residency.unload_everywhere(int_id)

    def host_bytes(self, st: ReplicaStats) -> int:
        return self.residency.host_bytes(st)

    def in_use_on(self, slot: ReplicaSlot) -> set[int]:
        return self.table.in_use_on(slot)

    def inflight_with(self, adapter_int_id: int) -> int:
        return self.table.inflight_with(adapter_int_id)

    def routed_counts(self) -> dict[int, int]:
        return self.table.routed_counts()

    def adapter_rates(self, window_s: float) -> dict[str, float]:
        return self.tally.adapter_rates(window_s)

    def cost_params(self) -> dict[int, CostParams]:
        return self.tally.cost_params()

    def views(self) -> list[ReplicaView]:
        """Every replica with each of its requests (O(requests)), each request with the prompt
        prefix each replica's cache probably holds for it; changes nothing."""
        return self.chooser.with_cached_prefixes(self.replica_views.views())

    def dispatch_views(self) -> list[ReplicaView]:
        return self.replica_views.dispatch_views()

    def recount(self) -> None:
        """Price every request afresh and rebuild the dispatch sums exactly: expected lengths move
        as requests finish (the balancer does it before it plans)."""
        self.table.recount_all([s.replica_id for s in self.pool.slots])

    async def refresh_stats(self) -> list[ReplicaStats]:
        return await self.stats.refresh()

    def reported_stats(self) -> list[ReplicaStats]:
        return self.stats.reported_stats()

    # ---- elastic: add and remove replicas (dlora/cluster/elastic.py decides when) -------------
    async def add_replica(self, replica: Replica, preload: Sequence[AdapterRef] = ()) -> ReplicaSlot:
        """Start a new replica and take it into dispatch once started, with `preload` (the adapters
        dispatch is about to send it) loaded; its cost model starts from the others' fitted ones
        (same hardware). A replica that fails to start is shut down and not added."""
        slot = ReplicaSlot(replica, cache=self.pool.new_cache())
        rid = slot.replica_id
        self.tally.new_replica(rid)
        self.table.track(rid)
        self.pool.add(slot)
        try:
            await self.pool.start_slot(slot)
        except BaseException:
            self._forget_slot(slot)
            await asyncio.gather(replica.shutdown(), return_exceptions=True)
            raise
        for ref in preload:
            try:
                await self.residency.load(slot, ref)
            except Exception as e:  # a preload is an optimisation: the first request loads it anyway
                log.info("preload of %s on new replica %d skipped: %s", ref.name, rid, e)
        return slot

    async def drain(self, replica_id: int, timeout_s: float = 120.0) -> DrainResult:
        """Remove a replica without losing a request: it takes nothing new, its queued requests
        move at once and its running ones by co-migration (prompt + generated tokens, continued
        on the receiver), and it stops once nothing is left on it. What is still there after
        `timeout_s` fails over when it stops (resubmitted like after a crash). Raises ValueError
        for the last serving replica."""
        slot = self.pool.slot(replica_id)
        if not self.pool.any_serving(besides=slot):
            raise ValueError(f"replica {replica_id} is the last serving replica: nothing to move its work to")
        started = self.clock()
        slot.draining = True
        moved, forced = 0, 0
        try:
            while True:
                on = self.table.on(slot)
                if not on:
                    break
                if self.clock() - started >= timeout_s:
                    forced = len(on)
                    break
                for st in on:
                    if st.engine_request_id is None or st.migrate_to is not None:
                        continue  # still loading its adapter here, or already moving
                    target = self.chooser.drain_target(st)
                    if target is not None and await self.migrate(st.request.request_id, target):
                        moved += 1
                await asyncio.sleep(DRAIN_POLL_S)
        except asyncio.CancelledError:  # taken back: it serves again (unless it failed meanwhile)
            slot.draining = False
            if not slot.healthy and slot.recovering is None:
                self.pool.mark_failed(slot)
            raise
        finally:
            self.counters["drain_moves"] += moved
        self._forget_slot(slot)
        if slot.recovering:
            slot.recovering.cancel()
        await asyncio.gather(slot.replica.shutdown(), return_exceptions=True)
        return DrainResult(replica_id, moved, self.clock() - started, forced)

    def _replica_failed(self, slot: ReplicaSlot) -> None:
        """Its open streams end at once, and its prefix cache is gone with its engine."""
        self.table.interrupt(slot)
        self.chooser.prefixes.forget(slot.replica_id)

    def _forget_slot(self, slot: ReplicaSlot) -> None:
        self.pool.remove(slot)
        rid = slot.replica_id
        self.chooser.prefixes.forget(rid)
        self.tally.cost_models.pop(rid, None)
        self.table.untrack(rid)
        self.stats.reported.pop(rid, None)

    # ---- requests ---------------------------------------------------------------------------
    async def _choose(self, state: RequestState) -> ReplicaSlot:
        return await self.chooser.choose(state)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request's deltas; migrations and replica failures are hidden by resubmission."""
        if req.arrival_time is None:  # every leg carries it: a moved request keeps its place in line
            req = dataclasses.replace(req, arrival_time=time.time())
        if req.adapter is not None and (newest := self.residency.current(req.adapter)) is not req.adapter:
            req = dataclasses.replace(req, adapter=newest)
        state = RequestState(req, arrival=self.clock(), migrate_to=preferred_replica.get())
        self.tally.arrived(state)
        self.table.add(state)
        self.queue_times.start(req.request_id, state.adapter)
        timer = self.deadlines.arm(state)
        try:
            current = req
            while True:
                choosing = self.clock()
                slot = await self.deadlines.in_time(state, self._choose(state))
                self.queue_times.router_wait(req.request_id, self.clock() - choosing)
                leg = self.legs.run(slot, current, state)
                try:
                    async for delta in leg:
                        if delta.token_ids and state.first_token_at is None:
                            state.first_token_at = self.clock()
                        if delta.cached_tokens is not None:
                            self.tally.prefix_cache_read(slot.replica_id, state, current, delta.cached_tokens)
                        if delta.finished:  # before the yield: the client may close the stream on it
                            self.tally.finished(state, delta)
                            self.chooser.record_context(state, slot, state.context_token_ids)
                        yield delta
                        if delta.finished:
                            return
                    if not state.migrated:  # the stream ended without saying why: report, don't loop
                        yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
                        return
                    state.migrated = False
                    self.counters["migrations"] += 1
                except ReplicaFailure as e:
                    self.pool.mark_failed(slot)
                    state.failures += 1
                    if state.failures > self.cfg.max_resubmissions:
                        log.warning("request %s: %s; failed %d times, giving up", req.request_id, e, state.failures)
                        self.counters["resubmission_limit"] += 1
                        raise ResubmissionLimit(f"request failed on {state.failures} replicas; giving up") from e
                    log.warning("request %s: %s; resubmitting after %d tokens", req.request_id, e, len(state.generated))
                    self.counters["resubmissions"] += 1
                except AdapterUnavailable as e:
                    # That replica's node cannot get the adapter: the others may (the chooser
                    # skips it for this adapter from now on), and the replica serves the rest.
                    if current.adapter is not None:
                        slot.unavailable.add(current.adapter.int_id)
                    state.failures += 1
                    if state.failures > self.cfg.max_resubmissions:
                        raise
                    log.warning("request %s on replica %d: %s; resubmitting", req.request_id, slot.replica_id, e)
                    self.counters["resubmissions"] += 1
                finally:
                    # Close the leg now (a no-op once it ran out): its cleanup, the replica's sums that
                    # dispatch reads among it, would otherwise wait for the event loop to finalize an
                    # abandoned generator when the request ends or its client goes away.
                    await leg.aclose()
                state.resubmissions += 1
                current = state.continuation()
                if current.sampling.max_tokens <= 0:
                    done = Delta(token_ids=[], text="", finished=True, finish_reason="length")
                    self.tally.finished(state, done)
                    yield done
                    return
        finally:
            if timer is not None:
                timer.cancel()
            self.table.remove(state)
            self.queue_times.finish(req.request_id)

    async def migrate(self, request_id: str, dst_replica_id: int) -> bool:
        """Move a request, queued or running, to another replica (abort here, continue there).

        Only a leg already sent to its replica can move: one still loading its adapter would miss
        the abort, run to its end where it is, and keep a stale `migrate_to` that blocks any later move.
        """
        state = self.table.requests.get(request_id)
        dst = self.pool.find_slot(dst_replica_id)
        if (
            state is None
            or state.slot is None
            or state.engine_request_id is None
            or state.migrate_to is not None
            or state.slot.replica_id == dst_replica_id
            or dst is None
            or not dst.serving
        ):
            return False
        state.migrate_to = dst_replica_id
        slot = state.slot
        try:
            await self.pool.call(slot, slot.replica.abort(state.engine_request_id))
        except ReplicaFailure as e:  # the request is resubmitted with the replica's others
            log.warning("replica %d failed an abort (%s); rebuilding it", slot.replica_id, e)
            self.pool.mark_failed(slot)
        return True
