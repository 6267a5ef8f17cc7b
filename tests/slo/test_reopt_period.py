"""SeaLLM Eq. 8: the re-optimisation period shrinks by (1 - beta) when the prediction missed by more
than beta, grows by (1 + beta) when it held, and stays within its bounds."""

from __future__ import annotations

import math

import pytest

from dlora.slo.reopt_period import ReoptPeriod, next_period, relative_error


def test_relative_error():
    assert relative_error(0.80, 1.0) == pytest.approx(0.2)
    assert relative_error(1.05, 1.0) == pytest.approx(0.05)
    assert relative_error(0.0, 0.0) == 0.0
    assert relative_error(0.5, 0.0) == math.inf


def test_eq8_shrinks_grows_and_keeps_at_exactly_beta():
    assert next_period(60.0, 0.2, beta=0.1, min_s=5, max_s=600) == pytest.approx(60 * 0.9)  # 54
    assert next_period(60.0, 0.05, beta=0.1, min_s=5, max_s=600) == pytest.approx(60 * 1.1)  # 66
    assert next_period(60.0, 0.1, beta=0.1, min_s=5, max_s=600) == 60.0
    assert next_period(590.0, 0.0, beta=0.1, min_s=5, max_s=600) == 600  # 649 clamped
    assert next_period(5.5, math.inf, beta=0.1, min_s=5, max_s=600) == 5  # 4.95 clamped


def test_period_follows_a_sequence_of_periods():
    p = ReoptPeriod(initial_s=60.0, beta=0.1, min_s=5.0, max_s=600.0)
    # attainment predicted 0.95, measured 0.95 (error 0); normalized latency 2.0 vs 1.6 (error 0.2)
    assert p.update([(0.95, 0.95), (1.6, 2.0)]) == pytest.approx(54.0)  # the worst metric decides
    assert p.update([(1.0, 1.0)]) == pytest.approx(54.0 * 1.1)  # 59.4
    assert p.update([(1.02, 1.0)]) == pytest.approx(54.0 * 1.1 * 1.1)  # 65.34
    assert p.update([]) == pytest.approx(65.34)  # nothing measured: unchanged
    assert p.due(now=100.0, last_run=34.0) and not p.due(now=100.0, last_run=35.0)  # 66 s vs 65 s since


@pytest.mark.parametrize(("kw"), [{"beta": 1.0}, {"beta": 0.0}, {"min_s": 100.0}, {"max_s": 10.0}, {"min_s": 0.0}])
def test_bad_settings_raise(kw):
    with pytest.raises(ValueError):
        ReoptPeriod(**{"initial_s": 60.0, **kw})
