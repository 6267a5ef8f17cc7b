"""One replica's continuous batching, simulated: when each of a queue of requests finishes.

Each step costs the step-time model (`dlora.cost.params.CostParams`):

    step time = per_iteration_s + per_decode_token_s * running + per_prefill_token_s * prefill tokens

Requests are admitted first come first served while fewer than `max_batch` run; a request runs
one step per output token (its first step also prefills its prompt). Between two finishes every
step is the same, so the simulation jumps from finish to finish: O(n log n) for n requests. The
batch planner (`dlora.batch.predict`, `dlora.batch.plan`) and the migration check
(`dlora.cluster.estimators.held_work`) run it.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Sequence

from dlora.cost.params import CostParams


def simulate_replica(
    prompts: Sequence[int], outputs: Sequence[int], p: CostParams, adapters: Sequence[str | None] | None = None
) -> list[float]:
    """Finish time (seconds from 0) of each request on one replica, all waiting at time 0, FCFS.

    With `adapters`, a step whose running requests all use one adapter (or none) runs merged and
    costs `merged_ratio` of an unmerged one, as dLoRA's engines switch when a replica serves one
    adapter; the switch itself is not charged."""
    finish = [0.0] * len(prompts)
    waiting = deque(range(len(prompts)))
    running: list[tuple[int, int]] = []  # (the step count at which it finishes, request)
    using: Counter[str | None] = Counter()  # adapters of the running requests
    t, steps = 0.0, 0
    while waiting or running:
        prefill = 0
        while waiting and len(running) < p.max_batch:
            i = waiting.popleft()
            heapq.heappush(running, (steps + outputs[i], i))
            prefill += prompts[i]
            if adapters is not None:
                using[adapters[i]] += 1
        scale = p.merged_ratio if adapters is not None and len(using) == 1 else 1.0
        k = running[0][0] - steps  # steps until the next request finishes, each with this batch
        t += scale * (k * (p.per_iteration_s + p.per_decode_token_s * len(running)) + prefill * p.per_prefill_token_s)
        steps += k
        while running and running[0][0] == steps:
            i = heapq.heappop(running)[1]
            finish[i] = t
            if adapters is not None:
                using[adapters[i]] -= 1
                if not using[adapters[i]]:
                    del using[adapters[i]]
    return finish
