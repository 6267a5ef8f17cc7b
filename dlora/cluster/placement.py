"""Long-term adapter preload: replicate adapters to raise the minimum burst tolerance (dLoRA §5.1).

Why: a burst for an adapter can only be absorbed by the replicas that hold it, and each copy of
an adapter takes memory that requests' KV could otherwise use. Following the paper (after
Nexus/Clipper-style selective replication), an adapter's *burst tolerance* is

    tolerance(a) = peak_capacity(a) / rate(a),
    peak_capacity(a) = sum over replicas j holding a of free_j / tokens_per_request,
    free_j = memory_j - sum of the sizes of the adapters on j,

with rate(a) its recent average request rate. The greedy repeatedly takes the adapter of lowest
tolerance and copies it to the replica (without it, within its adapter memory budget) that
gives the largest resulting minimum tolerance; it stops when that minimum would decrease, or
no copy fits. Adapters with no traffic have infinite tolerance and are never copied.

Memory is in one unit throughout, whichever the caller counts in (KV tokens as in the paper,
adapter slots, or bytes: `Balancer.maybe_preload`); the field names say "tokens" after the paper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PlacementReplica:
    replica_id: int
    memory_tokens: int  # KV + adapter memory, in the plan's memory unit
    adapter_budget_tokens: int  # at most this much of it may hold adapters (same unit)
    resident: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdapterDemand:
    name: str
    rate: float  # recent average requests per second
    size_tokens: int  # memory one copy takes (the plan's memory unit)


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    placement: dict[int, frozenset[str]]  # replica_id -> adapters after the preloads
    loads: tuple[tuple[str, int], ...]  # (adapter, replica_id) to preload, in the order chosen
    min_tolerance_before: float
    min_tolerance_after: float


def burst_tolerance(
    placement: Mapping[int, set[str] | frozenset[str]],
    replicas: Sequence[PlacementReplica],
    demands: Sequence[AdapterDemand],
    tokens_per_request: float,
) -> dict[str, float]:
    """Tolerance of every adapter with traffic under `placement` (0 if placed nowhere)."""
    size = {d.name: d.size_tokens for d in demands}
    free = {r.replica_id: r.memory_tokens - sum(size.get(a, 0) for a in placement[r.replica_id]) for r in replicas}
    out = {}
    for d in demands:
        if d.rate > 0:
            capacity = sum(max(0, free[j]) for j, held in placement.items() if d.name in held) / tokens_per_request
            out[d.name] = capacity / d.rate
    return out


def _min(tolerance: Mapping[str, float]) -> float:
    return min(tolerance.values(), default=math.inf)


class _State:
    """Free memory per replica and peak capacity per adapter, updated one copy at a time."""

    def __init__(self, replicas: Sequence[PlacementReplica], demands: Sequence[AdapterDemand], tpr: float) -> None:
        self.replicas = {r.replica_id: r for r in replicas}
        self.placement: dict[int, set[str]] = {r.replica_id: set(r.resident) for r in replicas}
        self.size = {d.name: d.size_tokens for d in demands}
        self.rate = {d.name: d.rate for d in demands if d.rate > 0}
        self.tpr = tpr
        self.free = {j: r.memory_tokens - self.used(j) for j, r in self.replicas.items()}
        self.capacity = {a: 0.0 for a in self.rate}
        for j, held in self.placement.items():
            for a in held & self.rate.keys():
                self.capacity[a] += max(0, self.free[j]) / tpr

    def used(self, j: int) -> int:
        return sum(self.size.get(a, 0) for a in self.placement[j])

    def tolerance(self) -> dict[str, float]:
        return {a: self.capacity[a] / r for a, r in self.rate.items()}

    def fits(self, a: str, j: int) -> bool:
        """Within the adapter budget, and leaving free memory (else the copy adds no capacity)."""
        r, size = self.replicas[j], self.size[a]
        return a not in self.placement[j] and self.used(j) + size <= r.adapter_budget_tokens and self.free[j] > size

    def min_after(self, a: str, j: int, order: list[tuple[float, str]]) -> float:
        """The minimum tolerance if `a` were copied to `j` (only j's adapters and `a` change)."""
        old, new = max(0, self.free[j]) / self.tpr, max(0, self.free[j] - self.size[a]) / self.tpr
        changed = {b: (self.capacity[b] - old + new) / self.rate[b] for b in self.placement[j] if b in self.rate}
        changed[a] = (self.capacity[a] + new) / self.rate[a]
        rest = next((t for t, b in order if b not in changed), math.inf)
        return min(rest, *changed.values())

    def add(self, a: str, j: int) -> None:
        old = max(0, self.free[j]) / self.tpr
        self.free[j] -= self.size[a]
        self.placement[j].add(a)
        new = max(0, self.free[j]) / self.tpr
        for b in self.placement[j] & self.rate.keys():
            self.capacity[b] += new - (old if b != a else 0.0)


def plan_placement(
    replicas: Sequence[PlacementReplica], demands: Sequence[AdapterDemand], tokens_per_request: float
) -> PlacementPlan:
    """Greedy preloads from the current residency (`PlacementReplica.resident`)."""
    if tokens_per_request <= 0:
        raise ValueError("tokens_per_request must be > 0")
    state = _State(replicas, demands, tokens_per_request)
    before = current = _min(state.tolerance())
    loads: list[tuple[str, int]] = []
    while state.rate:
        order = sorted((t, a) for a, t in state.tolerance().items())
        name = order[0][1]
        candidates = [
            (state.min_after(name, j, order), state.free[j], -j) for j in sorted(state.replicas) if state.fits(name, j)
        ]
        if not candidates or max(candidates)[0] < current:
            break
        j = -max(candidates)[2]
        state.add(name, j)
        loads.append((name, j))
        current = _min(state.tolerance())
    placement = {j: frozenset(a) for j, a in state.placement.items()}
    return PlacementPlan(placement, tuple(loads), before, current)
