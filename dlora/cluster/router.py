"""The router: picks a replica for each request, owns its token state, moves it when told to.

NOTE on the request life cycle: the router keeps the prompt ids and every token id received. A
request leaves its replica in two ways, and both continue the same way — it is resubmitted to
another replica as `prompt + generated` with `max_tokens` reduced by what was generated, so the
client's stream goes on with no duplicated or missing tokens:
  * migration: the balancer sets `migrate_to` and aborts the request on its replica; the engine
    ends the stream with finish_reason "abort", which the router swallows;
  * failure: the replica's actor died or restarted, or its engine died (`ReplicaFailure`), or it
    stopped answering: a call that misses its deadline (`actor_call_timeout_s`) is followed by a
    ping that does not wait for the engine; a replica that answers it is slow (a long engine step),
    not dead, and is waited for up to `replica_stall_timeout_s`; one that does not, or that leaves a
    call unanswered that long, has failed. A failed replica is rebuilt in the background
    and its pinned adapters are loaded again. A request is resubmitted after at most
    `max_resubmissions` failures, then fails (`ResubmissionLimit`): it may be what kills them.
Bounds: a request that passes its deadline (`request_timeout_s`) is aborted and fails with
`RequestTimeout`; with no replica up, a request waits `recovery_grace_s` at most, then fails with
`NoReplicaError`; a replica that fails `max_restart_attempts` rebuilds in a row is reported as
given up (`ReplicaSlot.gave_up`) and retried only every `GAVE_UP_RETRY_S`.
Elastic clusters (dlora/cluster/elastic.py) add replicas (`add_replica`) and remove them
(`drain`): a draining replica takes nothing new, and its requests move by the same abort and
continuation as a migration before it stops, so scaling in ends no stream.
Replicas are chosen by a dispatch policy (dlora/cluster/dispatch.py) over `ReplicaView`s that the
router builds from per-replica sums it keeps request by request (`LoadTotals`), so a dispatch costs
the same however many requests are in flight; the balancer gets full per-request views.
A request that finishes by itself is judged against its adapter's SLO (`slo`, dlora/slo/accounting.py)
with its times from reaching the router to its first and last token, whatever replicas it ran on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from dlora.cluster.dispatch import make_dispatch_policy
from dlora.cluster.errors import NoReplicaError, RequestTimeout, ResubmissionLimit
from dlora.cluster.estimators.cost_model import MERGED_RATIO_PRIOR, CostParams, ReplicaCostModel, step_left
from dlora.cluster.estimators.output_lengths import OutputLengthConfig, OutputLengthEstimator
from dlora.cluster.host_cache import HostCache
from dlora.cluster.interruptible import InterruptibleStream
from dlora.cluster.queue_time import QueueTimes
from dlora.cluster.snapshots import IterationSample, LoadTotals, ReplicaView, RequestLoad
from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, ReplicaStats
from dlora.slo import feasible_dispatch
from dlora.slo.accounting import SloAccounting
from dlora.slo.config import SloConfig
from dlora.slo.isolated import mean_params

log = logging.getLogger(__name__)

# The replica that requests started in this context go to first (a batch plan's placement, set by
# dlora/batch/planned.py in each line's task); dispatch decides when it is None or not serving. A
# context variable because the request reaches the router through the online routes' handlers.
preferred_replica: ContextVar[int | None] = ContextVar("dlora_preferred_replica", default=None)

__all__ = ["NoReplicaError", "RequestTimeout", "ResubmissionLimit", "Router", "RouterConfig"]

# A replica that gave up rebuilding is tried again this rarely: a lasting fault (a bad model
# path, a node out of memory) must not spin, a passing one may still heal.
GAVE_UP_RETRY_S = 60.0
# How often a drain looks again for requests left on its replica (moves take one abort each).
DRAIN_POLL_S = 0.05


class Replica(Protocol):
    replica_id: int

    async def start(self) -> None: ...
    def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]: ...
    async def abort(self, request_id: str) -> None: ...
    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None: ...
    async def remove_adapter(self, int_id: int) -> bool: ...
    async def stats(self) -> ReplicaStats: ...
    async def ping(self) -> None: ...  # answers without waiting for the engine; raises if it died
    async def shutdown(self) -> None: ...


def static_home(adapter_id: int, num_replicas: int) -> int:
    """Static placement: the one replica an adapter lives on (by its registry id)."""
    return adapter_id % num_replicas


@dataclass
class ReplicaSlot:
    replica: Replica
    healthy: bool = False
    loaded: dict[int, str] = field(default_factory=dict)  # adapter id -> name (engine LRU may evict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: asyncio.Task | None = None
    restarts: int = 0
    failed_restarts: int = 0  # rebuilds that failed in a row
    gave_up: bool = False  # max_restart_attempts rebuilds failed in a row: reported, retried rarely
    last_stats: ReplicaStats | None = None
    # Its host LoRA cache in bytes (RouterConfig.host_cache_bytes); None: vLLM's count LRU alone.
    cache: HostCache | None = None
    # Held while adapters are unloaded to make room and the new one is loaded, so two loads never
    # pick their victims from one state.
    cache_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Being removed (`Router.drain`): nothing new is sent here, its requests move elsewhere, and a
    # failure does not rebuild it.
    draining: bool = False
    # The stats read still unanswered, if any, and when it was asked (event-loop time): a slow
    # replica's read is awaited again by the next refresh, not asked twice.
    stats_call: asyncio.Future | None = None
    stats_asked_at: float = 0.0
    # When its engine's step under way started, as the router sees it (router clock): the last time
    # tokens came from it, or a request reached it idle. None: no step seen yet.
    step_started_at: float | None = None

    @property
    def replica_id(self) -> int:
        return self.replica.replica_id

    @property
    def serving(self) -> bool:
        """Takes new requests: started, healthy and not draining."""
        return self.healthy and not self.draining

    def state(self, starting: bool) -> str:
        """ "draining", "serving", "starting" (`starting`: the autoscaler is starting it) or "down"."""
        if self.draining:
            return "draining"
        if self.serving:
            return "serving"
        return "starting" if starting else "down"


@dataclass(frozen=True)
class DrainResult:
    replica_id: int
    moved: int  # requests moved off it (queued ones resubmitted, running ones co-migrated)
    seconds: float
    forced: int = 0  # requests still there at the deadline, which failed over when it stopped


@dataclass
class RequestState:
    request: GenerateRequest
    arrival: float
    generated: list[int] = field(default_factory=list)
    resubmissions: int = 0
    slot: ReplicaSlot | None = None  # the current leg's replica (from its adapter load on)
    engine_request_id: str | None = None  # the current leg's id on its replica, once sent there
    # The current leg left vLLM's waiting queue: its queue wait was reported or its first token came.
    admitted: bool = False
    # Its replica preempted it back to the waiting queue (KV ran out) at the last stats read: it
    # holds no KV there and re-prefills its whole context when resumed, like a queued request.
    preempted: bool = False
    queued_since: float = 0.0  # when the current leg started (reset when it is sent)
    migrate_to: int | None = None
    migrated: bool = False  # the last stream ended because of a migration
    failures: int = 0  # replicas that failed under it
    deadline: float | None = None  # event-loop time it must end by
    first_token_at: float | None = None  # router clock at its first token, on whichever replica
    leg: InterruptibleStream | None = None  # the current replica stream, once open
    counted: RequestLoad | None = None  # what it adds to `counted_on`'s LoadTotals now
    counted_on: int | None = None

    @property
    def adapter(self) -> str | None:
        return self.request.adapter.name if self.request.adapter else None

    def continuation(self) -> GenerateRequest:
        """The request to send after a move: the prompt grows by what was generated."""
        s = self.request.sampling
        n = len(self.generated)
        # A leg's first output gives the prompt's logprobs with its first token: once a token came, they
        # came, and this leg's prompt holds generated tokens too.
        prompt_logprobs = s.prompt_logprobs if n == 0 else None
        sampling = dataclasses.replace(
            s,
            max_tokens=s.max_tokens - n,
            min_tokens=max(0, s.min_tokens - n),
            prompt_logprobs=prompt_logprobs,
            generated_before=n,  # its grammar resumes after them; penalties and bad words see them
        )
        return dataclasses.replace(
            self.request,
            request_id=f"{self.request.request_id}-r{self.resubmissions}",
            prompt_token_ids=tuple(self.request.prompt_token_ids) + tuple(self.generated),
            sampling=sampling,
        )

    def load(self, lengths: OutputLengthEstimator | None = None) -> RequestLoad:
        """What the balancer sees; its output is expected from `lengths` (else max_tokens)."""
        n, cap = len(self.generated), self.request.sampling.max_tokens
        expected = lengths.expected_total(self.adapter, n, cap) if lengths is not None else cap
        return RequestLoad(
            request_id=self.request.request_id,
            adapter=self.adapter,
            prompt_tokens=len(self.request.prompt_token_ids),
            output_tokens=n,
            expected_output_tokens=expected,
            running=self.admitted and not self.preempted,
            queued_since=self.queued_since,
            arrival=self.arrival,
            adapter_bytes=self.request.adapter.size_bytes if self.request.adapter is not None else 0,
            max_tokens=cap,
        )


@dataclass(frozen=True)
class RouterConfig:
    dispatch: str = "proactive"
    # proactive dispatch compares by pending time only the replicas that would start a request
    # within this many seconds of the soonest (cluster.dispatch_start_slack_s); None: all of them
    dispatch_start_slack_s: float | None = None
    # static: each adapter lives on one replica (id mod N) and only goes there — the baseline
    # placement dLoRA compares against; dynamic: any replica, adapters loaded where needed.
    static_placement: bool = False
    adapter_slots: int = 4  # adapters one replica may hold at once (vLLM max_cpu_loras)
    # Bytes of adapter weights one replica's host cache may hold (engine.max_cpu_lora_mib); the
    # router then unloads least recently used adapters itself. None: vLLM's count LRU alone.
    host_cache_bytes: int | None = None
    batch_adapter_slots: int = 1 << 20  # distinct adapters in one engine step (vLLM max_loras)
    kv_capacity_tokens: int = 1 << 17  # per replica until its engine's stats report the real one
    max_batch: int = 64  # requests one engine step may run (vLLM max_num_seqs)
    # merged step cost / unmerged until a replica's merged steps are measured: the engines' LoRA
    # backend's prior (scheduling.merged_cost_ratio), so dispatch and batch plans price merging alike
    merged_ratio_prior: float = MERGED_RATIO_PRIOR
    # Output lengths the balancer expects (dispatch, migration): per-adapter history of finished requests.
    output_lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)
    max_resubmissions: int = 2  # replica failures a request survives (migrations don't count)
    actor_call_timeout_s: float = 30.0  # every replica call but a stream; missed: the replica is pinged
    # A call a replica that still answers pings has left unanswered this long: its engine hangs.
    replica_stall_timeout_s: float = 300.0
    replica_start_timeout_s: float = 600.0  # building a replica's engine
    max_restart_attempts: int = 5  # failed rebuilds in a row before a replica is given up
    request_timeout_s: float | None = None  # a request's deadline from arrival (None: none)
    # With no replica up, how long a request waits for one to come back before NoReplicaError.
    recovery_grace_s: float = 3.0
    # The default SLO finished requests are judged against (`slo:`; adapters may have their own).
    slo: SloConfig = field(default_factory=SloConfig)


class Router:
    def __init__(
        self,
        replicas: list[Replica],
        pinned_adapters: Callable[[], list[AdapterRef]] = list,
        cfg: RouterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg or RouterConfig()
        self.slots = [ReplicaSlot(r, cache=self._new_cache()) for r in replicas]
        # Aladdin's SLO-aware modes (`_slo_choose`) need every request's state; the rest are policies
        # over the replicas' sums. Proactive dispatch is the fallback object either way.
        self.slo_dispatch = self.cfg.dispatch if self.cfg.dispatch in feasible_dispatch.MODES else None
        self.dispatcher = make_dispatch_policy(
            "proactive" if self.slo_dispatch else self.cfg.dispatch, self.cfg.dispatch_start_slack_s
        )
        self.clock = clock
        # Returns the AdapterRefs that must be resident on every replica (pinned ones).
        self._pinned_adapters = pinned_adapters
        self.requests: dict[str, RequestState] = {}
        self.inflight_by_adapter: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()  # resubmissions, migrations, ...
        self.arrivals: deque[tuple[float, str | None]] = deque(maxlen=100_000)  # (time, adapter) for rates
        self.arrivals_total = 0  # requests that ever arrived (the balancer's period rates)
        # Output tokens streamed, and requests (and their tokens) that finished by themselves or at
        # their cap, since start: the autoscaler's heartbeat differences them.
        self.output_tokens_total = 0
        self.finished_total = 0
        self.finished_tokens_total = 0
        self.next_replica_id = 1 + max((r.replica_id for r in replicas), default=-1)
        # The balancer's wake-ups for event-triggered moves: a leg's stream ended (a slot may be
        # free there), a leg was sent to its replica (it may queue there).
        self.on_leg_ended: Callable[[int], None] = lambda replica_id: None
        self.on_leg_sent: Callable[[], None] = lambda: None
        self._loading: dict[tuple[int, int], asyncio.Future] = {}
        self.adapter_sizes: dict[int, int] = {}  # adapter id -> bytes, of every version loaded somewhere
        # Fitted from each replica's measured steps (refresh_stats); kept across restarts (same hardware).
        self.cost_models = {
            s.replica_id: ReplicaCostModel(
                CostParams(max_batch=self.cfg.max_batch, merged_ratio=self.cfg.merged_ratio_prior)
            )
            for s in self.slots
        }
        # Lengths of finished requests per adapter: what dispatch and migration expect instead of max_tokens.
        self.output_lengths = OutputLengthEstimator(self.cfg.output_lengths)
        # Each request's queueing delay, from the replicas' measurements (set its observer for /metrics).
        self.queue_times = QueueTimes(clock)
        # Per replica, its requests' sums for dispatch (kept by _recount, rebuilt exactly by views()).
        self.totals: dict[int, LoadTotals] = {s.replica_id: LoadTotals() for s in self.slots}
        # Adapter versions replaced in place (old int_id -> the version that replaced it): a request
        # that took an old version before the update is sent on the new one (AdapterManager._retire).
        self.superseded: dict[int, AdapterRef] = {}
        # Each replica's last stats read by refresh_stats (the balancer's loop): what /metrics shows.
        self.reported: dict[int, ReplicaStats] = {}
        # Per-adapter SLO attainment and normalized latency of finished requests (for /metrics); the
        # adapter life cycle sets each adapter's own SLO and drops an unregistered one.
        self.slo = SloAccounting(self.cfg.slo, self._isolated_basis())

    def _new_cache(self) -> HostCache | None:
        if self.cfg.host_cache_bytes is None:
            return None
        return HostCache(self.cfg.host_cache_bytes, max_entries=self.cfg.adapter_slots)

    # ---- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self._start_slot(s) for s in self.slots))

    async def _start_slot(self, slot: ReplicaSlot) -> None:
        t0 = time.monotonic()
        await self._call(slot, slot.replica.start(), self.cfg.replica_start_timeout_s)
        slot.loaded.clear()
        if slot.cache is not None:
            slot.cache.clear()
        for ref in self._pinned_adapters():
            if not self.cfg.static_placement or self.home(ref) is slot:
                await self._load(slot, ref, pinned=True)
        slot.healthy = True
        slot.ready.set()
        log.info("replica %d ready in %.1f s", slot.replica_id, time.monotonic() - t0)

    async def shutdown(self) -> None:
        slots = list(self.slots)
        for s in slots:
            if s.recovering:
                s.recovering.cancel()
        await asyncio.gather(*(s.replica.shutdown() for s in slots), return_exceptions=True)

    def slot(self, replica_id: int) -> ReplicaSlot:
        return next(s for s in self.slots if s.replica_id == replica_id)

    def find_slot(self, replica_id: int) -> ReplicaSlot | None:
        """The replica's slot, None once it was removed (`drain`)."""
        return next((s for s in self.slots if s.replica_id == replica_id), None)

    # ---- elastic: add and remove replicas (dlora/cluster/elastic.py decides when) -------------
    async def add_replica(self, replica: Replica, preload: Sequence[AdapterRef] = ()) -> ReplicaSlot:
        """Start a new replica and take it into dispatch once started, with `preload` (the adapters
        dispatch is about to send it) loaded; its cost model starts from the others' fitted ones
        (same hardware). A replica that fails to start is shut down and not added."""
        slot = ReplicaSlot(replica, cache=self._new_cache())
        rid = slot.replica_id
        self.next_replica_id = max(self.next_replica_id, rid + 1)
        self.cost_models[rid] = ReplicaCostModel(self._isolated_basis())
        self.totals[rid] = LoadTotals()
        self.slots.append(slot)
        try:
            await self._start_slot(slot)
        except BaseException:
            self._forget_slot(slot)
            await asyncio.gather(replica.shutdown(), return_exceptions=True)
            raise
        for ref in preload:
            try:
                await self._load(slot, ref)
            except Exception as e:  # a preload is an optimisation: the first request loads it anyway
                log.info("preload of %s on new replica %d skipped: %s", ref.name, rid, e)
        return slot

    async def drain(self, replica_id: int, timeout_s: float = 120.0) -> DrainResult:
        """Remove a replica without losing a request: it takes nothing new, its queued requests
        move at once and its running ones by co-migration (prompt + generated tokens, continued
        on the receiver), and it stops once nothing is left on it. What is still there after
        `timeout_s` fails over when it stops (resubmitted like after a crash). Raises ValueError
        for the last serving replica."""
        slot = self.slot(replica_id)
        if not any(s.serving for s in self.slots if s is not slot):
            raise ValueError(f"replica {replica_id} is the last serving replica: nothing to move its work to")
        started = self.clock()
        slot.draining = True
        moved, forced = 0, 0
        try:
            while True:
                on = [st for st in self.requests.values() if st.slot is slot]
                if not on:
                    break
                if self.clock() - started >= timeout_s:
                    forced = len(on)
                    break
                for st in on:
                    if st.engine_request_id is None or st.migrate_to is not None:
                        continue  # still loading its adapter here, or already moving
                    target = self._drain_target(st)
                    if target is not None and await self.migrate(st.request.request_id, target):
                        moved += 1
                await asyncio.sleep(DRAIN_POLL_S)
        except asyncio.CancelledError:  # taken back: it serves again (unless it failed meanwhile)
            slot.draining = False
            if not slot.healthy and slot.recovering is None:
                self._mark_failed(slot)
            raise
        finally:
            self.counters["drain_moves"] += moved
        self._forget_slot(slot)
        if slot.recovering:
            slot.recovering.cancel()
        await asyncio.gather(slot.replica.shutdown(), return_exceptions=True)
        return DrainResult(replica_id, moved, self.clock() - started, forced)

    def _drain_target(self, state: RequestState) -> int | None:
        """Where a drained replica's request goes: dispatch's choice among the serving replicas."""
        views = self.dispatch_views()
        return self._dispatched(state, views) if views else None

    def _dispatched(self, state: RequestState, views: list[ReplicaView]) -> int:
        """The replica the dispatch policy picks for the request among `views`."""
        return self.dispatcher.choose(views, state.load(self.output_lengths), self.cost_params()).replica_id

    def _forget_slot(self, slot: ReplicaSlot) -> None:
        if slot in self.slots:
            self.slots.remove(slot)
        rid = slot.replica_id
        self.cost_models.pop(rid, None)
        self.totals.pop(rid, None)
        self.reported.pop(rid, None)

    async def _call(self, slot: ReplicaSlot, call, timeout_s: float | None = None):
        """A replica call with a deadline. At each missed deadline the replica is pinged: one that
        answers is busy (one engine step can outlast the deadline) and the call is awaited again,
        up to `replica_stall_timeout_s` in all; one that does not answer has failed, and so has one
        whose call is still unanswered at the stall bound. Failures raise ReplicaFailure."""
        task = asyncio.ensure_future(call)
        asked_at = asyncio.get_running_loop().time()
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(task), timeout_s or self.cfg.actor_call_timeout_s)
                except TimeoutError:
                    await self._check_alive(slot, asked_at)
        finally:
            task.cancel()  # a no-op once it is done

    async def _check_alive(self, slot: ReplicaSlot, asked_at: float) -> None:
        """After a missed deadline: raises ReplicaFailure unless the replica answers a ping and
        the call asked at `asked_at` is younger than the stall bound."""
        waited = asyncio.get_running_loop().time() - asked_at
        if waited >= self.cfg.replica_stall_timeout_s:
            raise ReplicaFailure(f"replica {slot.replica_id} left a call unanswered for {waited:.0f} s")
        try:
            await asyncio.wait_for(slot.replica.ping(), self.cfg.actor_call_timeout_s)
        except TimeoutError:
            raise ReplicaFailure(
                f"replica {slot.replica_id} did not answer a ping within {self.cfg.actor_call_timeout_s:g} s"
            ) from None
        except ReplicaFailure:
            raise
        except Exception as e:  # whatever a dead actor raises: it is gone either way
            raise ReplicaFailure(f"replica {slot.replica_id} failed a ping: {e}") from e
        self.counters["busy_deadlines"] += 1
        log.info("replica %d is busy: a call has waited %.0f s; its pings answer", slot.replica_id, waited)

    def _mark_failed(self, slot: ReplicaSlot) -> None:
        if slot.stats_call is not None:  # asked of the failed engine: the rebuilt one is asked afresh
            slot.stats_call.cancel()
        if slot.recovering or (slot.draining and not slot.healthy):
            return
        slot.healthy = False
        slot.ready.clear()
        if not slot.draining:  # a draining replica is on its way out: its requests fail over, no rebuild
            slot.recovering = asyncio.create_task(self._recover(slot))
        # Streams still open there may wait forever on a hung engine: move them now.
        for st in list(self.requests.values()):
            if st.slot is slot and st.leg is not None:
                st.leg.interrupt(ReplicaFailure(f"replica {slot.replica_id} failed"))

    async def _recover(self, slot: ReplicaSlot) -> None:
        delay = 1.0
        while True:
            try:
                await self._start_slot(slot)
                slot.restarts += 1
                slot.failed_restarts, slot.gave_up, slot.recovering = 0, False, None
                return
            except Exception as e:  # keep trying: Ray may still be restarting the actor process
                slot.failed_restarts += 1
                if slot.failed_restarts >= self.cfg.max_restart_attempts:
                    if not slot.gave_up:
                        log.error(
                            "replica %d failed to rebuild %d times in a row (%s); giving up on it, "
                            "retrying every %.0f s",
                            slot.replica_id,
                            slot.failed_restarts,
                            e,
                            GAVE_UP_RETRY_S,
                        )
                    slot.gave_up, delay = True, GAVE_UP_RETRY_S
                else:
                    log.warning("replica %d restart failed (%s); retrying in %.0f s", slot.replica_id, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0) if not slot.gave_up else GAVE_UP_RETRY_S

    # ---- adapters ---------------------------------------------------------------------------
    async def _load(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool = False) -> None:
        """Load once per (replica, adapter) even when many requests ask at the same time."""
        key = (slot.replica_id, ref.int_id)
        fut = self._loading.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._add(slot, ref, pinned))
            self._loading[key] = fut
            fut.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(fut)
        slot.loaded[ref.int_id] = ref.name
        self.adapter_sizes[ref.int_id] = ref.size_bytes

    async def _add(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool) -> None:
        """The engine load; with a host cache in bytes, first the unloads that make room for it."""
        if slot.cache is None:
            await self._timed_add(slot, ref, pinned)
            return
        async with slot.cache_lock:
            victims = slot.cache.admit(ref.int_id, ref.size_bytes, pinned, self.in_use_on(slot))
            for int_id in victims:  # at once: a request for one of them from now on loads it again
                slot.loaded.pop(int_id, None)
            try:
                for int_id in victims:
                    log.info("replica %d: unloading adapter %d to make room for %s", slot.replica_id, int_id, ref.name)
                    await self._call(slot, slot.replica.remove_adapter(int_id))
                await self._timed_add(slot, ref, pinned)
            except BaseException:
                slot.cache.discard(ref.int_id)
                raise

    async def _timed_add(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool) -> None:
        """The replica's add_adapter, its duration priced into dispatch (the replica's load time)."""
        t0 = time.monotonic()
        await self._call(slot, slot.replica.add_adapter(ref, pinned))
        self.cost_models[slot.replica_id].observe_load(time.monotonic() - t0)

    def in_use_on(self, slot: ReplicaSlot) -> set[int]:
        """Adapter ids of the requests whose current leg is on `slot` (loading, queued or running)."""
        return {st.request.adapter.int_id for st in self.requests.values() if st.slot is slot and st.request.adapter}

    async def load_on(self, replica_id: int, ref: AdapterRef) -> None:
        await self._load(self.slot(replica_id), ref)

    async def place(self, ref: AdapterRef, pinned: bool = False, replacing: int | None = None) -> list[int]:
        """Load a newly registered adapter (or version) where it starts out; returns those replicas.

        Pinned adapters go to every healthy replica, and under static placement to the adapter's
        home, as `load_everywhere`. An unpinned one goes to one replica: this load is the engine's
        acceptance check, and every other copy comes with demand (a request dispatched to a replica
        without it, the balancer's preloads). A new version (`replacing` the old one's id) goes
        wherever the old version is loaded. Raises the first engine error."""
        if pinned or self.cfg.static_placement:
            await self.load_everywhere(ref, pinned)
            return [self.home(ref).replica_id] if self.cfg.static_placement else self.healthy_ids()
        healthy = [s for s in self.slots if s.serving]
        if not healthy:
            return []  # nothing to check it on: the first request loads it
        if healthy[0].cache is not None:
            healthy[0].cache.check_fits(ref.size_bytes)
        targets = [s for s in healthy if replacing is not None and replacing in s.loaded] or [self._roomiest(healthy)]
        await asyncio.gather(*(self._load(s, ref) for s in targets))
        return [s.replica_id for s in targets]

    def healthy_ids(self) -> list[int]:
        return [s.replica_id for s in self.slots if s.serving]

    def may_serve_soon(self) -> bool:
        """Whether a replica serves or is being rebuilt with rebuilds still succeeding: false only
        when every replica has been given up (or none is left)."""
        return any(not s.gave_up for s in self.slots)

    @staticmethod
    def _roomiest(slots: list[ReplicaSlot]) -> ReplicaSlot:
        """The replica with the most free host-cache bytes, then the fewest adapters loaded."""
        return min(slots, key=lambda s: (-s.cache.free_bytes if s.cache else 0, len(s.loaded), s.replica_id))

    def home(self, ref: AdapterRef) -> ReplicaSlot:
        """The adapter's replica under static placement."""
        return self.slots[static_home(ref.int_id, len(self.slots))]

    async def load_everywhere(self, ref: AdapterRef, pinned: bool = False) -> None:
        """Load on every healthy replica (its home only, under static placement); raises the first
        engine error, so nothing is half-registered."""
        targets = [self.home(ref)] if self.cfg.static_placement else [s for s in self.slots if s.serving]
        await asyncio.gather(*(self._load(s, ref, pinned) for s in targets))

    async def unload_everywhere(self, int_id: int) -> None:
        for s in self.slots:
            if s.healthy and int_id in s.loaded:
                try:
                    await self._call(s, s.replica.remove_adapter(int_id))
                except ReplicaFailure as e:  # its engine goes, and the adapter with it
                    log.warning(
                        "replica %d failed while unloading adapter %d (%s); rebuilding it", s.replica_id, int_id, e
                    )
                    self._mark_failed(s)
            s.loaded.pop(int_id, None)
            if s.cache is not None:
                s.cache.discard(int_id)
        self.adapter_sizes.pop(int_id, None)

    # ---- views for the balancer -------------------------------------------------------------
    def views(self) -> list[ReplicaView]:
        """Every replica with each of its requests (O(requests): the balancer's periodic rounds).
        Also recounts the dispatch sums exactly: expected lengths move as requests finish."""
        by_slot: dict[int, list[RequestLoad]] = {s.replica_id: [] for s in self.slots}
        for st in self.requests.values():
            st.counted = st.counted_on = None
            if st.slot is not None:
                st.counted, st.counted_on = st.load(self.output_lengths), st.slot.replica_id
                by_slot[st.slot.replica_id].append(st.counted)
        self.totals = {rid: LoadTotals.of(loads) for rid, loads in by_slot.items()}
        return [self._view(s, tuple(by_slot[s.replica_id])) for s in self.slots]

    def dispatch_views(self) -> list[ReplicaView]:
        """The serving replicas as dispatch sees them: sums instead of requests (O(replicas))."""
        return [self._view(s, (), self.totals[s.replica_id]) for s in self.slots if s.serving]

    def _recount(self, state: RequestState) -> None:
        """The request changed (replica, tokens, admitted, preempted): update its replica's sums."""
        if state.counted is not None and state.counted_on in self.totals:
            self.totals[state.counted_on].remove(state.counted)
        state.counted = state.counted_on = None
        if state.slot is not None:
            state.counted, state.counted_on = state.load(self.output_lengths), state.slot.replica_id
            self.totals[state.counted_on].add(state.counted)

    def _view(
        self, slot: ReplicaSlot, requests: tuple[RequestLoad, ...], totals: LoadTotals | None = None
    ) -> ReplicaView:
        batching = slot.last_stats.batching if slot.last_stats else None
        return ReplicaView(
            replica_id=slot.replica_id,
            requests=requests,
            totals=totals,
            resident_adapters=frozenset(slot.loaded.values()),
            merged_adapter=batching.merged_adapter if batching else None,
            kv_usage=batching.kv_usage if batching else None,
            kv_capacity_tokens=(
                batching.kv_capacity_tokens if batching and batching.kv_capacity_tokens else self.cfg.kv_capacity_tokens
            ),
            adapter_slots=self.cfg.adapter_slots,
            batch_adapter_slots=self.cfg.batch_adapter_slots,
            max_running=self.cfg.max_batch,
            healthy=slot.serving,  # planners move nothing to a draining replica
            adapter_bytes_free=self._cache_room(slot, totals),
            step_left_s=0.0 if totals is None else self._step_left(slot, totals),
        )

    def _step_left(self, slot: ReplicaSlot, totals: LoadTotals) -> float:
        """`ReplicaView.step_left_s` for dispatch: the step under way, priced by the replica's costs."""
        p = self.cost_models[slot.replica_id].params
        running = totals.requests - totals.queued
        return step_left(p, slot.step_started_at, self.clock(), running, totals.queued_context_tokens)

    def _cache_room(self, slot: ReplicaSlot, totals: LoadTotals | None) -> int | None:
        """`ReplicaView.adapter_bytes_free`: the slot's host cache room, its adapters with requests
        kept (from the replica's sums where dispatch has them; else every request's current leg)."""
        if slot.cache is None:
            return None
        if totals is None:
            return slot.cache.room(self.in_use_on(slot))
        busy = totals.adapters_in_use()
        return slot.cache.room({i for i, name in slot.loaded.items() if name in busy})

    def host_bytes(self, st: ReplicaStats) -> int:
        """Bytes of the adapters a replica's stats list in its host cache (sizes as registered)."""
        return sum(self.adapter_sizes.get(i, 0) for i in st.resident_adapter_ids)

    def inflight_with(self, adapter_int_id: int) -> int:
        """Requests in flight on this adapter version (O(requests): for admin operations)."""
        return sum(
            1 for st in self.requests.values() if st.request.adapter and st.request.adapter.int_id == adapter_int_id
        )

    def routed_counts(self) -> dict[int, int]:
        """Requests the router has on each replica now."""
        return {rid: totals.requests for rid, totals in self.totals.items()}

    def adapter_rates(self, window_s: float) -> dict[str, float]:
        """Requests per second per adapter over the last `window_s` seconds."""
        since = self.clock() - window_s
        counts = Counter(a for t, a in self.arrivals if t >= since and a is not None)
        return {a: n / window_s for a, n in counts.items()}

    def cost_params(self) -> dict[int, CostParams]:
        return {rid: model.params for rid, model in self.cost_models.items()}

    def _isolated_basis(self) -> CostParams:
        """What a request's isolated times are priced with: the replicas' fitted coefficients, averaged."""
        return mean_params(list(self.cost_params().values()))

    # ---- requests ---------------------------------------------------------------------------
    async def _wait_for(self, slots: list[ReplicaSlot]) -> None:
        """Wait a short grace for one of `slots` to come back (a rebuild about to finish), else fail
        at once: a rebuild takes tens of seconds, and a client is better told now (503) than held."""
        waiters = [asyncio.ensure_future(s.ready.wait()) for s in slots]
        try:
            await asyncio.wait(waiters, timeout=self.cfg.recovery_grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not any(s.serving for s in slots):
            which = "no replica is up" if len(slots) == len(self.slots) else "the adapter's replica is down"
            raise NoReplicaError(f"{which} (failed or rebuilding); retry later")

    async def _choose(self, state: RequestState) -> ReplicaSlot:
        """The replica for the request's next leg, counted on it at once (`_assign`)."""
        if not any(s.serving for s in self.slots):
            await self._wait_for(self.slots)
        if state.migrate_to is not None:
            target = self.find_slot(state.migrate_to)
            state.migrate_to = None
            if target is not None and target.serving:
                return self._assign(state, target)
        if self.cfg.static_placement and state.request.adapter is not None:
            home = self.home(state.request.adapter)
            if not home.healthy:
                await self._wait_for([home])
            return self._assign(state, home)
        if self.slo_dispatch is not None:
            return self._assign(state, self._slo_choose(state))
        return self._assign(state, self.slot(self._dispatched(state, self.dispatch_views())))

    def _slo_choose(self, state: RequestState) -> ReplicaSlot:
        """Aladdin's dispatch (dlora/slo/feasible_dispatch.py): the replicas where every request,
        the new one included, keeps its SLO, the least pending time among them (`slo_feasible`) or
        the fullest (`best_fit`); the least pending time when none is feasible (counted in
        /metrics). O(requests in flight): the checks need each request, not the replicas' sums."""
        now = self.clock()
        on: dict[int, list[RequestState]] = {s.replica_id: [] for s in self.slots}
        for st in self.requests.values():
            if st.slot is not None and st is not state:
                on[st.slot.replica_id].append(st)
        params = self.cost_params()
        replicas = [
            feasible_dispatch.SloReplica(
                self._view(s, tuple(st.load(self.output_lengths) for st in on[s.replica_id])),
                params.get(s.replica_id, CostParams()),
                {st.request.request_id: now - st.first_token_at for st in on[s.replica_id] if st.first_token_at},
            )
            for s in self.slots
            if s.serving
        ]
        load = state.load(self.output_lengths)
        assert self.slo_dispatch is not None  # called only in an SLO dispatch mode
        decision = feasible_dispatch.choose(
            replicas, load, lambda r: self.slo.slo_of(r.adapter, r.prompt_tokens), now, self.slo_dispatch
        )
        if not decision.feasible:
            self.counters["slo_infeasible_dispatches"] += 1
        return self.slot(decision.replica_id)

    def _assign(self, state: RequestState, slot: ReplicaSlot) -> ReplicaSlot:
        """Count the request on `slot` in the same step as the dispatch decision. Requests of a
        burst are dispatched each in its own task (the deadline's wait_for), so a request counted
        only when its stream opens would leave every other decision of the burst blind to it: all
        of them went to the same replica (56 of 64 base-model requests, on two replicas)."""
        state.slot, state.queued_since = slot, self.clock()
        self._recount(state)
        return slot

    async def _in_time(self, state: RequestState, aw):
        """Await `aw` within the request's deadline."""
        if state.deadline is None:
            return await aw
        left = state.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(0.0, left))
        except TimeoutError:
            raise self._timeout(state) from None

    def _timeout(self, state: RequestState) -> RequestTimeout:
        return RequestTimeout(
            f"request did not finish within its {self.cfg.request_timeout_s:g} s deadline "
            "(server.request_timeout_s); its work was stopped"
        )

    def _expire(self, state: RequestState) -> None:
        state.deadline = asyncio.get_running_loop().time()  # any later wait fails at once
        if state.leg is not None:
            state.leg.interrupt(self._timeout(state))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request's deltas; migrations and replica failures are hidden by resubmission."""
        if req.arrival_time is None:  # every leg carries it: a moved request keeps its place in line
            req = dataclasses.replace(req, arrival_time=time.time())
        while req.adapter is not None and req.adapter.int_id in self.superseded:
            req = dataclasses.replace(req, adapter=self.superseded[req.adapter.int_id])
        state = RequestState(req, arrival=self.clock(), migrate_to=preferred_replica.get())
        self.arrivals.append((state.arrival, state.adapter))
        self.arrivals_total += 1
        adapter = state.adapter or ""
        self.requests[req.request_id] = state
        self.inflight_by_adapter[adapter] += 1
        self.queue_times.start(req.request_id, state.adapter)
        timer = None
        if self.cfg.request_timeout_s is not None:
            loop = asyncio.get_running_loop()
            state.deadline = loop.time() + self.cfg.request_timeout_s
            timer = loop.call_at(state.deadline, self._expire, state)
        try:
            current = req
            while True:
                choosing = self.clock()
                slot = await self._in_time(state, self._choose(state))
                self.queue_times.router_wait(req.request_id, self.clock() - choosing)
                leg = self._run_on(slot, current, state)
                try:
                    async for delta in leg:
                        if delta.token_ids and state.first_token_at is None:
                            state.first_token_at = self.clock()
                        if delta.finished:  # before the yield: the client may close the stream on it
                            self._finished(state, delta)
                        yield delta
                        if delta.finished:
                            return
                    if not state.migrated:  # the stream ended without saying why: report, don't loop
                        yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
                        return
                    state.migrated = False
                    self.counters["migrations"] += 1
                except ReplicaFailure as e:
                    self._mark_failed(slot)
                    state.failures += 1
                    if state.failures > self.cfg.max_resubmissions:
                        log.warning("request %s: %s; failed %d times, giving up", req.request_id, e, state.failures)
                        self.counters["resubmission_limit"] += 1
                        raise ResubmissionLimit(f"request failed on {state.failures} replicas; giving up") from e
                    log.warning("request %s: %s; resubmitting after %d tokens", req.request_id, e, len(state.generated))
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
                    self._finished(state, done)
                    yield done
                    return
        finally:
            if timer is not None:
                timer.cancel()
            if state.slot is not None:  # assigned, but its stream never opened (deadline, cancel)
                state.slot = None
                self._recount(state)
            del self.requests[req.request_id]
            self.queue_times.finish(req.request_id)
            self.inflight_by_adapter[adapter] -= 1
            if self.inflight_by_adapter[adapter] <= 0:
                del self.inflight_by_adapter[adapter]

    def _finished(self, state: RequestState, delta: Delta) -> None:
        """Feed the output-length history and the SLO accounting: a request that ended by itself
        ("stop") or at its cap ("length", a lower bound of its length); aborted ones say nothing
        about their length, and their latency is not the service's."""
        if delta.finish_reason not in ("stop", "length"):
            return
        self.finished_total += 1
        self.finished_tokens_total += len(state.generated)
        self.output_lengths.observe(state.adapter, len(state.generated), ended=delta.finish_reason == "stop")
        if state.first_token_at is not None:
            self.slo.record(
                state.adapter,
                prompt_tokens=len(state.request.prompt_token_ids),
                ttft_s=state.first_token_at - state.arrival,
                latency_s=self.clock() - state.arrival,
                output_tokens=len(state.generated),
            )

    async def _run_on(self, slot: ReplicaSlot, req: GenerateRequest, state: RequestState) -> AsyncGenerator[Delta]:
        """Deltas from one replica; returns without a finished delta when the request was migrated."""
        state.slot, state.queued_since = slot, self.clock()  # its load counts on `slot` from now
        self._recount(state)
        lost = False
        try:
            if req.adapter is not None and req.adapter.int_id not in slot.loaded:
                await self._in_time(state, self._load(slot, req.adapter))
            if req.adapter is not None and slot.cache is not None:
                slot.cache.touch(req.adapter.int_id)
            if state.deadline is not None and asyncio.get_running_loop().time() >= state.deadline:
                raise self._timeout(state)
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
                self.output_tokens_total += len(delta.token_ids)
                self._recount(state)
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
            self._recount(state)
            self.queue_times.stream_ended(req.request_id, lost)
            self.on_leg_ended(slot.replica_id)

    def _sent(self, state: RequestState, engine_id: str) -> None:
        """The current leg goes to its replica as `engine_id`: it waits in that engine's queue until
        admitted, and from now on it can be moved (`migrate` aborts it by this id)."""
        state.engine_request_id, state.admitted, state.queued_since = engine_id, False, self.clock()
        state.preempted = False
        self._recount(state)
        slot = state.slot
        totals = None if slot is None else self.totals.get(slot.replica_id)
        if slot is not None and totals is not None and totals.requests <= 1:  # it reaches an idle engine
            slot.step_started_at = state.queued_since
        self.queue_times.sent(state.request.request_id, engine_id)
        self.on_leg_sent()

    def _admit(self, waits: tuple[tuple[str, float], ...]) -> None:
        """A replica reported these engine requests' queue waits: each left its waiting queue
        (admitted, or aborted, which ends its leg anyway). Reports of earlier legs match nothing."""
        if not waits:
            return
        legs = {st.engine_request_id: st for st in self.requests.values() if st.engine_request_id is not None}
        for engine_id, _ in waits:
            st = legs.get(engine_id)
            if st is not None and not st.admitted:
                st.admitted = True
                self._recount(st)

    def _mark_preempted(self, slot: ReplicaSlot, engine_ids: tuple[str, ...]) -> None:
        """The replica's preempted-and-waiting requests as of this read; a resumed one is running again."""
        preempted = set(engine_ids)
        for st in self.requests.values():
            if (
                st.slot is slot
                and st.engine_request_id is not None
                and st.preempted != (st.engine_request_id in preempted)
            ):
                st.preempted = not st.preempted
                self._recount(st)

    async def migrate(self, request_id: str, dst_replica_id: int) -> bool:
        """Move a request, queued or running, to another replica (abort here, continue there).

        Only a leg already sent to its replica can move: one still loading its adapter would miss
        the abort, run to its end where it is, and keep a stale `migrate_to` that blocks any later move.
        """
        state = self.requests.get(request_id)
        dst = self.find_slot(dst_replica_id)
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
            await self._call(slot, slot.replica.abort(state.engine_request_id))
        except ReplicaFailure as e:  # the request is resubmitted with the replica's others
            log.warning("replica %d failed an abort (%s); rebuilding it", slot.replica_id, e)
            self._mark_failed(slot)
        return True

    async def _read_stats(self, s: ReplicaSlot) -> ReplicaStats | None:
        """The replica's stats, or None: unhealthy, failed now, or busy (its read, still pending,
        is awaited again by the next refresh instead of being asked twice)."""
        if not s.healthy:
            return None
        loop = asyncio.get_running_loop()
        if s.stats_call is None or s.stats_call.done():
            s.stats_call, s.stats_asked_at = asyncio.ensure_future(s.replica.stats()), loop.time()
        try:
            return await asyncio.wait_for(asyncio.shield(s.stats_call), self.cfg.actor_call_timeout_s)
        except TimeoutError:
            try:
                await self._check_alive(s, s.stats_asked_at)
            except ReplicaFailure as e:
                self._stats_failed(s, e)
        except ReplicaFailure as e:  # e.g. Ray restarted the actor: rebuild it before a request finds out
            self._stats_failed(s, e)
        except Exception as e:
            log.warning("replica %d: stats read failed: %s", s.replica_id, e)
        return None

    def _stats_failed(self, s: ReplicaSlot, e: ReplicaFailure) -> None:
        log.warning("replica %d failed its stats read (%s); rebuilding it", s.replica_id, e)
        self._mark_failed(s)

    async def refresh_stats(self) -> list[ReplicaStats]:
        """Read every replica's stats (at once: a hung one costs one deadline, not one per replica)
        and feed them to the scheduling state. The balancer's loop calls this; /metrics only reads
        what it stored (`reported_stats`)."""
        out = []
        slots = list(self.slots)  # a replica added or removed meanwhile is read next time
        for s, st in zip(slots, await asyncio.gather(*(self._read_stats(s) for s in slots))):
            if st is None and s.healthy and s.replica_id in self.reported:
                out.append(self.reported[s.replica_id])  # busy: its last report stands until the read answers
                continue
            st = st or ReplicaStats(replica_id=s.replica_id, num_unfinished=0, healthy=False)
            s.last_stats = st if st.healthy else s.last_stats
            if s not in self.slots:
                continue  # removed while its stats were read
            if st.batching is not None:
                self._observe_iterations(s.replica_id, st.batching.iterations)
                self._admit(st.batching.queue_waits)
                self._mark_preempted(s, st.batching.preempted)
                self.queue_times.report(st.batching.queue_waits)
            self.reported[s.replica_id] = st
            out.append(st)
        self.queue_times.expire()
        self.slo.basis = self._isolated_basis()  # the cost models were refitted from these steps
        self.counters["stats_reads"] += 1
        return out

    def reported_stats(self) -> list[ReplicaStats]:
        """Each replica's stats as last read by `refresh_stats`, marked unhealthy where the replica
        is down now. No replica call: a scrape must answer whatever the replicas do."""
        out = []
        for s in self.slots:
            st = self.reported.get(s.replica_id) or ReplicaStats(
                replica_id=s.replica_id, num_unfinished=0, healthy=False
            )
            out.append(st if s.healthy else dataclasses.replace(st, healthy=False))
        return out

    def _observe_iterations(self, replica_id: int, iterations) -> None:
        self.cost_models[replica_id].observe(*(IterationSample(*step) for step in iterations))
