"""Algorithm 2: adaptive tuning of the switching thresholds alpha and beta at break points.

A *period* runs from one break point to the next and has one mode and one merge candidate
R_merge. Break points (§4.2): a mode switch, a change of R_merge's adapter, or `N` observed
iterations. At a break point the threshold of the period's mode is tuned from its samples:

    period unmerged (tunes alpha): B'_i = the FCFS batches that ran, B_i = R_merge[:max_bs]
    period merged   (tunes beta):  B_i  = the merged batches that ran, B'_i = the FCFS batches
    T_merge   = Σ|B_i|  / (Σ IterationTime(B_i) + t_M)
    T_unmerge = Σ|B'_i| / Σ IterationTime(B'_i)
    T_merge > T_unmerge  ->  threshold -= gamma_dec      (merge sooner / stay merged longer)
    otherwise            ->  threshold *= gamma_mul      (merge later / unmerge sooner)

The batches that ran use their measured compute time; the other mode's batches are estimated by
`IterationTimeModel`. t_M is the current switching-cost estimate (measured, seconds). The paper
gives only the alpha rule and says beta is "similar"; we apply the same rule, in the same
direction, to beta. alpha stays in [beta + gap, 1], beta in [THRESHOLD_MIN, alpha - gap].

Which merged steps tune beta (our choice, not in the paper): beta decides whether to *stay* merged
while other requests wait, so without mixing only the merged steps that held a request back
(B'_i larger than B_i) are counted. A merged step with nobody waiting runs the same batch either
way, merged always wins it, and counting such steps drove beta down to its floor after a few lone
merges (traced in the skew benchmark: beta 0.05 at 90% skew, 0.3-0.5 at uniform popularity), so a
later merge held every newly arrived request of another adapter until it starved. A merged period
without a held-back step leaves beta where it is. With mixing (`mixed_merged`) a merged step runs
B_fcfs like an unmerged one, and every step counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlora.scheduling.config import THRESHOLD_MAX, THRESHOLD_MIN, BatchingConfig
from dlora.scheduling.iteration_time import IterationTimeModel
from dlora.scheduling.types import Mode


@dataclass(frozen=True, slots=True)
class PeriodSample:
    """One observed step: what ran, how long it took, and what the other mode would have run."""

    mode: Mode
    ran: int  # requests that ran (|B_i| when merged, |B'_i| when unmerged)
    seconds: float  # measured compute seconds, switch excluded
    alternative: int  # size of the other mode's batch (|B'_i| = |B_fcfs| or |B_i| = |R_merge[:max_bs]|)


@dataclass(frozen=True, slots=True)
class TuneResult:
    period_mode: Mode
    iterations: int
    t_merge: float  # requests per second
    t_unmerge: float
    threshold: str  # "alpha" or "beta"
    old: float
    new: float


def period_throughputs(
    samples: list[PeriodSample],
    mode: Mode,
    cost: IterationTimeModel,
    switch_cost: float,
    held_back_only: bool = False,
) -> tuple[float, float] | None:
    """(T_merge, T_unmerge) of Alg. 2 lines 4–5 for a period in `mode`; None if not computable.
    `held_back_only`: a merged period counts only the steps that held requests back (NOTE above)."""
    used = [
        s
        for s in samples
        if s.mode is mode
        and s.ran > 0
        and s.alternative > 0
        and not (held_back_only and mode is Mode.MERGED and s.alternative <= s.ran)
    ]
    if not used:
        return None
    other = Mode.UNMERGED if mode is Mode.MERGED else Mode.MERGED
    estimates = [cost.estimate(other, s.alternative) for s in used]
    known = [e for e in estimates if e is not None]
    if len(known) < len(estimates):
        return None
    ran, ran_time = sum(s.ran for s in used), sum(s.seconds for s in used)
    alt, alt_time = sum(s.alternative for s in used), sum(known)
    if mode is Mode.MERGED:
        merge_n, merge_t, unmerge_n, unmerge_t = ran, ran_time + switch_cost, alt, alt_time
    else:
        merge_n, merge_t, unmerge_n, unmerge_t = alt, alt_time + switch_cost, ran, ran_time
    if merge_t <= 0 or unmerge_t <= 0:
        return None
    return merge_n / merge_t, unmerge_n / unmerge_t


class AdaptiveThresholds:
    """alpha/beta plus the current period's samples; `record` handles the break points."""

    def __init__(self, config: BatchingConfig, cost: IterationTimeModel) -> None:
        self.alpha, self.beta = config.alpha, config.beta
        self.gamma_dec, self.gamma_mul = config.gamma_dec, config.gamma_mul
        self.held_back_only = not config.mixed_merged  # which merged steps tune beta (NOTE)
        self.gap, self.period = config.min_threshold_gap, config.break_period_iters
        self.cost = cost
        self.samples: list[PeriodSample] = []
        self.mode: Mode | None = None  # the current period's mode
        self.candidate: str | None = None  # the current period's R_merge adapter
        self.history: list[TuneResult] = []  # every tuning, for logs and tests

    def record(self, sample: PeriodSample, candidate: str | None, switch_cost: float) -> TuneResult | None:
        """Add one step; tune first if it starts a new period, and after N steps of a period."""
        result = None
        if self.samples and (sample.mode is not self.mode or candidate != self.candidate):
            result = self.break_point(switch_cost)
        self.mode, self.candidate = sample.mode, candidate
        self.samples.append(sample)
        if len(self.samples) >= self.period:
            result = self.break_point(switch_cost) or result
        return result

    def break_point(self, switch_cost: float) -> TuneResult | None:
        """Tune the current period's threshold from its samples and start a new period."""
        samples, mode = self.samples, self.mode
        self.samples = []
        if not samples or mode is None:
            return None
        tput = period_throughputs(samples, mode, self.cost, switch_cost, self.held_back_only)
        if tput is None:
            return None
        merged_wins = tput[0] > tput[1]
        if mode is Mode.UNMERGED:
            old = self.alpha
            self.alpha = self._tuned(old, merged_wins, self.beta + self.gap, THRESHOLD_MAX)
            result = TuneResult(mode, len(samples), *tput, "alpha", old, self.alpha)
        else:
            old = self.beta
            self.beta = self._tuned(old, merged_wins, THRESHOLD_MIN, self.alpha - self.gap)
            result = TuneResult(mode, len(samples), *tput, "beta", old, self.beta)
        self.history.append(result)
        return result

    def _tuned(self, value: float, merged_wins: bool, low: float, high: float) -> float:
        value = value - self.gamma_dec if merged_wins else value * self.gamma_mul
        return min(max(value, low), high)
