"""Iteration-time estimates per mode, learned from measured steps.

Alg. 2 compares the throughput of the batches that ran with that of the batches the other mode
would have run, so it needs IterationTime(B) for a batch that did not run ("the iteration time
can be profiled accurately", §4.2). Each mode keeps an exponentially weighted least-squares fit
time ≈ a + b·n, a, b >= 0, over (batch size n, compute seconds) (`dlora.cost.fit`); a mode
never measured is estimated from the other one scaled by the prior merged/unmerged cost ratio.

A mode seen at one batch size only (typically merged mode after one lone request) has no slope of
its own. Extrapolating it proportionally (t ∝ n) is wrong by up to an order of magnitude: a step's
fixed cost (reading the weights, Python) dominates small batches, so one cold one-request merged
step would make every larger merged batch look slow and Alg. 2 would never merge again. Such a mode borrows
the other mode's shape, scaled through its own point; with no shape anywhere, a step is assumed to
be half fixed cost and half per-request cost at the size seen (`FIXED_SHARE`).

Other step-time models, and why this one differs: `dlora.cluster.estimators.replica_cost` is the
router's per-replica model (per-token coefficients, additive per request, for dispatch and the
co-migration ILP) and `dlora.sim.step_costs` holds the simulators' fixed coefficients. This one
answers only what Alg. 2 asks inside the engine, the time of a step of n requests in a mode, and
must estimate a mode from the other one when it has no data of its own.
"""

from __future__ import annotations

from dlora.cost.fit import fit_nonnegative
from dlora.scheduling.types import Mode

DECAY = 0.9  # weight of the past per new sample (memory of roughly 10 steps)
FIXED_SHARE = 0.5  # prior share of a step's time that does not grow with the batch (see above)


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

    @property
    def point(self) -> tuple[float, float]:
        """The weighted mean (batch size, seconds) seen."""
        return self.sn / self.w, self.st / self.w

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) >= 0 of the fit (`dlora.cost.fit`), or None while a single batch
        size has been seen."""
        mean_n, _ = self.point
        var = self.snn / self.w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return None
        fitted = fit_nonnegative([[self.w, self.sn], [self.sn, self.snn]], [self.st, self.snt])
        return None if fitted is None else (fitted[0], fitted[1])

    def predict(self, n: float, shape: tuple[float, float] | None = None) -> float:
        """Seconds for a step of n requests; `shape` (another fit's line) stands in for a missing slope."""
        fitted = self.line()
        if fitted is not None:
            return fitted[0] + fitted[1] * n
        mean_n, mean_t = self.point
        if mean_n <= 0:
            return mean_t
        a, b = (
            shape
            if shape is not None and shape[0] + shape[1] * mean_n > 0
            else (FIXED_SHARE, (1 - FIXED_SHARE) / mean_n)
        )
        return mean_t * (a + b * n) / (a + b * mean_n)


class IterationTimeModel:
    def __init__(self, merged_cost_ratio: float) -> None:
        self.merged_cost_ratio = merged_cost_ratio
        self._fits = {Mode.UNMERGED: _LinearFit(), Mode.MERGED: _LinearFit()}

    def observe(self, mode: Mode, num_requests: int, seconds: float) -> None:
        if num_requests > 0 and seconds > 0:
            self._fits[mode].add(float(num_requests), seconds)

    def estimate(self, mode: Mode, num_requests: int) -> float | None:
        """Seconds one step of `num_requests` requests takes in `mode`; None with no data at all."""
        if num_requests <= 0:
            return 0.0
        fit = self._fits[mode]
        other = Mode.UNMERGED if mode is Mode.MERGED else Mode.MERGED
        if not fit.empty:
            return fit.predict(num_requests, shape=None if self._fits[other].empty else self._fits[other].line())
        if self._fits[other].empty:
            return None
        base = self._fits[other].predict(num_requests)
        return base * self.merged_cost_ratio if mode is Mode.MERGED else base / self.merged_cost_ratio
