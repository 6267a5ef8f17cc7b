"""How many replicas the load needs: Aladdin's linear rule, a reactive term, hysteresis, cool-downs.

Aladdin sizes a cluster at each heartbeat as N = ceil(k * r + c) for an arrival rate r above a
floor (below it the sample is too small to trust: Aladdin's R). Here r is measured over the last
`rate_window_s` of heartbeats, and k is fitted online from what the replicas were measured to
serve: every heartbeat at which they were saturated (requests waited for a slot most of the
window) is a point (requests per second served, replicas) on the capacity frontier, and k is the
least-squares slope through the origin over those points (replicas per request/s); before any
point, `capacity_rps_prior` stands in (None: the rule is off until measured, and only the reactive
term scales). c is `extra_replicas`, set rather than fitted: an intercept fitted to a few
correlated points (the replica counts one ramp passes through) soaks up most of the load.

Requests served per second is the output tokens generated per second over the mean output length
of recently finished requests: counting completions instead would read a window in which long
requests are still running as a slow one.

The rule is planned with headroom (`target_utilization`): a replica planned full would miss its
SLOs on the next burst. The reactive term adds a replica whenever the last window's SLO attainment
fell below `min_attainment` or requests queued longer than `max_queue_wait_s`, whatever the rule
says: the rule learns from the past, the SLOs say what the clients see now.

Against flapping: a scale-out waits `scale_out_cooldown_s` after the previous change, a scale-in
`scale_in_cooldown_s` after any change and after the last pressure, goes one replica at a time, and
only when the rule fits in one replica fewer at `hysteresis` more load than measured (and, below
the floor, at the floor's rate: few arrivals may be a lull, not the load).

Pure: `Autoscaler.decide` reads a `LoadSample` (plain numbers a heartbeat measured) and returns a
`ScaleDecision`; the caller starts or drains replicas. `drain_choice` picks the replica whose work
is cheapest to move before it is removed. Its settings (`AutoscaleConfig`, the `cluster.autoscale`
section) are defined with the rest of the config tree, in dlora/config/.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from dlora.config import AutoscaleConfig


@dataclass(frozen=True, slots=True)
class LoadSample:
    """What one heartbeat measured over its window."""

    now: float
    window_s: float
    replicas: int  # serving (started and not draining)
    arrivals: int  # requests that arrived in the window
    completions: int  # requests that finished in the window
    tokens: int  # output tokens the replicas generated in the window
    finished_tokens: int  # output tokens of the requests that finished in the window
    saturated: bool  # requests waited for a slot most of the window: the replicas were full
    slo_attainment: float | None = None  # of the requests finished in the window; None: none finished
    mean_queue_wait_s: float | None = None  # of the requests admitted in the window


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    replicas: int  # the count to have; equal to the sample's: no change
    reason: str  # "", "min", "max", "rate", "slo", "queue", "idle"
    planned: int | None = None  # the linear rule's count (None: not enough data)


class CapacityLine:
    """N = k * r + c: k through the saturated heartbeats' (requests/s served, replicas) points."""

    def __init__(self, max_points: int, prior_rps: float | None, extra: int = 0) -> None:
        self._points: deque[tuple[float, int]] = deque(maxlen=max_points)
        self._prior = prior_rps
        self._extra = extra

    def observe(self, rate: float, replicas: int) -> None:
        if rate > 0 and replicas > 0:
            self._points.append((rate, replicas))

    def coefficients(self) -> tuple[float, float] | None:
        """(k, c), or None with neither a measured point nor a prior."""
        pts = list(self._points)
        if pts:  # least squares through the origin: k = sum(r n) / sum(r^2)
            return sum(r * n for r, n in pts) / sum(r * r for r, _ in pts), float(self._extra)
        return None if self._prior is None else (1.0 / self._prior, float(self._extra))

    def replicas_for(self, rate: float, utilization: float) -> int | None:
        kc = self.coefficients()
        if kc is None:
            return None
        k, c = kc
        return max(1, math.ceil(k * rate / utilization + c - 1e-9))


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self.line = CapacityLine(cfg.frontier_points, cfg.capacity_rps_prior, cfg.extra_replicas)
        self._last_change = -math.inf
        self._last_pressure = -math.inf
        self._recent: deque[tuple[float, int, float]] = deque()  # (heartbeat, arrivals, window) in rate_window_s
        self._finished: deque[tuple[int, int]] = deque(maxlen=cfg.frontier_points)  # (completions, their tokens)

    def decide(self, s: LoadSample) -> ScaleDecision:
        c = self.cfg
        self._finished.append((s.completions, s.finished_tokens))
        done = sum(n for n, _ in self._finished)
        if s.saturated and done >= c.min_finished:  # what full replicas serve is their capacity
            mean_output = max(1.0, sum(t for _, t in self._finished) / done)
            self.line.observe(s.tokens / s.window_s / mean_output, s.replicas)
        self._recent.append((s.now, s.arrivals, s.window_s))
        while len(self._recent) > 1 and self._recent[0][0] - self._recent[0][2] < s.now - c.rate_window_s - 1e-9:
            self._recent.popleft()  # its window began before the rate window
        arrivals = sum(a for _, a, _ in self._recent)
        span = sum(w for _, _, w in self._recent)
        rate, enough = arrivals / span, arrivals >= c.min_arrivals
        planned = self.line.replicas_for(rate, c.target_utilization) if enough else None
        slo_low = s.slo_attainment is not None and s.slo_attainment < c.min_attainment
        queue_long = s.mean_queue_wait_s is not None and s.mean_queue_wait_s > c.max_queue_wait_s
        if slo_low or queue_long:
            self._last_pressure = s.now
        n = s.replicas
        if n < c.min_replicas:
            return self._change(s, c.min_replicas, "min", planned)
        if n > c.max_replicas:
            return self._change(s, c.max_replicas, "max", planned)
        want, reason = n, ""
        if planned is not None and planned > n:
            want, reason = planned, "rate"
        if (slo_low or queue_long) and want <= n:
            want, reason = n + 1, "slo" if slo_low else "queue"
        want = min(want, c.max_replicas)
        if want > n:
            if s.now - self._last_change >= c.scale_out_cooldown_s:
                return self._change(s, want, reason, planned)
            return ScaleDecision(n, "", planned)
        if n > c.min_replicas and self._may_scale_in(s, max(rate, c.min_arrivals / span), arrivals):
            return self._change(s, n - 1, "rate" if enough else "idle", planned)
        return ScaleDecision(n, "", planned)

    def _may_scale_in(self, s: LoadSample, rate: float, arrivals: int) -> bool:
        c = self.cfg
        quiet = min(s.now - self._last_change, s.now - self._last_pressure)
        if quiet < c.scale_in_cooldown_s or s.saturated:
            return False
        if arrivals == 0:
            # Idle, whatever is fitted: on a slow machine the floor rate (min_arrivals per window)
            # alone can need every replica, and an idle cluster would then never shrink.
            return True
        need = self.line.replicas_for(rate * (1 + c.hysteresis), c.target_utilization)
        return need is not None and need <= s.replicas - 1  # nothing measured: idleness only

    def _change(self, s: LoadSample, to: int, reason: str, planned: int | None) -> ScaleDecision:
        if to != s.replicas:
            self._last_change = s.now
        return ScaleDecision(to, reason, planned)


@dataclass(frozen=True, slots=True)
class DrainCost:
    """What removing one replica would move: its queued requests cost a resubmission each, its
    running ones a recompute of their context (prompt + generated tokens) on the receiver."""

    replica_id: int
    queued: int
    running_context_tokens: int


def drain_choice(costs: Sequence[DrainCost]) -> int:
    """The replica whose work is cheapest to move (recompute tokens, then queued requests); the
    newest (highest id) on a tie, so the longest-lived replicas, with their caches, stay."""
    if not costs:
        raise ValueError("no replica to drain")
    return min(costs, key=lambda d: (d.running_context_tokens, d.queued, -d.replica_id)).replica_id
