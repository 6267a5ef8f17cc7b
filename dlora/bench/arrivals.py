"""Arrival times: Poisson or Gamma renewal processes, optionally with a diurnal rate curve.

Inter-arrival gaps are Gamma(shape = 1/CV², scale = CV²/λ): mean 1/λ, coefficient of variation CV.
CV = 1 is Poisson, CV > 1 is burstier. `vllm bench serve --burstiness b` is the same process with
b = 1/CV² (its gamma shape), so `burstiness_to_cv` converts between the two.

Diurnal modulation follows λ(t) = λ̄·(1 + A·sin(2πt/T)). It is applied by time-warping a process
generated at the mean rate λ̄: a request at operational time u arrives at the real time t with
Λ(t)/λ̄ = u, where Λ(t) = λ̄·(t + A·T/(2π)·(1 − cos(2πt/T))) is the cumulative intensity.
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def burstiness_to_cv(burstiness: float) -> float:
    return 1.0 / math.sqrt(burstiness)


def cv_to_burstiness(cv: float) -> float:
    return 1.0 / (cv * cv)


def gamma_gaps(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """`n` inter-arrival gaps in seconds with mean 1/rate and coefficient of variation `cv`."""
    if not rate > 0:
        raise ValueError(f"rate={rate}: must be > 0")
    if not cv > 0:
        raise ValueError(f"cv={cv}: must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    shape = 1.0 / (cv * cv)
    return rng.gamma(shape, 1.0 / (rate * shape), size=n)


def diurnal_warp(times: np.ndarray, amplitude: float, period: float) -> np.ndarray:
    """Map arrival times of a constant-rate process onto the curve λ̄·(1 + A·sin(2πt/T))."""
    if amplitude == 0 or len(times) == 0:
        return times
    if not 0 <= amplitude < 1:
        raise ValueError(f"diurnal amplitude={amplitude}: must be in [0, 1)")
    if not period > 0:
        raise ValueError(f"diurnal period={period}: must be > 0")
    # u(t) = t + c·(1 − cos ωt) is increasing (u' = 1 + A sin ωt > 0) and u(t) >= t, so the
    # inverse on [0, max u] is found by interpolating on a grid of t over the same range.
    omega = 2 * math.pi / period
    c = amplitude / omega
    grid = np.linspace(0.0, float(times.max()), 200_001)
    u = grid + c * (1 - np.cos(omega * grid))
    return np.interp(times, u, grid)


def arrival_times(
    n: int,
    rate: float,
    rng: np.random.Generator,
    cv: float = 1.0,
    diurnal_amplitude: float = 0.0,
    diurnal_period: float | None = None,
) -> np.ndarray:
    """Arrival times (seconds from the start, first at the first gap) of one renewal process.

    `rate` = inf sends everything at t = 0, as `vllm bench serve` does.
    """
    if math.isinf(rate):
        return np.zeros(n)
    times = np.cumsum(gamma_gaps(n, rate, cv, rng))
    if diurnal_amplitude:
        times = diurnal_warp(times, diurnal_amplitude, diurnal_period or n / rate)
    return times


def merged_arrivals(
    rates: np.ndarray,
    n: int,
    rng: np.random.Generator,
    cv: float = 1.0,
    start: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """First `n` arrivals of independent per-adapter Gamma processes, merged by time.

    Adapter a runs at `rates[a]` (0 = silent) starting at `start`. Returns (times, adapter index).
    This is how dLoRA builds a workload: one process per adapter, merged with a heap.
    """
    active = [a for a, r in enumerate(rates) if r > 0]
    if not active:
        raise ValueError("every adapter has rate 0")
    heap = [(start + float(gamma_gaps(1, rates[a], cv, rng)[0]), a) for a in active]
    heapq.heapify(heap)
    times = np.empty(n)
    adapters = np.empty(n, dtype=np.int64)
    for i in range(n):
        t, a = heapq.heappop(heap)
        times[i], adapters[i] = t, a
        heapq.heappush(heap, (t + float(gamma_gaps(1, rates[a], cv, rng)[0]), a))
    return times, adapters
