"""The router: picks a replica for each request, owns its token state, moves it when told to.

NOTE on the request life cycle: the router keeps the prompt ids and every token id received. A
request leaves its replica in two ways, and both continue the same way — it is resubmitted to
another replica as `prompt + generated` with `max_tokens` reduced by what was generated, so the
client's stream goes on with no duplicated or missing tokens:
  * migration: the balancer sets `migrate_to` and aborts the request on its replica; the engine
    ends the stream with finish_reason "abort", which the router swallows;
  * failure: the replica's actor died or restarted, or its engine died (`ReplicaFailure`); the
    replica is rebuilt in the background and its pinned adapters are loaded again.
Replicas are chosen by a dispatch policy (dlora/cluster/dispatch.py) over `ReplicaView`s that the
router builds from its own request table and the replicas' last reported stats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from dlora.cluster.cost_model import CostParams, ReplicaCostModel
from dlora.cluster.dispatch import make_dispatch_policy
from dlora.cluster.monitor_types import IterationSample, ReplicaView, RequestLoad
from dlora.cluster.output_lengths import OutputLengthConfig, OutputLengthEstimator
from dlora.cluster.queue_time import QueueTimes
from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, ReplicaStats

log = logging.getLogger(__name__)

RECOVERY_TIMEOUT_S = 300.0


class Replica(Protocol):
    replica_id: int

    async def start(self) -> None: ...
    def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]: ...
    async def abort(self, request_id: str) -> None: ...
    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None: ...
    async def remove_adapter(self, int_id: int) -> bool: ...
    async def stats(self) -> ReplicaStats: ...
    async def shutdown(self) -> None: ...


def static_home(adapter_id: int, num_replicas: int) -> int:
    """Static placement: the one replica an adapter lives on (by its registry id)."""
    return adapter_id % num_replicas


class NoReplicaError(RuntimeError):
    """No replica came back within the recovery timeout."""


@dataclass
class ReplicaSlot:
    replica: Replica
    healthy: bool = False
    loaded: dict[int, str] = field(default_factory=dict)  # adapter id -> name (engine LRU may evict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: asyncio.Task | None = None
    restarts: int = 0
    last_stats: ReplicaStats | None = None

    @property
    def replica_id(self) -> int:
        return self.replica.replica_id


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

    @property
    def adapter(self) -> str | None:
        return self.request.adapter.name if self.request.adapter else None

    def continuation(self) -> GenerateRequest:
        """The request to send after a move: the prompt grows by what was generated."""
        s = self.request.sampling
        n = len(self.generated)
        sampling = dataclasses.replace(s, max_tokens=s.max_tokens - n, min_tokens=max(0, s.min_tokens - n))
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
            request_id=self.request.request_id, adapter=self.adapter,
            prompt_tokens=len(self.request.prompt_token_ids), output_tokens=n,
            expected_output_tokens=expected, running=self.admitted and not self.preempted,
            queued_since=self.queued_since, arrival=self.arrival,
        )


@dataclass(frozen=True)
class RouterConfig:
    dispatch: str = "proactive"
    # static: each adapter lives on one replica (id mod N) and only goes there — the baseline
    # placement dLoRA compares against; dynamic: any replica, adapters loaded where needed.
    static_placement: bool = False
    adapter_slots: int = 4  # adapters one replica may hold at once (vLLM max_cpu_loras)
    batch_adapter_slots: int = 1 << 20  # distinct adapters in one engine step (vLLM max_loras)
    kv_capacity_tokens: int = 1 << 17  # per replica until its engine's stats report the real one
    max_batch: int = 64  # requests one engine step may run (vLLM max_num_seqs)
    # Output lengths the balancer expects (dispatch, migration): per-adapter history of finished requests.
    output_lengths: OutputLengthConfig = field(default_factory=OutputLengthConfig)


class Router:
    def __init__(self, replicas: list[Replica], pinned_adapters: Callable[[], list[AdapterRef]] = list,
                 cfg: RouterConfig | None = None, clock: Callable[[], float] = time.monotonic):
        self.slots = [ReplicaSlot(r) for r in replicas]
        self.cfg = cfg or RouterConfig()
        self.dispatcher = make_dispatch_policy(self.cfg.dispatch)
        self.clock = clock
        # Returns the AdapterRefs that must be resident on every replica (pinned ones).
        self._pinned_adapters = pinned_adapters
        self.requests: dict[str, RequestState] = {}
        self.inflight_by_adapter: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()  # resubmissions, migrations, ...
        self.arrivals: deque[tuple[float, str | None]] = deque(maxlen=100_000)  # (time, adapter) for rates
        self._loading: dict[tuple[int, int], asyncio.Future] = {}
        # Fitted from each replica's measured steps (refresh_stats); kept across restarts (same hardware).
        self.cost_models = {s.replica_id: ReplicaCostModel(CostParams(max_batch=self.cfg.max_batch)) for s in self.slots}
        # Lengths of finished requests per adapter: what dispatch and migration expect instead of max_tokens.
        self.output_lengths = OutputLengthEstimator(self.cfg.output_lengths)
        # Each request's queueing delay, from the replicas' measurements (set its observer for /metrics).
        self.queue_times = QueueTimes(clock)

    # ---- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self._start_slot(s) for s in self.slots))

    async def _start_slot(self, slot: ReplicaSlot) -> None:
        t0 = time.monotonic()
        await slot.replica.start()
        slot.loaded.clear()
        for ref in self._pinned_adapters():
            if not self.cfg.static_placement or self.home(ref) is slot:
                await self._load(slot, ref, pinned=True)
        slot.healthy = True
        slot.ready.set()
        log.info("replica %d ready in %.1f s", slot.replica_id, time.monotonic() - t0)

    async def shutdown(self) -> None:
        for s in self.slots:
            if s.recovering:
                s.recovering.cancel()
        await asyncio.gather(*(s.replica.shutdown() for s in self.slots), return_exceptions=True)

    def slot(self, replica_id: int) -> ReplicaSlot:
        return next(s for s in self.slots if s.replica_id == replica_id)

    def _mark_failed(self, slot: ReplicaSlot) -> None:
        if slot.recovering:
            return
        slot.healthy = False
        slot.ready.clear()
        slot.recovering = asyncio.create_task(self._recover(slot))

    async def _recover(self, slot: ReplicaSlot) -> None:
        delay = 1.0
        while True:
            try:
                await self._start_slot(slot)
                slot.restarts += 1
                slot.recovering = None
                return
            except Exception as e:  # keep trying: Ray may still be restarting the actor process
                log.warning("replica %d restart failed (%s); retrying in %.0f s", slot.replica_id, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)

    # ---- adapters ---------------------------------------------------------------------------
    async def _load(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool = False) -> None:
        """Load once per (replica, adapter) even when many requests ask at the same time."""
        key = (slot.replica_id, ref.int_id)
        fut = self._loading.get(key)
        if fut is None:
            fut = asyncio.ensure_future(slot.replica.add_adapter(ref, pinned))
            self._loading[key] = fut
            fut.add_done_callback(lambda _: self._loading.pop(key, None))
        await asyncio.shield(fut)
        slot.loaded[ref.int_id] = ref.name

    async def load_on(self, replica_id: int, ref: AdapterRef) -> None:
        await self._load(self.slot(replica_id), ref)

    def home(self, ref: AdapterRef) -> ReplicaSlot:
        """The adapter's replica under static placement."""
        return self.slots[static_home(ref.int_id, len(self.slots))]

    async def load_everywhere(self, ref: AdapterRef, pinned: bool = False) -> None:
        """Load on every healthy replica (its home only, under static placement); raises the first
        engine error, so nothing is half-registered."""
        targets = [self.home(ref)] if self.cfg.static_placement else [s for s in self.slots if s.healthy]
        await asyncio.gather(*(self._load(s, ref, pinned) for s in targets))

    async def unload_everywhere(self, int_id: int) -> None:
        for s in self.slots:
            if s.healthy and int_id in s.loaded:
                await s.replica.remove_adapter(int_id)
            s.loaded.pop(int_id, None)

    # ---- views for the balancer -------------------------------------------------------------
    def views(self) -> list[ReplicaView]:
        by_slot: dict[int, list[RequestLoad]] = {s.replica_id: [] for s in self.slots}
        for st in self.requests.values():
            if st.slot is not None:
                by_slot[st.slot.replica_id].append(st.load(self.output_lengths))
        return [self._view(s, tuple(by_slot[s.replica_id])) for s in self.slots]

    def _view(self, slot: ReplicaSlot, requests: tuple[RequestLoad, ...]) -> ReplicaView:
        batching = slot.last_stats.batching if slot.last_stats else None
        return ReplicaView(
            replica_id=slot.replica_id, requests=requests, resident_adapters=frozenset(slot.loaded.values()),
            merged_adapter=batching.merged_adapter if batching else None,
            kv_usage=batching.kv_usage if batching else None,
            kv_capacity_tokens=(batching.kv_capacity_tokens if batching and batching.kv_capacity_tokens
                                else self.cfg.kv_capacity_tokens),
            adapter_slots=self.cfg.adapter_slots,
            batch_adapter_slots=self.cfg.batch_adapter_slots, max_running=self.cfg.max_batch,
            healthy=slot.healthy,
        )

    def adapter_rates(self, window_s: float) -> dict[str, float]:
        """Requests per second per adapter over the last `window_s` seconds."""
        since = self.clock() - window_s
        counts = Counter(a for t, a in self.arrivals if t >= since and a is not None)
        return {a: n / window_s for a, n in counts.items()}

    def cost_params(self) -> dict[int, CostParams]:
        return {rid: model.params for rid, model in self.cost_models.items()}

    # ---- requests ---------------------------------------------------------------------------
    async def _wait_for_any_replica(self) -> None:
        waiters = [asyncio.ensure_future(s.ready.wait()) for s in self.slots]
        try:
            await asyncio.wait(waiters, timeout=RECOVERY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        if not any(s.healthy for s in self.slots):
            raise NoReplicaError(f"no replica recovered within {RECOVERY_TIMEOUT_S:.0f} s")

    async def _choose(self, state: RequestState) -> ReplicaSlot:
        if not any(s.healthy for s in self.slots):
            await self._wait_for_any_replica()
        if state.migrate_to is not None:
            target = self.slot(state.migrate_to)
            state.migrate_to = None
            if target.healthy:
                return target
        if self.cfg.static_placement and state.request.adapter is not None:
            home = self.home(state.request.adapter)
            if not home.healthy:
                await home.ready.wait()
            return home
        healthy = [v for v in self.views() if v.healthy]
        decision = self.dispatcher.choose(healthy, state.load(self.output_lengths), self.cost_params())
        return self.slot(decision.replica_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request's deltas; migrations and replica failures are hidden by resubmission."""
        if req.arrival_time is None:  # every leg carries it: a moved request keeps its place in line
            req = dataclasses.replace(req, arrival_time=time.time())
        state = RequestState(req, arrival=self.clock())
        self.arrivals.append((state.arrival, state.adapter))
        adapter = state.adapter or ""
        self.requests[req.request_id] = state
        self.inflight_by_adapter[adapter] += 1
        self.queue_times.start(req.request_id, state.adapter)
        try:
            current = req
            while True:
                choosing = self.clock()
                slot = await self._choose(state)
                self.queue_times.router_wait(req.request_id, self.clock() - choosing)
                try:
                    async for delta in self._run_on(slot, current, state):
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
                    log.warning("request %s: %s; resubmitting after %d tokens", req.request_id, e, len(state.generated))
                    self._mark_failed(slot)
                    self.counters["resubmissions"] += 1
                state.resubmissions += 1
                current = state.continuation()
                if current.sampling.max_tokens <= 0:
                    done = Delta(token_ids=[], text="", finished=True, finish_reason="length")
                    self._finished(state, done)
                    yield done
                    return
        finally:
            del self.requests[req.request_id]
            self.queue_times.finish(req.request_id)
            self.inflight_by_adapter[adapter] -= 1
            if self.inflight_by_adapter[adapter] <= 0:
                del self.inflight_by_adapter[adapter]

    def _finished(self, state: RequestState, delta: Delta) -> None:
        """Feed the output-length history: a request that ended by itself ("stop") or at its cap
        ("length", a lower bound of its length); aborted ones say nothing about their length."""
        if delta.finish_reason in ("stop", "length"):
            self.output_lengths.observe(state.adapter, len(state.generated))

    async def _run_on(self, slot: ReplicaSlot, req: GenerateRequest, state: RequestState) -> AsyncIterator[Delta]:
        """Deltas from one replica; returns without a finished delta when the request was migrated."""
        state.slot, state.queued_since = slot, self.clock()  # its load counts on `slot` from now
        lost = False
        try:
            if req.adapter is not None and req.adapter.int_id not in slot.loaded:
                await self._load(slot, req.adapter)
            self._sent(state, req.request_id)
            first = True
            async for delta in slot.replica.generate(req):
                if first and delta.token_ids:
                    first = False
                    state.admitted = True
                    self.queue_times.first_token(req.request_id)
                state.generated.extend(delta.token_ids)
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
            # Between legs the request is on no replica: the next one is priced with its re-prefill.
            state.slot, state.engine_request_id, state.admitted, state.preempted = None, None, False, False
            self.queue_times.stream_ended(req.request_id, lost)

    def _sent(self, state: RequestState, engine_id: str) -> None:
        """The current leg goes to its replica as `engine_id`: it waits in that engine's queue until
        admitted, and from now on it can be moved (`migrate` aborts it by this id)."""
        state.engine_request_id, state.admitted, state.queued_since = engine_id, False, self.clock()
        state.preempted = False
        self.queue_times.sent(state.request.request_id, engine_id)

    def _admit(self, waits: tuple[tuple[str, float], ...]) -> None:
        """A replica reported these engine requests' queue waits: each left its waiting queue
        (admitted, or aborted, which ends its leg anyway). Reports of earlier legs match nothing."""
        if not waits:
            return
        legs = {st.engine_request_id: st for st in self.requests.values() if st.engine_request_id is not None}
        for engine_id, _ in waits:
            if engine_id in legs:
                legs[engine_id].admitted = True

    def _mark_preempted(self, slot: ReplicaSlot, engine_ids: tuple[str, ...]) -> None:
        """The replica's preempted-and-waiting requests as of this read; a resumed one is running again."""
        preempted = set(engine_ids)
        for st in self.requests.values():
            if st.slot is slot and st.engine_request_id is not None:
                st.preempted = st.engine_request_id in preempted

    async def migrate(self, request_id: str, dst_replica_id: int) -> bool:
        """Move a request, queued or running, to another replica (abort here, continue there).

        Only a leg already sent to its replica can move: one still loading its adapter would miss
        the abort, run to its end where it is, and keep a stale `migrate_to` that blocks any later move.
        """
        state = self.requests.get(request_id)
        if (state is None or state.slot is None or state.engine_request_id is None or state.migrate_to is not None
                or state.slot.replica_id == dst_replica_id or not self.slot(dst_replica_id).healthy):
            return False
        state.migrate_to = dst_replica_id
        await state.slot.replica.abort(state.engine_request_id)
        return True

    async def refresh_stats(self) -> list[ReplicaStats]:
        out = []
        for s in self.slots:
            st = None
            if s.healthy:
                try:
                    st = await s.replica.stats()
                except ReplicaFailure as e:  # e.g. Ray restarted the actor: rebuild it before a request finds out
                    log.warning("replica %d failed its stats read (%s); rebuilding it", s.replica_id, e)
                    self._mark_failed(s)
                except Exception:
                    st = None
            st = st or ReplicaStats(replica_id=s.replica_id, num_unfinished=0, healthy=False)
            s.last_stats = st if st.healthy else s.last_stats
            if st.batching is not None:
                self._observe_iterations(s.replica_id, st.batching.iterations)
                self._admit(st.batching.queue_waits)
                self._mark_preempted(s, st.batching.preempted)
                self.queue_times.report(st.batching.queue_waits)
            out.append(st)
        self.queue_times.expire()
        return out

    def _observe_iterations(self, replica_id: int, iterations) -> None:
        self.cost_models[replica_id].observe(*(IterationSample(*step) for step in iterations))

    async def replica_stats(self) -> list[ReplicaStats]:
        return await self.refresh_stats()
