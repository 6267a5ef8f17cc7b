"""Order statistics of benchmark samples, one definition for every script."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def percentile(values: Sequence[float] | np.ndarray, q: float, method: str = "linear") -> float | None:
    """The `q`-th percentile (0-100) of `values`; None when there are none.

    `method` is numpy's: "linear" interpolates between the two nearest samples, "nearest" returns
    the sample whose rank is nearest (always an observed value)."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method=method))  # type: ignore[call-overload]


def medians(runs: Mapping[str, Sequence[Mapping[str, float]]], keys: Iterable[str]) -> dict[str, dict[str, float]]:
    """Per system, the median over its runs of each of `keys`."""
    keys = tuple(keys)
    return {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
