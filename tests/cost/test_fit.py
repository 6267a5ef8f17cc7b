"""dlora.cost.fit: the non-negative, ridge-pulled least squares every step-time estimate uses."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dlora.cost.fit import fit_nonnegative, nonnegative_minimum, solve


def test_nonnegative_minimum_is_constrained_not_clamped():
    # minimise |x - (1, -1, 2)|² over x >= 0 (m = identity): the negative coordinate goes to 0.
    assert nonnegative_minimum([[1, 0, 0], [0, 1, 0], [0, 0, 1]], [1, -1, 2]) == pytest.approx([1, 0, 2])
    # Coupled: m = [[2, 1, 0], [1, 1, 0], [0, 0, 1]]. With v = (1, 1, 0) the free minimum (0, 1, 0)
    # is feasible. With v = (0, 1, 0) it is (-1, 2, 0); held at x0 = 0, x1² - 2·x1 is least at
    # x1 = 1, where clamping the free minimum would give x1 = 2.
    m = [[2.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    assert nonnegative_minimum(m, [1.0, 1.0, 0.0]) == pytest.approx([0.0, 1.0, 0.0])
    assert nonnegative_minimum(m, [0.0, 1.0, 0.0]) == pytest.approx([0.0, 1.0, 0.0])


def test_solve_matches_numpy_and_reports_singular_systems():
    rng = random.Random(3)
    m = [[rng.uniform(-1, 1) for _ in range(3)] for _ in range(3)]
    v = [rng.uniform(-1, 1) for _ in range(3)]
    assert solve(m, v) == pytest.approx(list(np.linalg.solve(np.array(m), np.array(v))))
    assert solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None


def test_exact_data_is_recovered_and_the_prior_decides_only_undetermined_directions():
    # Steps t = 0.02 + 0.003·n at two batch sizes: the line is determined, the pull barely moves it.
    rows = [(1.0, n) for n in (4, 4, 16, 16)]
    t = [0.02 + 0.003 * n for _, n in rows]
    xx = [[sum(r[i] * r[j] for r in rows) for j in range(2)] for i in range(2)]
    xt = [sum(r[i] * s for r, s in zip(rows, t)) for i in range(2)]
    assert fit_nonnegative(xx, xt) == pytest.approx([0.02, 0.003])
    assert fit_nonnegative(xx, xt, prior=[1.0, 1.0], pull=[1e-9, 1e-9]) == pytest.approx([0.02, 0.003], rel=1e-4)
    # One batch size only (four steps of 8 sequences, 0.1 s each): the split is undetermined.
    # Without a prior some split that meets the step is returned; with one, the prior's split.
    one = [[4.0, 32.0], [32.0, 256.0]]
    a, b = fit_nonnegative(one, [0.4, 3.2]) or [0.0, 0.0]
    assert a + 8 * b == pytest.approx(0.1)
    a, b = fit_nonnegative(one, [0.4, 3.2], prior=[0.05, 0.00625], pull=[1e-3, 1e-3]) or [0.0, 0.0]
    assert a + 8 * b == pytest.approx(0.1, rel=1e-3) and a == pytest.approx(0.05, rel=1e-2)


def test_a_falling_line_is_fitted_flat_not_clamped():
    # Times that fall with the batch: the best line with a slope >= 0 is flat at the mean time,
    # where clamping the free fit's negative slope would keep its too-high intercept.
    rows = [(1.0, n) for n in (2, 8)]
    t = [0.2, 0.1]
    xx = [[sum(r[i] * r[j] for r in rows) for j in range(2)] for i in range(2)]
    xt = [sum(r[i] * s for r, s in zip(rows, t)) for i in range(2)]
    assert fit_nonnegative(xx, xt) == pytest.approx([0.15, 0.0])
