"""A replica as the router holds it: the replica's interface, and its slot (health, adapters,
host cache, rebuild state)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from dlora.cluster.host_cache import HostCache
from dlora.replica.messages import AdapterRef, BatchingState, Delta, GenerateRequest, ReplicaStats


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
    # Adapter versions (int_ids) this replica could not get onto its node (AdapterUnavailable): their
    # requests go to other replicas until this one is started again.
    unavailable: set[int] = field(default_factory=set)
    # The stats read still unanswered, if any, and when it was asked (event-loop time): a slow
    # replica's read is awaited again by the next refresh, not asked twice.
    stats_call: asyncio.Future | None = None
    stats_asked_at: float = 0.0
    # When its engine's step under way started, as the router sees it (router clock): the last time
    # tokens came from it, or a request reached it idle. None: no step seen yet.
    step_started_at: float | None = None

    @property
    def batching(self) -> BatchingState | None:
        """The replica's batching state at its last stats read (None before one)."""
        return self.last_stats.batching if self.last_stats else None

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
