"""Benchmark metrics from per-request results; key names follow `vllm bench serve`'s JSON.

Definitions (all over successful requests unless stated; times in ms in the output):
- TTFT, E2EL (= `latency`), ITL (every gap of every request pooled) as mean/median/std/P{p};
- TPOT per request = (E2EL − TTFT) / (output tokens − 1), for requests with > 1 output token;
- request/output/total-token throughput = count / benchmark duration;
- goodput (`--goodput ttft:MS tpot:MS e2el:MS`, DistServe) = requests meeting every given SLO
  per second; a request with one output token has TPOT 0 for this test, as in vLLM;
- peak output throughput / peak concurrent requests: the busiest one-second bucket;
- dLoRA's average latency per output token = Σ E2EL / Σ output tokens
  (`avg_latency_per_output_token_ms`), and the mean-of-ratios form used by vLLM's old
  benchmark, mean(E2EL / output tokens) (`mean_normalized_latency_ms`);
- SLO attainment = requests with E2EL / output tokens <= the per-token SLO, divided by all
  requests sent (failed ones count as misses). dLoRA's SLO is 500 ms per token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dlora.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
DLORA_SLO_PER_TOKEN_MS = 500.0


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def stats_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean/median/std/P{p} of `values_s` (seconds) in ms, keyed like `mean_ttft_ms`; 0 when empty."""
    v = np.asarray(values_s, dtype=np.float64) * 1000 if len(values_s) else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(np.mean(v)),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(np.std(v)),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def tpot(r: RequestResult) -> float | None:
    if r.output_tokens <= 1:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def meets_goodput(r: RequestResult, goodput_ms: dict[str, float]) -> bool:
    measured = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(measured[k] * 1000 <= slo for k, slo in goodput_ms.items())


def peak_load(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """(most output tokens in one second, concurrent requests in the busiest second)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    n = int(math.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens, concurrent = np.zeros(n), np.zeros(n)
    for r in ok:
        token_times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(tokens, np.clip((token_times - t0).astype(int), 0, n - 1), 1)
        concurrent[int(r.start_time - t0) : int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(concurrent.max())


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    goodput_ms: dict[str, float] | None = None,
    slo_per_token_ms: float = DLORA_SLO_PER_TOKEN_MS,
) -> dict[str, float | int | None]:
    """Aggregate metrics of `results` over a run of `duration_s` seconds."""
    ok = [r for r in results if r.success]
    duration_s = max(duration_s, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_token = [r.latency / r.output_tokens for r in ok if r.output_tokens > 0]
    met = sum(1 for x in per_token if x * 1000 <= slo_per_token_ms)
    peak_tokens, peak_concurrency = peak_load(ok)
    m: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (sum(meets_goodput(r, goodput_ms) for r in ok) / duration_s if goodput_ms else None),
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    m |= stats_ms("ttft", [r.ttft for r in ok], percentiles)
    m |= stats_ms("tpot", [t for r in ok if (t := tpot(r)) is not None], percentiles)
    m |= stats_ms("itl", [x for r in ok for x in r.itl], percentiles)
    m |= stats_ms("e2el", [r.latency for r in ok], percentiles)
    m["slo_per_token_ms"] = slo_per_token_ms
    m["slo_attainment"] = met / len(results) if results else 0.0
    m["avg_latency_per_output_token_ms"] = 1000 * sum(r.latency for r in ok) / total_out if total_out else 0.0
    m["mean_normalized_latency_ms"] = 1000 * float(np.mean(per_token)) if per_token else 0.0
    return m


def per_adapter_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (99,),
    goodput_ms: dict[str, float] | None = None,
    slo_per_token_ms: float = DLORA_SLO_PER_TOKEN_MS,
) -> dict[str, dict]:
    """`compute_metrics` per adapter (the base model is keyed by its request `adapter` None → "")."""
    groups: dict[str, list[RequestResult]] = {}
    for r in results:
        groups.setdefault(r.adapter or "", []).append(r)
    out = {}
    for name in sorted(groups):
        m = compute_metrics(groups[name], duration_s, percentiles, goodput_ms, slo_per_token_ms)
        m["share"] = len(groups[name]) / len(results)
        out[name] = m
    return out
