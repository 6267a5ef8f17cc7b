"""Iteration-time estimates per mode, learned from measured steps.

Alg. 2 compares the throughput of the batches that ran with that of the batches the other mode
would have run, so it needs IterationTime(B) for a batch that did not run ("the iteration time
can be profiled accurately", §4.2). Each mode keeps an exponentially weighted least-squares fit
time ≈ a + b·n over (batch size n, compute seconds); a mode never measured is estimated from the
other one scaled by the prior merged/unmerged cost ratio.
"""

from __future__ import annotations

from dlora.scheduling.types import Mode

DECAY = 0.9  # weight of the past per new sample (memory of roughly 10 steps)


class _LinearFit:
    """Exponentially weighted fit of t = a + b·n with a, b >= 0."""

    def __init__(self) -> None:
        self.w = self.sn = self.st = self.snn = self.snt = 0.0

    @property
    def empty(self) -> bool:
        return self.w == 0.0

    def add(self, n: float, t: float) -> None:
        self.w, self.sn, self.st = self.w * DECAY + 1, self.sn * DECAY + n, self.st * DECAY + t
        self.snn, self.snt = self.snn * DECAY + n * n, self.snt * DECAY + n * t

    def predict(self, n: float) -> float:
        mean_n, mean_t = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            # One batch size seen so far: assume time proportional to the batch.
            return mean_t * n / mean_n if mean_n > 0 else mean_t
        slope = (self.snt / self.w - mean_n * mean_t) / var
        if slope < 0:  # noise: fall back to the mean
            return mean_t
        intercept = mean_t - slope * mean_n
        if intercept < 0:
            return (self.st / self.sn) * n
        return intercept + slope * n


class IterationCostModel:
    def __init__(self, merged_cost_ratio: float) -> None:
        self.merged_cost_ratio = merged_cost_ratio
        self._fits = {Mode.UNMERGED: _LinearFit(), Mode.MERGED: _LinearFit()}

    def observe(self, mode: Mode, num_requests: int, seconds: float) -> None:
        if num_requests > 0 and seconds > 0:
            self._fits[mode].add(float(num_requests), seconds)

    def has_data(self, mode: Mode) -> bool:
        return not self._fits[mode].empty

    def estimate(self, mode: Mode, num_requests: int) -> float | None:
        """Seconds one step of `num_requests` requests takes in `mode`; None with no data at all."""
        if num_requests <= 0:
            return 0.0
        fit = self._fits[mode]
        if not fit.empty:
            return fit.predict(num_requests)
        other = Mode.UNMERGED if mode is Mode.MERGED else Mode.MERGED
        if self._fits[other].empty:
            return None
        base = self._fits[other].predict(num_requests)
        return base * self.merged_cost_ratio if mode is Mode.MERGED else base / self.merged_cost_ratio
