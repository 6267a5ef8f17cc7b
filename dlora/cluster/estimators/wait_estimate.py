"""How long each queued request still waits on a replica before its engine starts it.

The co-migration ILP balances *work*; a queued request cares about *when it starts*. With every
leg stamped with its first arrival, a replica's engine admits queued requests in arrival order
whenever a running slot frees (dlora/replica/engine.py runs vLLM's priority queue), so the wait of
the k-th queued request is the time until k+1 slots free up, each queued request ahead of it taking
a freed slot for its own run. That is what `start_times` replays, as an event list over slots:

- A running request frees its slot after its expected remaining output at the replica's current
  step time (all running requests advance one token per step: wall time, not shared work).
- A queued request takes the earliest free slot, no earlier than its adapter can join a step
  (`batch_slot_wait` over the running requests: every batch slot held by other adapters) or be
  loaded, and keeps the slot for its prefill plus its expected output.
- Slots are vLLM's `max_num_seqs`, unless the replica's KV is past `kv_high`: then it admits
  nothing new until a running request ends, so it has only the slots it is running now.

Expected outputs come from the router's per-adapter history (estimators/output_lengths.py), so these are
estimates; the planner that uses them (migration/rebalance.py) acts only on clear gains.
"""

from __future__ import annotations

import dataclasses
import heapq

from dlora.cluster.estimators.replica_cost import batch_slot_wait, load_time
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.cost.params import CostParams, step_seconds


def queue_order(view: ReplicaView) -> list[RequestLoad]:
    """The replica's queued requests in the order its engine admits them (first arrival, then id)."""
    return sorted((r for r in view.requests if not r.running), key=lambda r: (r.arrival, r.request_id))


def usable_slots(view: ReplicaView, kv_high: float) -> int:
    if view.kv_fraction >= kv_high:
        return max(1, view.num_running)
    return view.max_running


def start_times(view: ReplicaView, p: CostParams, kv_high: float) -> dict[str, float]:
    """Seconds from now until each queued request on `view` starts (request id -> seconds)."""
    step = step_seconds(p, min(view.num_requests, view.max_running))
    frees = sorted(r.remaining_output_tokens * step for r in view.requests if r.running)
    slots = usable_slots(view, kv_high)
    # Over the slot count (KV shrank it), the first finishers free no usable slot.
    frees = frees[max(0, len(frees) - slots) :] + [0.0] * max(0, slots - len(frees))
    heapq.heapify(frees)
    # Batch slots are held by the adapters of running requests (a queued one holds none yet).
    runs = dataclasses.replace(view, requests=tuple(r for r in view.requests if r.running))
    starts: dict[str, float] = {}
    for r in queue_order(view):
        ready = max(batch_slot_wait(p, runs, r.adapter), load_time(p, view, r.adapter))
        start = max(heapq.heappop(frees), ready)
        starts[r.request_id] = start
        run = r.context_tokens * p.per_prefill_token_s + r.remaining_output_tokens * step
        heapq.heappush(frees, start + run)
    return starts


def total_wait(view: ReplicaView, p: CostParams, kv_high: float) -> float:
    """Seconds the replica's queued requests still wait, summed (what moving requests lowers)."""
    return sum(start_times(view, p, kv_high).values())
