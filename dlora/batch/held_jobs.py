"""What a replica holds, as the batch planner's jobs: its running requests and its queue, in the
order its engine runs them (`dlora.cluster.estimators.held_work.engine_order`), so the planner
simulates new lines after them, in the same batches."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from dlora.batch.plan import PlannedLine
from dlora.cluster.estimators.held_work import draw_remaining, engine_order
from dlora.cluster.policy_views import AdapterName, RequestLoad


def held_jobs(
    reqs: Sequence[RequestLoad], lengths_of: Callable[[AdapterName], Sequence[int]], seed: int = 0
) -> list[PlannedLine]:
    """What one replica holds, as the batch planner's jobs in `engine_order`; each one's remaining
    output is one draw (`draw_remaining`) from its adapter's observed lengths (`lengths_of`)."""
    rng = random.Random(seed)
    sorted_lengths = {a: sorted(lengths_of(a)) for a in {r.adapter for r in reqs}}
    return [
        PlannedLine(r.adapter, (prefill,), (draw_remaining(r, sorted_lengths[r.adapter], rng),))
        for r, prefill in engine_order(reqs)
    ]
