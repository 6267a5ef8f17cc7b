"""Adapter popularity: which adapter each request goes to.

Modes, each named after the harness or paper that uses it:

- `uniform`: 1/N, drawn independently per request.
  Source: vLLM `--lora-assignment random`, SGLang `uniform`.
- `distinct`: 1/N, assigned round-robin (consecutive requests differ).
  Source: Punica "Distinct", SGLang `distinct`, vLLM `round-robin`.
- `skewed`: ∝ α^(−a): adapter a gets α× the requests of adapter a+1.
  Source: SGLang/Punica `skewed` with `--lora-zipf-alpha` (default 1.5).
- `zipf`: ∝ (a+1)^(−α).
  Source: MuxServe power law (α 0.9 ≈ top 20 % get 50 %).
- `powerlaw`: ((a+1)/N)^α − (a/N)^α, i.e. ⌊N·X⌋ with X ~ `np.random.power(α)`.
  Source: S-LoRA (α = 1 is uniform, smaller is more skewed).
- `stride`: Zipf(α) over `num_functions` sorted functions, function k → adapter (k // s) mod N.
  Source: dLoRA's map stride on a synthetic function set.

Trace replay (dLoRA's per-interval popularity from an Azure Functions CSV) lives in `trace.py`.
"""

from __future__ import annotations

import numpy as np

POPULARITY_MODES = ("uniform", "distinct", "skewed", "zipf", "powerlaw", "stride")

# The α each mode uses when none is given: the default of the harness the mode comes from.
DEFAULT_ALPHA = {"skewed": 1.5, "zipf": 0.9, "powerlaw": 1.0, "stride": 1.0}


def zipf_weights(n: int, alpha: float) -> np.ndarray:
    """Normalised (k+1)^(−α) for k < n."""
    w = np.arange(1, n + 1, dtype=np.float64) ** (-alpha)
    return w / w.sum()


def stride_mapping(num_functions: int, num_adapters: int, stride: int) -> np.ndarray:
    """dLoRA's map stride: the function of popularity rank k goes to adapter (k // stride) mod N.

    stride 1 spreads the hottest functions over all adapters; a large stride puts the `stride`
    hottest functions all on adapter 0, the next `stride` on adapter 1, and so on.
    """
    return (np.arange(num_functions) // stride) % num_adapters


def popularity_shares(
    mode: str,
    num_adapters: int,
    alpha: float | None = None,
    stride: int = 1,
    num_functions: int | None = None,
) -> np.ndarray:
    """The expected fraction of requests each adapter receives (sums to 1)."""
    n = num_adapters
    if n < 1:
        raise ValueError(f"num_adapters={n}: must be >= 1")
    if mode not in POPULARITY_MODES:
        raise ValueError(f"popularity mode {mode!r}: must be one of {', '.join(POPULARITY_MODES)}")
    a = DEFAULT_ALPHA.get(mode, 1.0) if alpha is None else alpha
    if a <= 0:
        raise ValueError(f"alpha={a}: must be > 0")
    if mode in ("uniform", "distinct"):
        return np.full(n, 1.0 / n)
    if mode == "skewed":
        w = a ** (-np.arange(n, dtype=np.float64))
        return w / w.sum()
    if mode == "zipf":
        return zipf_weights(n, a)
    if mode == "powerlaw":
        edges = (np.arange(n + 1) / n) ** a
        return np.diff(edges)
    if stride < 1:
        raise ValueError(f"stride={stride}: must be >= 1")
    num_functions = num_functions or 16 * n * stride
    function_shares = zipf_weights(num_functions, a)
    return np.bincount(stride_mapping(num_functions, n, stride), weights=function_shares, minlength=n)


def assign_adapters(
    mode: str,
    num_requests: int,
    num_adapters: int,
    rng: np.random.Generator,
    alpha: float | None = None,
    stride: int = 1,
    num_functions: int | None = None,
) -> np.ndarray:
    """Adapter index (0..N-1) of each of `num_requests` consecutive requests."""
    if mode == "distinct":
        return np.arange(num_requests) % num_adapters
    shares = popularity_shares(mode, num_adapters, alpha, stride, num_functions)
    return rng.choice(num_adapters, size=num_requests, p=shares)
