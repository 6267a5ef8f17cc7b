"""Synthetic request lengths (prompt tokens, output tokens) from documented profiles.

Every profile is a pair of independent log-normals, except `uniform`. Means in tokens:

| profile         | mean in  | mean out | where the numbers come from                                     |
|-----------------|----------|----------|-----------------------------------------------------------------|
| `sharegpt-like` | 161      | 338      | ShareGPT after vLLM's filter (MuxServe); μ = 4.69 / 5.46, σ = 1 |
| `chat`          | 73.0     | 426.9    | SeaLLM Table 1, ShareGPT chatbot service                        |
| `summarization` | 13,186.8 | 21.1     | SeaLLM Table 1, LongBench                                       |
| `code`          | 156.5    | 66.9     | SeaLLM Table 1, HumanEval                                       |
| `uniform`       | 260      | 260      | S-LoRA synthetic: both uniform on [8, 512]                      |

The papers give only means; σ = 0.8 for `chat`, `summarization` and `code` is our assumption
(their μ = ln(mean) − σ²/2, so the mean before any cap is the documented one).

`sharegpt-like` (and ShareGPT data itself) is filtered like vLLM's ShareGPT loader: draws with
prompt < 4, output < 4, prompt > 1024 or prompt + output > 2048 are rejected and redrawn. Every
profile rejects prompt or output < 4. A length scale ratio then multiplies both lengths (dLoRA's
length stress test) and, if prompt + output exceeds `max_model_len`, both shrink in proportion
(a length fixed by the user stays as it is and only the other one shrinks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_LEN = 4
VLLM_MAX_PROMPT = 1024
VLLM_MAX_TOTAL = 2048


@dataclass(frozen=True)
class LengthProfile:
    name: str
    mean_input: float  # documented mean in tokens
    mean_output: float
    sigma: float = 0.8  # log-normal σ of both lengths (ignored by `uniform`)
    mu_input: float | None = None  # set to override the μ derived from the mean
    mu_output: float | None = None
    vllm_filter: bool = False  # reject as vLLM's ShareGPT loader does

    def mu(self, mean: float, override: float | None) -> float:
        return override if override is not None else math.log(mean) - self.sigma**2 / 2


PROFILES = {
    p.name: p
    for p in (
        LengthProfile("sharegpt-like", 161, 338, sigma=1.0, mu_input=4.69, mu_output=5.46, vllm_filter=True),
        LengthProfile("chat", 73.0, 426.9),
        LengthProfile("summarization", 13186.8, 21.1),
        LengthProfile("code", 156.5, 66.9),
        LengthProfile("uniform", 260, 260),
    )
}


def _draw(profile: LengthProfile, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if profile.name == "uniform":
        return rng.integers(8, 513, size=n), rng.integers(8, 513, size=n)
    mu_in = profile.mu(profile.mean_input, profile.mu_input)
    mu_out = profile.mu(profile.mean_output, profile.mu_output)
    lin = np.rint(rng.lognormal(mu_in, profile.sigma, size=n)).astype(np.int64)
    lout = np.rint(rng.lognormal(mu_out, profile.sigma, size=n)).astype(np.int64)
    return lin, lout


def accept_mask(lin: np.ndarray, lout: np.ndarray, vllm_filter: bool) -> np.ndarray:
    ok = (lin >= MIN_LEN) & (lout >= MIN_LEN)
    if vllm_filter:
        ok &= (lin <= VLLM_MAX_PROMPT) & (lin + lout <= VLLM_MAX_TOTAL)
    return ok


def sample_lengths(profile: LengthProfile | str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`n` accepted (prompt, output) token lengths from `profile`, by vectorised rejection."""
    if isinstance(profile, str):
        profile = PROFILES[profile]
    lin_parts, lout_parts, have = [], [], 0
    for _ in range(100):
        lin, lout = _draw(profile, max(2 * (n - have), 64), rng)
        ok = accept_mask(lin, lout, profile.vllm_filter)
        lin_parts.append(lin[ok])
        lout_parts.append(lout[ok])
        have += int(ok.sum())
        if have >= n:
            return np.concatenate(lin_parts)[:n], np.concatenate(lout_parts)[:n]
    raise ValueError(f"length profile {profile.name!r} rejects almost every draw")


def scale_lengths(
    lin: np.ndarray,
    lout: np.ndarray,
    ratio: float = 1.0,
    max_model_len: int | None = None,
    keep: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Multiply both lengths by `ratio`, then fit pairs over `max_model_len`.

    Pairs over the limit shrink in proportion (dLoRA's cap), except that `keep="output"` (or
    `"input"`) keeps that length as it is and shortens only the other one.
    """
    if not ratio > 0:
        raise ValueError(f"length scale ratio={ratio}: must be > 0")
    lin = np.maximum(1, np.rint(lin * ratio)).astype(np.int64)
    lout = np.maximum(1, np.rint(lout * ratio)).astype(np.int64)
    if max_model_len is None:
        return lin, lout
    over = lin + lout > max_model_len
    if keep == "output":
        lin[over] = np.maximum(1, max_model_len - lout[over])
    elif keep == "input":
        lout[over] = np.maximum(1, max_model_len - lin[over])
    else:
        shrink = max_model_len / (lin[over] + lout[over])
        lout[over] = np.maximum(1, np.floor(lout[over] * shrink)).astype(np.int64)
        lin[over] = np.maximum(1, max_model_len - lout[over])
    return lin, lout
