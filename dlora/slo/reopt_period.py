"""SeaLLM's adaptive re-optimisation period (§4.3, Eq. 8): how often to re-plan.

Why: a fixed period is hard to choose: re-planning (SeaLLM's replacement; here dLoRA's
co-migration ILP or the adapter preload) too often costs migrations for nothing, too rarely reacts
late to shifting traffic. SeaLLM predicts, before each period, the metrics the coming period should
show (from the previous period's requests) and compares them with what it measured:

    I_{t+1} = (1 - beta) * I_t   if |M_real - M_est| / M_est > beta   (traffic moved: re-plan sooner)
    I_{t+1} = (1 + beta) * I_t   if |M_real - M_est| / M_est < beta   (prediction held: re-plan later)

with beta in (0, 1) (0.1 in SeaLLM). Choices where the paper is silent:
- an error of exactly beta keeps the period;
- several metrics (SeaLLM names SLO attainment and normalized latency) are judged by the largest
  relative error: any metric the prediction missed shows the workload changed;
- M_est = 0: the error is 0 if M_real is 0 too, else infinite (shrink);
- the period stays within [min_s, max_s] (`slo.reopt_min_s`, `slo.reopt_max_s`), so a run of
  good predictions cannot stretch it past any reaction time, nor bad ones shrink it to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def relative_error(real: float, est: float) -> float:
    """|M_real - M_est| / M_est (Eq. 8's test statistic), with M_est = 0 handled as above."""
    if est == 0:
        return 0.0 if real == 0 else math.inf
    return abs(real - est) / abs(est)


def next_period(period_s: float, error: float, beta: float, min_s: float, max_s: float) -> float:
    """Eq. 8 for one relative error, clamped to [min_s, max_s]."""
    if error > beta:
        period_s *= 1 - beta
    elif error < beta:
        period_s *= 1 + beta
    return min(max_s, max(min_s, period_s))


class ReoptPeriod:
    """The current period I_t, updated at the end of each period from (measured, predicted) pairs."""

    def __init__(self, initial_s: float, beta: float = 0.1, min_s: float = 5.0, max_s: float = 600.0) -> None:
        if not 0 < beta < 1:
            raise ValueError(f"reopt beta={beta!r}: must be in (0, 1)")
        if not 0 < min_s <= initial_s <= max_s:
            raise ValueError(f"reopt period {initial_s!r}: need 0 < min_s ({min_s}) <= it <= max_s ({max_s})")
        self.period_s, self.beta, self.min_s, self.max_s = initial_s, beta, min_s, max_s

    def update(self, metrics: Iterable[tuple[float, float]]) -> float:
        """End of a period: `metrics` are (M_real, M_est) pairs; returns the next period."""
        errors = [relative_error(real, est) for real, est in metrics]
        if errors:
            self.period_s = next_period(self.period_s, max(errors), self.beta, self.min_s, self.max_s)
        return self.period_s

    def due(self, now: float, last_run: float) -> bool:
        """Whether a period has passed since the last re-optimisation."""
        return now - last_run >= self.period_s
