"""The order a modelled replica serves its queue in (`slo.order`): FCFS, or SeaLLM's.

SeaLLM's order ranks a request by its adapter's length profile (`slo.priority.sort_key`), kept
here as the replica model's requests finish: an adapter's own finished lengths once it has enough
of them, else those pooled over every adapter, else (before `min_samples` finished anywhere) the
requests' cap. The replica model (`replica_model.py`) admits its queues and picks what KV
preemption sends back in this order.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlora.cluster.estimators.output_lengths import OutputLengthEstimator, length_stats
from dlora.sim.model_io import TraceRequest
from dlora.slo.priority import LengthStats, sort_key


class ServiceOrder:
    def __init__(
        self, order: str, jobs: Sequence[TraceRequest], generated: list[int], estimator: OutputLengthEstimator
    ) -> None:
        """`generated`: each job's tokens so far, the replica model's own list (read, never written)."""
        self.fcfs = order == "fcfs"
        self.jobs, self.generated, self.estimator = jobs, generated, estimator
        # adapters with enough finished requests of their own (dropped at each finish of theirs),
        # and the pooled profile the others use (None: recompute, a request finished)
        self.profiles: dict[str, LengthStats] = {}
        self.pooled_profile: LengthStats | None = None
        self.cap_profile = LengthStats(float(min((j.max_tokens for j in jobs), default=1)))

    def finished(self, adapter: str) -> None:
        """A request of `adapter` has finished (the estimator has seen its length): its profile and
        the pooled one are recomputed when next asked for."""
        self.profiles.pop(adapter, None)
        self.pooled_profile = None

    def profile(self, adapter: str) -> LengthStats:
        """SeaLLM's length profile of `adapter`: its own finished lengths, else the pooled ones,
        else (before `min_samples` finished anywhere) the requests' cap."""
        own = self.profiles.get(adapter)
        if own is not None:
            return own
        if self.pooled_profile is None:
            pooled = self.estimator.pooled_samples()
            enough = len(pooled) >= self.estimator.cfg.min_samples
            self.pooled_profile = LengthStats.of(pooled) if enough else self.cap_profile
        got = length_stats(self.estimator, adapter, self.pooled_profile)
        if got is not self.pooled_profile:
            self.profiles[adapter] = got
        return got

    def key(self, i: int) -> tuple:
        """Request i's place in its replica's order, smallest served first: arrival (fcfs) or
        SeaLLM's (O_r, arrival), then the index."""
        job = self.jobs[i]
        if self.fcfs:
            return (job.arrival, i)
        return (*sort_key(job.arrival, self.generated[i], self.profile(job.adapter)), i)

    def in_order(self, queue: list[int]) -> list[int]:
        """The queued requests in the order the replica admits them (queues are kept in arrival order)."""
        return list(queue) if self.fcfs else sorted(queue, key=self.key)
