"""Order statistics every benchmark script shares (dlora/bench/stats.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dlora.bench.stats import medians, percentile


def test_percentile_interpolates_between_the_nearest_samples():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile(np.array([10.0, 20.0, 30.0]), 25) == pytest.approx(15.0)


def test_nearest_percentile_is_an_observed_sample_of_the_rounded_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    # rank (n - 1) q / 100: 4 x 0.40 = 1.6 rounds to 2, the third smallest; 4 x 0.35 = 1.4 to 1
    assert percentile(values, 40, method="nearest") == 3.0
    assert percentile(values, 35, method="nearest") == 2.0
    assert percentile([0.1, 0.7, 0.3], 60, method="nearest") == 0.3
    rng = np.random.default_rng(0)
    for n in range(1, 40):
        xs = sorted(rng.random(n).tolist())
        for q in (50, 90, 99):
            assert percentile(xs, q, method="nearest") == xs[round(q / 100 * (n - 1))]


def test_percentile_of_no_samples_is_none():
    assert percentile([], 50) is None
    assert percentile(np.array([]), 99, method="nearest") is None


def test_medians_per_system_over_its_runs():
    runs = {"a": [{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": 7.0}, {"x": 2.0, "y": 9.0}], "b": [{"x": 4.0, "y": 0.0}]}
    assert medians(runs, ("x",)) == {"a": {"x": 2.0}, "b": {"x": 4.0}}
    assert medians(runs, iter(("x", "y")))["a"] == {"x": 2.0, "y": 7.0}
