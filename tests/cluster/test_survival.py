"""Kaplan-Meier output lengths: hand-worked curves, quantiles, and a large censored sample checked
against the distribution it was drawn from."""

from __future__ import annotations

import random

import pytest

from dlora.cluster.estimators.survival import UNBOUNDED, quantile_lengths, survival


def test_survival_steps_down_at_each_end_over_the_requests_still_at_risk():
    obs = [(2, True), (3, False), (5, True), (5, False), (8, True)]
    # t=2: 1 of 5 ends -> 0.8. The one censored at 3 leaves. t=5: 1 of 3 ends (the one censored at
    # 5 was still at risk) -> 0.8 * 2/3. t=8: the last one at risk ends -> 0.
    curve = survival(obs)
    assert [t for t, _ in curve] == [2, 5, 8]
    assert [s for _, s in curve] == pytest.approx([0.8, 0.8 * 2 / 3, 0.0])


def test_without_censoring_the_quantiles_are_the_sample_itself():
    obs = [(n, True) for n in (40, 10, 30, 20)]
    assert quantile_lengths(obs, n=8) == [10, 10, 20, 20, 30, 30, 40, 40]


def test_the_mass_past_every_end_seen_is_unbounded():
    # Two short stops and two cap hits: half of the lines run past anything seen to end.
    obs = [(10, True), (10, True), (256, False), (256, False)]
    assert quantile_lengths(obs, n=4) == [10, 10, UNBOUNDED, UNBOUNDED]
    assert quantile_lengths([(7, False)], n=3) == [UNBOUNDED] * 3  # nothing has ended yet
    assert quantile_lengths([], n=3) == []


def test_running_requests_shift_the_estimate_toward_long_lengths():
    # Counted as ends at their length so far, the running ones would look like short stops;
    # censored, they only say "longer than this", and the estimate keeps the long mode.
    finished = [(5, True)] * 10 + [(12, True)] * 10
    running = [(30, False)] * 20
    naive = quantile_lengths(finished, n=100)
    censored = quantile_lengths(finished + running, n=100)
    assert sum(naive) / 100 == pytest.approx(8.5)
    assert censored.count(UNBOUNDED) == 50  # half the mass: the running half, still unseen


def test_a_heavily_censored_sample_recovers_the_distribution_it_was_drawn_from():
    # Geometric lengths (mean 50) observed up to a random cutoff each (a cap or a moment mid-run):
    # about 40% are censored. The estimate's survival matches the true one; the lengths taken as
    # they are put the median far too low.
    rng = random.Random(0)
    p = 1 / 50
    obs = []
    for _ in range(4000):
        length = 1
        while rng.random() > p:
            length += 1
        cutoff = rng.randint(1, 100)
        obs.append((min(length, cutoff), length <= cutoff))
    assert 0.3 < sum(not e for _, e in obs) / len(obs) < 0.6
    curve = dict(survival(obs))
    for t in (10, 25, 50, 100):
        at = max(s for s in curve if s <= t)
        assert curve[at] == pytest.approx((1 - p) ** at, abs=0.03)
    naive_median = sorted(n for n, _ in obs)[len(obs) // 2]
    km = quantile_lengths(obs, n=101)
    true_median = 34  # (1 - 1/50) ** 34 ~ 0.503
    assert abs(km[50] - true_median) <= 3
    assert naive_median < 0.8 * true_median
