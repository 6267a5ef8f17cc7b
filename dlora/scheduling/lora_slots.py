"""Batch-slot aging: a request whose adapter finds every LoRA batch slot taken still gets one.

Why: vLLM admits a waiting request only while its adapter is among the `max_loras` adapters
running, or a slot is free; otherwise it skips the request and admits later ones. Under skewed
traffic the hot adapters always have a request running, so their slots never free and a request
of a cold adapter waits until the traffic pauses (tests/engine_ext/test_lora_slot_aging.py: more than
the 3 s the others kept arriving, against 0.4 s with this rule). dLoRA's credits (credits.py) bound
the same kind of wait for merged batches, not this one.

Rule: when the oldest slot-blocked waiting request has waited `starve_s`, one running adapter is
drained: its waiting requests that arrived after the blocked one are held back, so its running
requests finish, its slot frees, and vLLM's FCFS admission gives the slot to the blocked request.
The drained adapter is the one with the least remaining work (its running requests' output
tokens left to their max_tokens), so the slot frees soonest, and it stays the same until the
blocked request is admitted (switching would restart the drain). Nothing else is held back: the
other adapters keep being admitted into the freed running slots.

Opt-in (`scheduling.lora_slot_starve_s`, unset by default): on two replicas with ~200-token
outputs the drained adapters' held-back requests raised proactive dispatch's mean queueing
1.4-3.6x and the coldest requests still waited 15-25 s (bench/README.md, slot-aging ablation).
A rule that drains only an adapter whose running requests end within the starved one's budget
would be the next thing to try.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlora.scheduling.dynamic_batching import fcfs_key
from dlora.scheduling.types import BASE, AdapterKey, RequestView


def remaining_work(views: Sequence[RequestView], adapter: AdapterKey) -> int:
    """Output tokens the running requests of `adapter` have left, up to their max_tokens."""
    return sum(max(0, (v.max_tokens or 0) - v.num_output_tokens) for v in views if v.running and v.adapter == adapter)


def running_adapters(views: Sequence[RequestView]) -> set[str]:
    """The adapters holding a LoRA batch slot: those with a running request (the base model takes none)."""
    return {v.adapter for v in views if v.running and v.adapter is not BASE}


def slot_blocked(views: Sequence[RequestView], max_loras: int) -> RequestView | None:
    """The oldest waiting request that no LoRA batch slot can take now (None if there is none)."""
    running = running_adapters(views)
    if len(running) < max_loras:
        return None
    blocked = [v for v in views if not v.running and v.adapter is not BASE and v.adapter not in running]
    return min(blocked, key=fcfs_key, default=None)


@dataclass(slots=True)
class LoraSlotAging:
    max_loras: int
    starve_s: float
    draining: AdapterKey = None  # the adapter held back for a starved request, while it lasts
    drains: int = 0  # drains started, for /metrics

    def held_back(self, views: Sequence[RequestView], now: float) -> frozenset[str]:
        """Request ids to keep out of this step's admission (empty unless a request starves)."""
        starved = slot_blocked(views, self.max_loras)
        if starved is None or now - starved.arrival_time < self.starve_s:
            self.draining = None
            return frozenset()
        running = running_adapters(views)
        if self.draining not in running:
            self.draining = min(running, key=lambda a: (remaining_work(views, a), str(a)))
            self.drains += 1
        after = fcfs_key(starved)
        return frozenset(
            v.req_id for v in views if not v.running and v.adapter == self.draining and fcfs_key(v) > after
        )
