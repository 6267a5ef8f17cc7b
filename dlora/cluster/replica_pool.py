"""The router's replicas: starting them, calls with deadlines, failure detection and rebuilds.

A call that misses its deadline (`actor_call_timeout_s`) is followed by a ping that does not wait
for the engine: a replica that answers it is slow (a long engine step), not dead, and is waited for
up to `replica_stall_timeout_s`; one that does not, or that leaves a call unanswered that long, has
failed. A failed replica is rebuilt in the background (its pinned adapters loaded again by the
`prepare` hook); one that fails `max_restart_attempts` rebuilds in a row is given up
(`ReplicaSlot.gave_up`) and retried only every `GAVE_UP_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from dlora.cluster.errors import NoReplicaError
from dlora.cluster.host_cache import HostCache
from dlora.cluster.replica_slot import Replica, ReplicaSlot
from dlora.cluster.router_config import RouterConfig
from dlora.replica.errors import ReplicaFailure
from dlora.replica.model_manifest import ModelMismatch

log = logging.getLogger(__name__)

# A replica that gave up rebuilding is tried again this rarely: a lasting fault (a bad model
# path, a node out of memory) must not spin, a passing one may still heal.
GAVE_UP_RETRY_S = 60.0


async def _nothing(slot: ReplicaSlot) -> None:
    return None


class ReplicaPool:
    def __init__(self, replicas: list[Replica], cfg: RouterConfig, counters: Counter[str]) -> None:
        self.cfg = cfg
        self.counters = counters
        self.slots = [ReplicaSlot(r, cache=self.new_cache()) for r in replicas]
        self.next_replica_id = 1 + max((r.replica_id for r in replicas), default=-1)
        # Run on a started engine before it serves: the router loads its pinned adapters there.
        self.prepare: Callable[[ReplicaSlot], Awaitable[None]] = _nothing
        # A replica failed: the router ends the streams still open on it.
        self.on_failed: Callable[[ReplicaSlot], None] = lambda slot: None

    def new_cache(self) -> HostCache | None:
        if self.cfg.host_cache_bytes is None:
            return None
        return HostCache(self.cfg.host_cache_bytes, max_entries=self.cfg.adapter_slots)

    def slot(self, replica_id: int) -> ReplicaSlot:
        return next(s for s in self.slots if s.replica_id == replica_id)

    def find_slot(self, replica_id: int) -> ReplicaSlot | None:
        """The replica's slot, None once it was removed (`Router.drain`)."""
        return next((s for s in self.slots if s.replica_id == replica_id), None)

    def serving_ids(self) -> list[int]:
        return [s.replica_id for s in self.slots if s.serving]

    def any_serving(self, besides: ReplicaSlot | None = None) -> bool:
        return any(s.serving for s in self.slots if s is not besides)

    def may_serve_soon(self) -> bool:
        """Whether a replica serves or is being rebuilt with rebuilds still succeeding: false only
        when every replica has been given up (or none is left)."""
        return any(not s.gave_up for s in self.slots)

    def reserve_id(self) -> int:
        """An id no replica has had, for a replica about to be made."""
        rid = self.next_replica_id
        self.next_replica_id += 1
        return rid

    def add(self, slot: ReplicaSlot) -> None:
        self.next_replica_id = max(self.next_replica_id, slot.replica_id + 1)
        self.slots.append(slot)

    def remove(self, slot: ReplicaSlot) -> None:
        if slot in self.slots:
            self.slots.remove(slot)

    # ---- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every replica. One whose node lacks the model directory (ModelMismatch) is left to
        its rebuilds, which give up after `max_restart_attempts`, while the others serve; any other
        failure, or every replica refusing, fails the start."""
        results = await asyncio.gather(*(self.start_slot(s) for s in self.slots), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ModelMismatch):
                raise r
        refused = [(s, r) for s, r in zip(self.slots, results) if isinstance(r, ModelMismatch)]
        if refused and len(refused) == len(self.slots):
            raise refused[0][1]
        for slot, e in refused:
            log.error("replica %d did not start: %s", slot.replica_id, e)
            self.mark_failed(slot)

    async def start_slot(self, slot: ReplicaSlot) -> None:
        t0 = time.monotonic()
        await self.call(slot, slot.replica.start(), self.cfg.replica_start_timeout_s)
        slot.loaded.clear()
        slot.unavailable.clear()  # maybe on another node now; a new try per adapter
        if slot.cache is not None:
            slot.cache.clear()
        await self.prepare(slot)
        slot.healthy = True
        slot.ready.set()
        log.info("replica %d ready in %.1f s", slot.replica_id, time.monotonic() - t0)

    async def shutdown(self) -> None:
        slots = list(self.slots)
        for s in slots:
            if s.recovering:
                s.recovering.cancel()
        await asyncio.gather(*(s.replica.shutdown() for s in slots), return_exceptions=True)

    async def wait_for(self, slots: list[ReplicaSlot]) -> None:
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

    # ---- calls and failures -----------------------------------------------------------------
    async def call(self, slot: ReplicaSlot, call, timeout_s: float | None = None):
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
                    await self.check_alive(slot, asked_at)
        finally:
            task.cancel()  # a no-op once it is done

    async def check_alive(self, slot: ReplicaSlot, asked_at: float) -> None:
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

    def mark_failed(self, slot: ReplicaSlot) -> None:
        if slot.stats_call is not None:  # asked of the failed engine: the rebuilt one is asked afresh
            slot.stats_call.cancel()
        if slot.recovering or (slot.draining and not slot.healthy):
            return
        slot.healthy = False
        slot.ready.clear()
        if not slot.draining:  # a draining replica is on its way out: its requests fail over, no rebuild
            slot.recovering = asyncio.create_task(self._recover(slot))
        # Streams still open there may wait forever on a hung engine: move them now.
        self.on_failed(slot)

    async def _recover(self, slot: ReplicaSlot) -> None:
        delay = 1.0
        while True:
            try:
                await self.start_slot(slot)
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
