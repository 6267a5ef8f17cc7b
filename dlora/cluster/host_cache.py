"""One replica's host LoRA cache counted in bytes: which adapters it holds, least recently used first.

vLLM's host cache is an LRU of `engine.max_cpu_loras` entries, whatever their sizes: a handful of
rank-64 adapters can take as much memory as a hundred rank-8 ones. With `engine.max_cpu_lora_mib`
the router keeps this record per replica and, before a load that would pass the budget (or vLLM's
count), unloads the least recently used adapters itself. Never unloaded: pinned adapters, and
adapters with requests in flight on that replica (the caller names them). Pure bookkeeping: the
router makes the engine calls the returned victims call for.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from dlora.cluster.errors import ClusterError

MIB = 1 << 20


class AdapterTooLarge(ValueError):
    """An adapter that no replica's host cache could ever hold."""


class HostCacheFull(ClusterError):
    """Every adapter the cache could give up is pinned or in use now; a later retry may fit."""

    http_status = 503


@dataclass(frozen=True)
class CachedAdapter:
    size_bytes: int
    pinned: bool


@dataclass
class HostCache:
    budget_bytes: int
    max_entries: int | None = None  # vLLM's own bound (engine.max_cpu_loras); None: bytes only
    _entries: OrderedDict[int, CachedAdapter] = field(default_factory=OrderedDict)  # oldest use first

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be > 0")

    def __contains__(self, adapter_id: int) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return sum(e.size_bytes for e in self._entries.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def room(self, in_use: Collection[int] = ()) -> int:
        """Bytes a new adapter could have, every adapter that `admit` may unload unloaded (all but
        the pinned ones and `in_use`)."""
        kept = sum(e.size_bytes for i, e in self._entries.items() if e.pinned or i in in_use)
        return self.budget_bytes - kept

    def ids(self) -> list[int]:
        """Held adapters, least recently used first."""
        return list(self._entries)

    def check_fits(self, size_bytes: int) -> None:
        """AdapterTooLarge unless an adapter of this size fits in an empty cache."""
        if size_bytes > self.budget_bytes:
            raise AdapterTooLarge(
                f"the adapter takes {size_bytes / MIB:.3f} MiB, more than a replica's host LoRA cache holds "
                f"(engine.max_cpu_lora_mib = {self.budget_bytes / MIB:.3f} MiB)"
            )

    def touch(self, adapter_id: int) -> None:
        """A request used the adapter: it becomes the most recently used."""
        if adapter_id in self._entries:
            self._entries.move_to_end(adapter_id)

    def admit(self, adapter_id: int, size_bytes: int, pinned: bool, in_use: Collection[int] = ()) -> list[int]:
        """Record the adapter as held (most recently used) and return the adapters to unload first
        to make room, least recently used first; they are no longer recorded. Raises
        AdapterTooLarge or HostCacheFull, recording nothing, when no choice of victims makes room."""
        if adapter_id in self._entries:
            self.touch(adapter_id)
            return []
        self.check_fits(size_bytes)
        victims: list[int] = []
        room, entries = self.free_bytes, len(self._entries)
        for held, entry in self._entries.items():
            if room >= size_bytes and (self.max_entries is None or entries < self.max_entries):
                break
            if entry.pinned or held in in_use:
                continue
            victims.append(held)
            room, entries = room + entry.size_bytes, entries - 1
        if room < size_bytes:
            raise HostCacheFull(
                f"the host LoRA cache has {room / MIB:.3f} MiB it can free for an adapter of "
                f"{size_bytes / MIB:.3f} MiB: the rest holds pinned adapters or adapters with requests in "
                "flight (engine.max_cpu_lora_mib); retry when requests finish"
            )
        for held in victims:
            del self._entries[held]
        self._entries[adapter_id] = CachedAdapter(size_bytes, pinned)
        return victims

    def discard(self, adapter_id: int) -> None:
        """The adapter left the engine (unloaded, or its load failed)."""
        self._entries.pop(adapter_id, None)

    def clear(self) -> None:
        """The engine was rebuilt: it holds nothing."""
        self._entries.clear()
