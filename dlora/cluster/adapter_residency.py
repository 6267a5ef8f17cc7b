"""Which adapter is loaded on which replica: loads (once per replica and adapter, however many
requests ask), the unloads a host cache counted in bytes needs first, where a new adapter starts
out, and the versions an in-place update replaced."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dlora.cluster.replica_pool import ReplicaPool
from dlora.cluster.replica_slot import ReplicaSlot
from dlora.cluster.request_table import RequestTable
from dlora.cluster.router_config import RouterConfig
from dlora.cluster.router_counters import RouterCounters
from dlora.replica.errors import AdapterUnavailable, ReplicaFailure
from dlora.replica.messages import AdapterRef, ReplicaStats

log = logging.getLogger(__name__)


def static_home(adapter_id: int, num_replicas: int) -> int:
    """Static placement: the one replica an adapter lives on (by its registry id)."""
    return adapter_id % num_replicas


class AdapterResidency:
    def __init__(
        self,
        cfg: RouterConfig,
        pool: ReplicaPool,
        table: RequestTable,
        tally: RouterCounters,
        pinned_adapters: Callable[[], list[AdapterRef]],
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.table = table
        self.tally = tally
        # Returns the AdapterRefs that must be resident on every replica (pinned ones).
        self.pinned_adapters = pinned_adapters
        self._loading: dict[tuple[int, int], asyncio.Future] = {}
        self.sizes: dict[int, int] = {}  # adapter id -> bytes, of every version loaded somewhere
        # Adapter versions replaced in place (old int_id -> the version that replaced it): a request
        # that took an old version before the update is sent on the new one (AdapterManager._retire).
        self.superseded: dict[int, AdapterRef] = {}

    def supersede(self, old_int_id: int, new: AdapterRef) -> None:
        """An in-place update replaced version `old_int_id` by `new`: requests that took the old one go to `new`."""
        self.superseded[old_int_id] = new

    def current(self, ref: AdapterRef) -> AdapterRef:
        """The version a request that took `ref` runs on: the newest that replaced it."""
        while ref.int_id in self.superseded:
            ref = self.superseded[ref.int_id]
        return ref

    async def load_pinned(self, slot: ReplicaSlot) -> None:
        """A started engine's pinned adapters (under static placement, those whose home it is)."""
        for ref in self.pinned_adapters():
            if not self.cfg.static_placement or self.home(ref) is slot:
                try:
                    await self.load(slot, ref, pinned=True)
                except AdapterUnavailable as e:  # its requests go to other replicas; this one serves the rest
                    log.warning("replica %d: %s", slot.replica_id, e)

    async def load(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool = False) -> None:
        """Load once per (replica, adapter) even when many requests ask at the same time."""
        key = (slot.replica_id, ref.int_id)
        fut = self._loading.get(key)
        if fut is None:
            fut = asyncio.ensure_future(self._add(slot, ref, pinned))
            self._loading[key] = fut
            fut.add_done_callback(lambda _: self._loading.pop(key, None))
        try:
            await asyncio.shield(fut)
        except AdapterUnavailable:
            slot.unavailable.add(ref.int_id)  # not sent there again until the replica restarts
            raise
        slot.loaded[ref.int_id] = ref.name
        self.sizes[ref.int_id] = ref.size_bytes

    async def _add(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool) -> None:
        """The engine load; with a host cache in bytes, first the unloads that make room for it."""
        if slot.cache is None:
            await self._timed_add(slot, ref, pinned)
            return
        async with slot.cache_lock:
            victims = slot.cache.admit(ref.int_id, ref.size_bytes, pinned, self.table.in_use_on(slot))
            for int_id in victims:  # at once: a request for one of them from now on loads it again
                slot.loaded.pop(int_id, None)
            try:
                for int_id in victims:
                    log.info("replica %d: unloading adapter %d to make room for %s", slot.replica_id, int_id, ref.name)
                    await self.pool.call(slot, slot.replica.remove_adapter(int_id))
                await self._timed_add(slot, ref, pinned)
            except BaseException:
                slot.cache.discard(ref.int_id)
                raise

    async def _timed_add(self, slot: ReplicaSlot, ref: AdapterRef, pinned: bool) -> None:
        """The replica's add_adapter, its duration priced into dispatch (the replica's load time)."""
        t0 = time.monotonic()
        await self.pool.call(slot, slot.replica.add_adapter(ref, pinned))
        self.tally.observe_load(slot.replica_id, time.monotonic() - t0)

    async def load_on(self, replica_id: int, ref: AdapterRef) -> None:
        await self.load(self.pool.slot(replica_id), ref)

    async def place(self, ref: AdapterRef, pinned: bool = False, replacing: int | None = None) -> list[int]:
        """Load a newly registered adapter (or version) where it starts out; returns those replicas.

        Pinned adapters go to every healthy replica, and under static placement to the adapter's
        home, as `load_everywhere`. An unpinned one goes to one replica: this load is the engine's
        acceptance check, and every other copy comes with demand (a request dispatched to a replica
        without it, the balancer's preloads). A new version (`replacing` the old one's id) goes
        wherever the old version is loaded. Raises the first engine error."""
        if pinned or self.cfg.static_placement:
            await self.load_everywhere(ref, pinned)
            return [self.home(ref).replica_id] if self.cfg.static_placement else self.pool.serving_ids()
        healthy = [s for s in self.pool.slots if s.serving]
        if not healthy:
            return []  # nothing to check it on: the first request loads it
        if healthy[0].cache is not None:
            healthy[0].cache.check_fits(ref.size_bytes)
        targets = [s for s in healthy if replacing is not None and replacing in s.loaded]
        if targets:
            await self._load_where_possible(targets, ref)
            return [s.replica_id for s in targets if ref.int_id not in s.unavailable]
        last: AdapterUnavailable | None = None
        for slot in sorted(healthy, key=self._room_order):  # the roomiest that can get its files
            try:
                await self.load(slot, ref)
                return [slot.replica_id]
            except AdapterUnavailable as e:
                log.warning("replica %d: %s; trying another replica", slot.replica_id, e)
                last = e
        assert last is not None
        raise last  # no serving replica could get its files

    @staticmethod
    def _room_order(s: ReplicaSlot) -> tuple[int, int, int]:
        """The most free host-cache bytes first, then the fewest adapters loaded."""
        return (-s.cache.free_bytes if s.cache else 0, len(s.loaded), s.replica_id)

    def home(self, ref: AdapterRef) -> ReplicaSlot:
        """The adapter's replica under static placement."""
        return self.pool.slots[static_home(ref.int_id, len(self.pool.slots))]

    async def load_everywhere(self, ref: AdapterRef, pinned: bool = False) -> None:
        """Load on every healthy replica (its home only, under static placement); raises the first
        engine error, so nothing is half-registered."""
        targets = [self.home(ref)] if self.cfg.static_placement else [s for s in self.pool.slots if s.serving]
        await self._load_where_possible(targets, ref, pinned)

    async def _load_where_possible(self, targets: list[ReplicaSlot], ref: AdapterRef, pinned: bool = False) -> None:
        """Load on every target; a replica whose node cannot get the files is left out (its
        requests go elsewhere) unless none could, and any other engine error raises."""
        results = await asyncio.gather(*(self.load(s, ref, pinned) for s in targets), return_exceptions=True)
        unavailable = [r for r in results if isinstance(r, AdapterUnavailable)]
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, AdapterUnavailable):
                raise r
        if unavailable and len(unavailable) == len(results):
            raise unavailable[0]
        for e in unavailable:
            log.warning("%s; its requests go to other replicas", e)

    async def unload_everywhere(self, int_id: int) -> None:
        for s in self.pool.slots:
            if s.healthy and int_id in s.loaded:
                try:
                    await self.pool.call(s, s.replica.remove_adapter(int_id))
                except ReplicaFailure as e:  # its engine goes, and the adapter with it
                    log.warning(
                        "replica %d failed while unloading adapter %d (%s); rebuilding it", s.replica_id, int_id, e
                    )
                    self.pool.mark_failed(s)
            s.loaded.pop(int_id, None)
            if s.cache is not None:
                s.cache.discard(int_id)
        self.sizes.pop(int_id, None)

    def host_bytes(self, st: ReplicaStats) -> int:
        """Bytes of the adapters a replica's stats list in its host cache (sizes as registered)."""
        return sum(self.sizes.get(i, 0) for i in st.resident_adapter_ids)
