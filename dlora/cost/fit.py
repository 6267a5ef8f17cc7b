"""The one fitting routine of dlora's step-time estimates: non-negative, ridge-pulled least squares.

Given the weighted normal equations of measured steps, Σ w·x·xᵀ and Σ w·x·t over feature vectors
x (1, prompt tokens, sequences, or a subset) and seconds t, and optionally a prior θ₀ with a pull
λ per coefficient, it returns

    argmin over θ >= 0 of  Σ w·(xᵀθ - t)² + Σ λᵢ·(θᵢ - θ₀ᵢ)²

Why a constrained minimum and not the unconstrained solution clamped at 0: a negative
per-sequence cost set to 0 keeps the fixed cost that compensated for it, and decode steps are then
priced at up to twice their time. Why a pull toward a prior: steps often all have one batch size
or no prompt tokens, which leaves the plain equations singular; the prior then decides how the
time splits, while directions the data determines are fitted as plain least squares.

Callers accumulate the sums their own way (decayed, windowed, relative-error weighted), which is
where their fits differ and why (`dlora.cost` lists them).
"""

from __future__ import annotations

from collections.abc import Sequence

Matrix = Sequence[Sequence[float]]


def solve(m: Matrix, v: Sequence[float]) -> list[float] | None:
    """Solve the square system m·x = v (Gaussian elimination, partial pivoting); None if singular."""
    n = len(v)
    a = [list(row) + [rhs] for row, rhs in zip(m, v)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-15:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def nonnegative_minimum(m: Matrix, v: Sequence[float]) -> list[float] | None:
    """argmin over x >= 0 of xᵀ·m·x - 2·vᵀ·x (m positive definite): every subset of the
    coefficients left free, the others held at 0, the best solution that stays >= 0; None when
    no subset is solvable."""
    n = len(v)
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 2**n):
        free = [i for i in range(n) if mask >> i & 1]
        sub = solve([[m[i][j] for j in free] for i in free], [v[i] for i in free])
        if sub is None or min(sub) < 0:
            continue
        x = [0.0] * n
        for i, value in zip(free, sub):
            x[i] = value
        objective = sum(x[i] * m[i][j] * x[j] for i in range(n) for j in range(n)) - 2 * sum(
            a * b for a, b in zip(v, x)
        )
        if best is None or objective < best[0]:
            best = (objective, x)
    return None if best is None else best[1]


def fit_nonnegative(
    xx: Matrix, xt: Sequence[float], prior: Sequence[float] | None = None, pull: Sequence[float] | None = None
) -> list[float] | None:
    """The coefficients θ >= 0 that minimise the weighted squared error of the steps summed in
    `xx` (Σ w·x·xᵀ) and `xt` (Σ w·x·t), plus `pull`ᵢ·(θᵢ - `prior`ᵢ)²; None if undetermined."""
    n = len(xt)
    lam = list(pull) if pull is not None else [0.0] * n
    theta0 = list(prior) if prior is not None else [0.0] * n
    m = [[xx[i][j] + (lam[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
    v = [xt[i] + lam[i] * theta0[i] for i in range(n)]
    return nonnegative_minimum(m, v)
