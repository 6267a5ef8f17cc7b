"""The router: picks a replica for each request, owns its token state, survives replica failures.

NOTE on the request life cycle: the router keeps the prompt ids and every token id received. If
the replica fails mid-stream (actor died, restarted, or its engine died), the request is resubmitted
to a healthy replica as `prompt + generated` with `max_tokens` reduced by what was generated, so the
client's stream continues with no duplicated or missing tokens. The failed replica is rebuilt in the
background and its adapters are loaded again before it takes new work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, ReplicaStats

log = logging.getLogger(__name__)

RECOVERY_TIMEOUT_S = 300.0


class Replica(Protocol):
    replica_id: int

    async def start(self) -> None: ...
    def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]: ...
    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None: ...
    async def remove_adapter(self, int_id: int) -> bool: ...
    async def stats(self) -> ReplicaStats: ...
    async def shutdown(self) -> None: ...


class NoReplicaError(RuntimeError):
    """No replica came back within the recovery timeout."""


@dataclass
class ReplicaSlot:
    replica: Replica
    healthy: bool = False
    inflight: int = 0
    loaded: set[int] = field(default_factory=set)  # adapter ids added (engine LRU may still evict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    recovering: asyncio.Task | None = None
    restarts: int = 0


@dataclass
class RequestState:
    request: GenerateRequest
    generated: list[int] = field(default_factory=list)
    resubmissions: int = 0

    def continuation(self) -> GenerateRequest:
        """The request to send after a failure: the prompt grows by what was generated."""
        s = self.request.sampling
        sampling = dataclasses.replace(
            s, max_tokens=s.max_tokens - len(self.generated), min_tokens=max(0, s.min_tokens - len(self.generated))
        )
        return dataclasses.replace(
            self.request,
            request_id=f"{self.request.request_id}-r{self.resubmissions}",
            prompt_token_ids=tuple(self.request.prompt_token_ids) + tuple(self.generated),
            sampling=sampling,
        )


class Router:
    def __init__(self, replicas: list[Replica], pinned_adapters: callable = lambda: []):
        self.slots = [ReplicaSlot(r) for r in replicas]
        # Returns the AdapterRefs that must be resident on every replica (pinned ones).
        self._pinned_adapters = pinned_adapters
        self.inflight_by_adapter: Counter[str] = Counter()
        self._loading: dict[tuple[int, int], asyncio.Task] = {}

    # ---- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(self._start_slot(s) for s in self.slots))

    async def _start_slot(self, slot: ReplicaSlot) -> None:
        t0 = time.monotonic()
        await slot.replica.start()
        slot.loaded.clear()
        for ref in self._pinned_adapters():
            await self._load(slot, ref, pinned=True)
        slot.healthy = True
        slot.ready.set()
        log.info("replica %d ready in %.1f s", slot.replica.replica_id, time.monotonic() - t0)

    async def shutdown(self) -> None:
        for s in self.slots:
            if s.recovering:
                s.recovering.cancel()
        await asyncio.gather(*(s.replica.shutdown() for s in self.slots), return_exceptions=True)

    def _mark_failed(self, slot: ReplicaSlot) -> None:
        if not slot.healthy and slot.recovering:
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
                log.warning("replica %d restart failed (%s); retrying in %.0f s", slot.replica.replica_id, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)

    # ---- adapters ---------------------------------------------------------------------------
    async def _load(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool = False) -> None:
        key = (slot.replica.replica_id, ref.int_id)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.ensure_future(slot.replica.add_adapter(ref, pinned))
            self._loading[key] = task
        try:
            await asyncio.shield(task)
            slot.loaded.add(ref.int_id)
        finally:
            if task.done():
                self._loading.pop(key, None)

    async def load_everywhere(self, ref: AdapterRef, pinned: bool = False) -> None:
        """Load on every healthy replica; raises the first engine error (nothing half-registered)."""
        await asyncio.gather(*(self._load(s, ref, pinned) for s in self.slots if s.healthy))

    async def unload_everywhere(self, int_id: int) -> None:
        for s in self.slots:
            if s.healthy and int_id in s.loaded:
                await s.replica.remove_adapter(int_id)
            s.loaded.discard(int_id)

    # ---- requests ---------------------------------------------------------------------------
    async def _pick(self) -> ReplicaSlot:
        healthy = [s for s in self.slots if s.healthy]
        if not healthy:
            waiters = [asyncio.ensure_future(s.ready.wait()) for s in self.slots]
            try:
                done, _ = await asyncio.wait(waiters, timeout=RECOVERY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            healthy = [s for s in self.slots if s.healthy]
            if not healthy:
                raise NoReplicaError(f"no replica recovered within {RECOVERY_TIMEOUT_S:.0f} s")
        return min(healthy, key=lambda s: s.inflight)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request's deltas; replica failures are hidden by resubmission."""
        from dlora.replica.ray_replica import ReplicaFailure

        state = RequestState(req)
        adapter = req.adapter.name if req.adapter else ""
        self.inflight_by_adapter[adapter] += 1
        try:
            current = req
            while True:
                slot = await self._pick()
                try:
                    async for delta in self._run_on(slot, current, state):
                        yield delta
                    return
                except ReplicaFailure as e:
                    log.warning("request %s: %s; resubmitting after %d tokens", req.request_id, e, len(state.generated))
                    self._mark_failed(slot)
                    state.resubmissions += 1
                    current = state.continuation()
                    if current.sampling.max_tokens <= 0:
                        yield Delta(token_ids=[], text="", finished=True, finish_reason="length")
                        return
        finally:
            self.inflight_by_adapter[adapter] -= 1
            if self.inflight_by_adapter[adapter] <= 0:
                del self.inflight_by_adapter[adapter]

    async def _run_on(self, slot: ReplicaSlot, req: GenerateRequest, state: RequestState) -> AsyncIterator[Delta]:
        slot.inflight += 1
        try:
            if req.adapter is not None and req.adapter.int_id not in slot.loaded:
                await self._load(slot, req.adapter)
            async for delta in slot.replica.generate(req):
                state.generated.extend(delta.token_ids)
                yield delta
        finally:
            slot.inflight -= 1

    async def replica_stats(self) -> list[ReplicaStats]:
        out = []
        for s in self.slots:
            if not s.healthy:
                out.append(ReplicaStats(replica_id=s.replica.replica_id, num_unfinished=0, healthy=False))
                continue
            try:
                out.append(await s.replica.stats())
            except Exception:
                out.append(ReplicaStats(replica_id=s.replica.replica_id, num_unfinished=0, healthy=False))
        return out
