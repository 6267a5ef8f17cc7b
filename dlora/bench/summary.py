"""The printed result block: `vllm bench serve`'s lines and layout, then dLoRA and per-adapter lines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dlora.bench.report import METRIC_NAMES, percentile_word

WIDTH = 50
MAX_ADAPTER_ROWS = 32


def _header(title: str, fill: str) -> str:
    return "{s:{c}^{n}}".format(s=title, c=fill, n=WIDTH)


def _line(label: str, value: Any, fmt: str = "") -> str:
    return "{:<40} {:<10{}}".format(label, value, fmt)


def format_result(result: dict[str, Any], percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    r = result
    lines = [_header(" Serving Benchmark Result ", "=")]
    if r.get("interrupted"):
        lines.append(_line("Interrupted (partial result):", "yes"))
    lines += [_line("Successful requests:", r["completed"]), _line("Failed requests:", r["failed"])]
    if r.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", r["max_concurrency"]))
    rate = r.get("request_rate", "inf")
    if rate not in ("inf", None) and not (isinstance(rate, float) and math.isinf(rate)):
        lines.append(_line("Request rate configured (RPS):", float(rate), ".2f"))
    lines += [
        _line("Benchmark duration (s):", r["duration"], ".2f"),
        _line("Total input tokens:", r["total_input_tokens"]),
        _line("Total generated tokens:", r["total_output_tokens"]),
        _line("Request throughput (req/s):", r["request_throughput"], ".2f"),
    ]
    if r.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", r["request_goodput"], ".2f"))
    lines += [
        _line("Output token throughput (tok/s):", r["output_throughput"], ".2f"),
        _line("Peak output token throughput (tok/s):", r["max_output_tokens_per_s"], ".2f"),
        _line("Peak concurrent requests:", float(r["max_concurrent_requests"]), ".2f"),
        _line("Total token throughput (tok/s):", r["total_token_throughput"], ".2f"),
    ]
    for key in percentile_metrics:
        short, title = METRIC_NAMES[key]
        lines.append(_header(title, "-"))
        lines.append(_line(f"Mean {short} (ms):", r[f"mean_{key}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", r[f"median_{key}_ms"], ".2f"))
        for p in percentiles:
            w = percentile_word(p)
            lines.append(_line(f"P{w} {short} (ms):", r[f"p{w}_{key}_ms"], ".2f"))
    lines.append(_header("Latency per Output Token (dLoRA)", "-"))
    lines.append(_line("Avg latency per output token (ms):", r["avg_latency_per_output_token_ms"], ".2f"))
    lines.append(_line("Mean normalized latency (ms/token):", r["mean_normalized_latency_ms"], ".2f"))
    lines.append(_line(f"SLO attainment @{r['slo_per_token_ms']:g}ms/token (%):", 100 * r["slo_attainment"], ".2f"))
    if r.get("adapter_slo"):
        lines += _adapter_slo_lines(r["adapter_slo"])
    per_adapter = r.get("per_adapter") or {}
    if len(per_adapter) > 1:
        lines += _adapter_table(per_adapter, percentiles, r.get("adapter_slo"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _ratio(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _adapter_slo_lines(slo: dict[str, Any]) -> list[str]:
    """The per-adapter SLO report (TTFT and TPOT targets from the server: adapter_slo.py)."""
    percent = None if slo["slo_attainment"] is None else 100 * slo["slo_attainment"]
    coldest = slo["slo_attainment_coldest_adapter"]
    lines = [
        _header("Per-adapter SLO (TTFT and TPOT)", "-"),
        _line("SLO attainment (%):", _ratio(percent, ".2f")),
        _line("Normalized latency (x isolated):", _ratio(slo["normalized_latency"], ".2f")),
    ]
    if slo["coldest_adapter"] is not None:
        lines.append(_line(f"SLO attainment, coldest {slo['coldest_adapter'][:16]} (%):", _ratio(100 * coldest, ".2f")))
    return lines


def _adapter_table(
    per_adapter: dict[str, dict], percentiles: Sequence[float], adapter_slo: dict[str, Any] | None = None
) -> list[str]:
    """A row per adapter, busiest first; with the SLO report, its attainment and normalized latency too."""
    p = percentile_word(percentiles[-1]) if percentiles else "99"
    slo_rows = (adapter_slo or {}).get("per_adapter") or {}
    lines = [_header("Per Adapter", "-")]
    head = (
        f"{'adapter':<20} {'ok':>5} {'fail':>4} {'mean TTFT':>10} {'P' + p + ' TTFT':>10} "
        f"{'mean TPOT':>10} {'ms/tok':>8} {'SLO %':>6}"
    )
    lines.append(head + (f" {'TTFT+TPOT %':>11} {'norm lat':>8}" if slo_rows else ""))
    rows = sorted(per_adapter.items(), key=lambda kv: -(kv[1]["completed"] + kv[1]["failed"]))
    for name, m in rows[:MAX_ADAPTER_ROWS]:
        p_ttft = m.get(f"p{p}_ttft_ms", float("nan"))
        row = (
            f"{name[:20]:<20} {m['completed']:>5} {m['failed']:>4} {m['mean_ttft_ms']:>10.2f} {p_ttft:>10.2f} "
            f"{m['mean_tpot_ms']:>10.2f} {m['avg_latency_per_output_token_ms']:>8.2f} {100 * m['slo_attainment']:>6.1f}"
        )
        if slo_rows:
            own = slo_rows.get(name) or {}
            attained = own.get("slo_attainment")
            row += f" {_ratio(None if attained is None else 100 * attained, '.1f'):>11}"
            row += f" {_ratio(own.get('normalized_latency'), '.2f'):>8}"
        lines.append(row)
    if len(rows) > MAX_ADAPTER_ROWS:
        lines.append(f"({len(rows) - MAX_ADAPTER_ROWS} more adapters in the JSON result under per_adapter)")
    return lines
