"""Arrival processes: mean rate and CV of Gamma gaps, diurnal modulation, merged per-adapter streams."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlora.bench.arrivals import (
    arrival_times,
    burstiness_to_cv,
    cv_to_burstiness,
    diurnal_warp,
    gamma_gaps,
    merged_arrivals,
)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_gaps_rate_and_cv(cv):
    # Tolerances for 50,000 gaps with seed 7: mean within 5 %, CV within 5 % (CV 4 has a heavy
    # tail: shape 1/16, so its sample CV converges more slowly; 8 % there).
    gaps = gamma_gaps(50_000, rate=4.0, cv=cv, rng=np.random.default_rng(7))
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08 if cv > 2 else 0.05)


def test_burstiness_is_gamma_shape():
    assert burstiness_to_cv(1.0) == 1.0
    assert burstiness_to_cv(0.25) == pytest.approx(2.0)
    assert cv_to_burstiness(2.0) == pytest.approx(0.25)


def test_infinite_rate_sends_everything_at_zero():
    assert arrival_times(5, math.inf, np.random.default_rng(0)).tolist() == [0.0] * 5


def test_arrival_times_scale_with_rate():
    a = arrival_times(100, 2.0, np.random.default_rng(3), cv=2.0)
    b = arrival_times(100, 8.0, np.random.default_rng(3), cv=2.0)
    assert np.allclose(a / 4, b)


def test_diurnal_warp_follows_the_sine():
    # 40,000 Poisson arrivals at mean rate 100/s over T = 400 s with A = 0.8: the first half of the
    # period (sin > 0) must hold (1 + 2A/π)/2 = 75.5 % of the arrivals; check within 1.5 points.
    n, rate, A = 40_000, 100.0, 0.8
    t = arrival_times(n, rate, np.random.default_rng(11), diurnal_amplitude=A, diurnal_period=n / rate)
    assert np.all(np.diff(t) >= 0)
    first_half = np.mean(t < n / rate / 2)
    assert first_half == pytest.approx((1 + 2 * A / math.pi) / 2, abs=0.015)
    assert t[-1] == pytest.approx(n / rate, rel=0.02)  # the mean rate is kept


def test_diurnal_warp_identity_without_amplitude():
    t = np.array([0.5, 1.0, 2.0])
    assert diurnal_warp(t, 0.0, 10.0) is t


def test_merged_arrivals_shares_and_rate():
    rates = np.array([6.0, 3.0, 1.0, 0.0])
    times, idx = merged_arrivals(rates, 20_000, np.random.default_rng(5), cv=2.0)
    assert np.all(np.diff(times) >= 0)
    shares = np.bincount(idx, minlength=4) / len(idx)
    assert np.allclose(shares, [0.6, 0.3, 0.1, 0.0], atol=0.015)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.05)
