"""Snapshots of the cluster that the balancer's pure functions read: no Ray, no engine, no clock.

The router (or the monitor) builds one `ReplicaView` per replica from what it already tracks for
each in-flight request (prompt length, tokens received, adapter) plus the replica's reported
stats (KV use, resident and merged adapters). Dispatch, placement and co-migration only read
these, so they are unit-tested without engines and the same code runs in `dlora serve` and in
the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

AdapterName = str | None  # an adapter name, or None for the base model (resident everywhere)


@dataclass(frozen=True, slots=True)
class RequestLoad:
    """One unfinished request on a replica, as the router sees it."""

    request_id: str
    adapter: AdapterName
    prompt_tokens: int
    output_tokens: int  # generated so far (received by the router)
    # Total output expected: generated so far + the expected remainder (estimators/output_lengths.py), at
    # most max_tokens; max_tokens itself when no estimate is used.
    expected_output_tokens: float
    # Admitted by the engine on its current replica (holds KV): its queue wait there was reported
    # or its first token came. False while queued, including a moved request waiting on its new
    # replica with tokens generated elsewhere.
    running: bool
    # When the current replica was sent the request (seconds, the clock of the `now` the triggers
    # and the queued-request planner get): what its present wait counts from.
    queued_since: float = 0.0
    # When the request first reached the cluster (same clock): every leg keeps it, and each engine
    # admits its queued requests in this order (vLLM's priority queue with equal priorities).
    arrival: float = 0.0
    adapter_bytes: int = 0  # its adapter's weights: what a replica without it must find room for
    max_tokens: int | None = None  # its output cap (None: not known to whoever made this view)
    # Set on a request being dispatched: (replica id, prompt tokens that replica's prefix cache
    # probably holds for it), for the replicas where any (cluster/prefix_locality.py)
    cached_prefix: tuple[tuple[int, int], ...] = ()

    def cached_on(self, replica_id: int) -> int:
        """Prompt tokens `replica_id` would probably not have to prefill (its prefix cache), at most
        the prompt's."""
        cached = next((tokens for rid, tokens in self.cached_prefix if rid == replica_id), 0)
        return min(cached, self.prompt_tokens)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the request holds once running (re-prefilled if it migrates)."""
        return self.prompt_tokens + self.output_tokens

    @property
    def remaining_output_tokens(self) -> float:
        return max(0.0, self.expected_output_tokens - self.output_tokens)


@dataclass(slots=True)
class AdapterTotals:
    """Sums over one adapter's requests on one replica: what dispatch's cost model reads."""

    requests: int = 0
    queued: int = 0
    queued_context_tokens: int = 0  # what the queued requests prefill before they run
    running_context_tokens: int = 0  # KV the running requests hold
    remaining_output_tokens: float = 0.0
    # request id -> its expected remaining output (the longest one gates a batch slot)
    remaining_by_request: dict[str, float] = field(default_factory=dict)

    def add(self, r: RequestLoad, sign: int = 1) -> None:
        self.requests += sign
        self.remaining_output_tokens += sign * r.remaining_output_tokens
        if r.running:
            self.running_context_tokens += sign * r.context_tokens
        else:
            self.queued += sign
            self.queued_context_tokens += sign * r.context_tokens
        if sign > 0:
            self.remaining_by_request[r.request_id] = r.remaining_output_tokens
        else:
            self.remaining_by_request.pop(r.request_id, None)

    @property
    def longest_remaining(self) -> float:
        return max(self.remaining_by_request.values(), default=0.0)


@dataclass(slots=True)
class LoadTotals:
    """One replica's requests summed per adapter, kept up to date request by request by the router.

    Why: dispatch runs once per request, and rebuilding every in-flight request's `RequestLoad`
    for it made each dispatch cost O(requests in flight), so a burst of N requests cost O(N²) on
    the event loop. With these sums a dispatch costs O(replicas x adapters); the balancer's
    periodic rounds still get the full per-request views.
    """

    by_adapter: dict[AdapterName, AdapterTotals] = field(default_factory=dict)

    @classmethod
    def of(cls, requests: Iterable[RequestLoad]) -> LoadTotals:
        totals = cls()
        for r in requests:
            totals.add(r)
        return totals

    def add(self, r: RequestLoad) -> None:
        self.by_adapter.setdefault(r.adapter, AdapterTotals()).add(r)

    def remove(self, r: RequestLoad) -> None:
        group = self.by_adapter.get(r.adapter)
        if group is None:
            return
        group.add(r, sign=-1)
        if group.requests <= 0:
            del self.by_adapter[r.adapter]

    @property
    def requests(self) -> int:
        return sum(g.requests for g in self.by_adapter.values())

    @property
    def queued(self) -> int:
        return sum(g.queued for g in self.by_adapter.values())

    @property
    def running_context_tokens(self) -> int:
        return sum(g.running_context_tokens for g in self.by_adapter.values())

    @property
    def queued_context_tokens(self) -> int:
        return sum(g.queued_context_tokens for g in self.by_adapter.values())

    def adapters_in_use(self) -> frozenset[str]:
        return frozenset(a for a in self.by_adapter if a is not None)


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica at one instant.

    `kv_usage` is the engine's measured fraction of KV blocks in use; when None (e.g. in a unit
    test) it is derived from the running requests' context tokens over `kv_capacity_tokens`.
    `adapter_slots` is how many adapters the replica may hold at once (vLLM's max_cpu_loras / the
    adapter memory budget); idle residents are evictable, adapters with requests are not.
    `batch_adapter_slots` is how many distinct adapters one engine step may run (vLLM's max_loras),
    `max_running` how many requests it may run (vLLM's max_num_seqs).
    """

    replica_id: int
    requests: tuple[RequestLoad, ...] = ()
    resident_adapters: frozenset[str] = frozenset()
    merged_adapter: str | None = None
    kv_capacity_tokens: int = 1 << 20
    adapter_slots: int = 1 << 20
    batch_adapter_slots: int = 1 << 20
    max_running: int = 1 << 20
    kv_usage: float | None = None
    healthy: bool = True
    # With a host LoRA cache in bytes (engine.max_cpu_lora_mib): the bytes a new adapter could have
    # there, every idle unpinned adapter unloaded; None: adapters are counted, not weighed.
    adapter_bytes_free: int | None = None
    # Seconds until the engine step under way ends (the router's estimate from the step's start and
    # the cost model); 0: idle, or not known. A request sent now waits at least this long.
    step_left_s: float = 0.0
    # Set by the router for dispatch instead of `requests` (which is then empty): the same
    # quantities, summed as requests come and go. Read at once, never kept (it is live).
    totals: LoadTotals | None = field(default=None, compare=False, repr=False)

    @property
    def num_requests(self) -> int:
        return self.totals.requests if self.totals is not None else len(self.requests)

    @property
    def num_queued(self) -> int:
        if self.totals is not None:
            return self.totals.queued
        return sum(1 for r in self.requests if not r.running)

    @property
    def num_running(self) -> int:
        return self.num_requests - self.num_queued

    @property
    def kv_used_tokens(self) -> int:
        if self.totals is not None:
            return self.totals.running_context_tokens
        return sum(r.context_tokens for r in self.requests if r.running)

    @property
    def kv_fraction(self) -> float:
        if self.kv_usage is not None:
            return self.kv_usage
        return self.kv_used_tokens / max(1, self.kv_capacity_tokens)

    @property
    def kv_demand_tokens(self) -> float:
        """KV tokens in use plus the contexts of the queued requests (each needs its KV to start)."""
        queued = (
            self.totals.queued_context_tokens
            if self.totals is not None
            else sum(r.context_tokens for r in self.requests if not r.running)
        )
        return self.kv_fraction * self.kv_capacity_tokens + queued

    def kv_room(self, kv_high: float) -> float:
        """KV tokens the replica can still take up to `kv_high`, after what it runs and queues
        (negative when it is already past it)."""
        return kv_high * self.kv_capacity_tokens - self.kv_demand_tokens

    def holds(self, adapter: AdapterName) -> bool:
        return adapter is None or adapter in self.resident_adapters

    def adapters_in_use(self) -> frozenset[str]:
        """Adapters with requests here: the engine cannot evict these to make room."""
        if self.totals is not None:
            return self.totals.adapters_in_use()
        return frozenset(r.adapter for r in self.requests if r.adapter is not None)

    def waits_for_batch_slot(self, adapter: AdapterName) -> bool:
        """A request of `adapter` cannot join a step yet: other adapters with requests here take
        every batch slot (vLLM admits a new adapter only once one of them has no running request left)."""
        in_use = self.adapters_in_use()
        return adapter is not None and adapter not in in_use and len(in_use) >= self.batch_adapter_slots

    def has_free_slot(self, adapter: AdapterName) -> bool:
        """A request of `adapter` sent now joins the next step: a running slot is free (counting the
        requests queued here, which take theirs first) and a batch slot is free for its adapter."""
        return self.num_requests < self.max_running and not self.waits_for_batch_slot(adapter)

    def can_take(self, adapter: AdapterName, adapter_bytes: int = 0) -> bool:
        """Healthy, and holds `adapter` or has a slot (and the bytes, where counted) free to load it."""
        if not self.healthy:
            return False
        if self.holds(adapter):
            return True
        room = self.adapter_bytes_free
        return self.free_adapter_slots() > 0 and (room is None or adapter_bytes <= room)

    def free_adapter_slots(self) -> int:
        """Adapters that can still be loaded (idle residents count as free: LRU evicts them)."""
        return max(0, self.adapter_slots - len(self.adapters_in_use()))


@dataclass(frozen=True, slots=True)
class IterationSample:
    """One engine step as measured by a replica; the cost model is fitted from these."""

    num_seqs: int  # sequences in the step's batch
    prefill_tokens: int  # prompt tokens computed in the step
    decode_tokens: int  # tokens generated in the step (one per decoding sequence)
    seconds: float  # wall time of the step, merge/unmerge excluded
    merged: bool = False  # ran with an adapter folded into the base weights


@dataclass(frozen=True, slots=True)
class ClusterView:
    """All replicas at one instant, plus what the balancer knows about adapters."""

    replicas: tuple[ReplicaView, ...]
    # adapter name -> memory it takes on a replica, in KV-token equivalents (bytes / KV bytes per
    # token); adapters not listed use `default_adapter_tokens`.
    adapter_tokens: Mapping[str, int] = field(default_factory=dict)
    default_adapter_tokens: int = 0

    def adapter_size(self, adapter: AdapterName) -> int:
        if adapter is None:
            return 0
        return self.adapter_tokens.get(adapter, self.default_adapter_tokens)

    def healthy(self) -> tuple[ReplicaView, ...]:
        return tuple(r for r in self.replicas if r.healthy)
