"""What the scheduler measures of its steps and requests, for the router and the batching policy.

Runs inside vLLM's EngineCore process, kept by `DloraScheduler` (`scheduler.py`), which calls it
over plain data. Into one numbered sample log (`samples.py`) go each step's cost (for the router's
per-replica cost model; not the engine's first step, see `step_cost`) and each request's wait
before its first step (`queue_waits.py`); beside them, the preemptions vLLM made for KV room.
`iteration_stats` is what the batching policy observes of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dlora.engine_ext import samples
from dlora.engine_ext.queue_waits import QueueWaits
from dlora.engine_ext.samples import QueueWait, SampleLog, StepSample
from dlora.scheduling import IterationStats, Mode


class StepMeasures:
    def __init__(self) -> None:
        self.samples = SampleLog()
        self.warm = False  # whether a step has run (the first one is not a cost sample)
        self.queue_waits = QueueWaits()
        # Running requests vLLM preempted for KV room (each recomputes on resume); counted here
        # because vLLM keeps only a per-request count, which leaves with the request.
        self.preemptions = 0

    def queued(self, request_id: str, now: float) -> None:
        """A request entered the scheduler."""
        self.queue_waits.queued(request_id, now)

    def waits_end(self, request_ids: Iterable[str], now: float) -> None:
        """A step admitted these requests, or they finished from outside: their waits are samples."""
        for wait in self.queue_waits.end(request_ids, now):
            self.samples.append(wait)

    def step_cost(self, num_scheduled_tokens: Mapping[str, int], total: int, seconds: float, merged: bool) -> None:
        """One step for the cluster cost model (`samples.step_sample`), its switch time excluded."""
        sample = samples.step_sample(num_scheduled_tokens, total, seconds, merged)
        if sample is not None and not self.warm:
            # The engine's first step also warms it up (allocations, kernel selection): 8-13 s more
            # than its tokens cost on a CPU, which a least-squares fit of a few dozen steps would
            # read as a per-step cost of a few hundred ms.
            self.warm = True
        elif sample is not None:
            self.samples.append(sample)

    def since(self, seq: int) -> tuple[tuple[StepSample, ...], tuple[QueueWait, ...]]:
        """(the step samples, the queue waits) numbered after `seq`, each in order."""
        return samples.split(self.samples.since(seq))


def iteration_stats(
    num_scheduled_tokens: Mapping[str, int], total: int, iteration_s: float, switch_s: float, merged: str | None
) -> IterationStats:
    """What the batching policy observes of a step: its requests and tokens, how long it took and
    how much of that went to switching the weights, and what was merged after it."""
    return IterationStats(
        mode=Mode.MERGED if merged else Mode.UNMERGED,
        merged_adapter=merged,
        num_requests=len(num_scheduled_tokens),
        iteration_time=iteration_s,
        switch_time=switch_s,
        num_tokens=total,
        prefill_tokens=samples.prefill_tokens(num_scheduled_tokens, total),
    )
