"""Report arithmetic against hand-computed cases."""

from __future__ import annotations

import pytest

from dlora.bench.client import RequestResult
from dlora.bench.report import compute_metrics, per_adapter_metrics, tpot
from dlora.bench.summary import format_result


def _r(adapter, ttft, itl, out, prompt=10, start=0.0, ok=True):
    latency = ttft + sum(itl)
    return RequestResult(
        request_id=f"{adapter}-{start}",
        adapter=adapter,
        prompt_len=prompt,
        success=ok,
        output_tokens=out if ok else 0,
        ttft=ttft if ok else 0.0,
        itl=list(itl) if ok else [],
        latency=latency if ok else 0.0,
        start_time=start,
        error="" if ok else "HTTP 500: boom",
    )


# Three successful requests and one failure, over a 2 s run:
#   A: ttft 0.1, itl [0.1, 0.1, 0.1] -> out 4, e2el 0.4, tpot 0.1,   per-token 0.1
#   B: ttft 0.2, itl [0.3]           -> out 2, e2el 0.5, tpot 0.3,   per-token 0.25
#   C: ttft 0.5, itl []              -> out 1, e2el 0.5, tpot none,  per-token 0.5
#   D: failed
RESULTS = [
    _r("a", 0.1, [0.1, 0.1, 0.1], 4, prompt=10, start=0.0),
    _r("b", 0.2, [0.3], 2, prompt=20, start=0.2),
    _r("a", 0.5, [], 1, prompt=30, start=1.2),
    _r("b", 0, [], 0, ok=False, start=1.5),
]


def test_overall_metrics_by_hand():
    m = compute_metrics(RESULTS, duration_s=2.0, percentiles=(50, 99), slo_per_token_ms=300)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 60 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(33.5)
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 300)  # linear interpolation between 200 and 500
    assert m["mean_tpot_ms"] == pytest.approx(200)  # (100 + 300) / 2; C has one token, no TPOT
    assert m["mean_itl_ms"] == pytest.approx(150)  # pooled gaps 100, 100, 100, 300
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["mean_e2el_ms"] == pytest.approx(1400 / 3)
    assert m["std_e2el_ms"] == pytest.approx(47.1404520791, rel=1e-6)
    # dLoRA: Σ latency / Σ tokens = 1.4 / 7 = 200 ms; mean of ratios = (100 + 250 + 500) / 3
    assert m["avg_latency_per_output_token_ms"] == pytest.approx(200)
    assert m["mean_normalized_latency_ms"] == pytest.approx(850 / 3)
    # SLO 300 ms/token: A (100) and B (250) meet it, C (500) misses, D failed -> 2/4
    assert m["slo_attainment"] == pytest.approx(0.5)
    assert m["request_goodput"] is None


def test_goodput_by_hand():
    # ttft <= 250 ms and tpot <= 150 ms: A passes, B fails tpot (300), C fails ttft (500).
    m = compute_metrics(RESULTS, 2.0, goodput_ms={"ttft": 250, "tpot": 150})
    assert m["request_goodput"] == pytest.approx(0.5)
    # e2el <= 500 ms: all three successes pass -> 1.5 req/s; C's one-token TPOT counts as 0.
    assert compute_metrics(RESULTS, 2.0, goodput_ms={"e2el": 500, "tpot": 1})["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(RESULTS, 2.0, goodput_ms={"e2el": 500})["request_goodput"] == pytest.approx(1.5)


def test_peak_output_throughput_and_concurrency():
    # Tokens at: A 0.1,0.2,0.3,0.4; B 0.4,0.7; C 1.7 -> second 0 has 6 tokens, second 1 has 1.
    # Active: A [0,0.4] sec 0; B [0.2,0.7] sec 0; C [1.2,1.7] sec 1 -> peak 2 concurrent.
    m = compute_metrics(RESULTS, 2.0)
    assert m["max_output_tokens_per_s"] == 6
    assert m["max_concurrent_requests"] == 2


def test_per_adapter_by_hand():
    per = per_adapter_metrics(RESULTS, 2.0, slo_per_token_ms=300)
    assert set(per) == {"a", "b"}
    a, b = per["a"], per["b"]
    assert (a["completed"], a["failed"], b["completed"], b["failed"]) == (2, 0, 1, 1)
    assert a["share"] == 0.5 and b["share"] == 0.5
    assert a["mean_ttft_ms"] == pytest.approx(300)
    assert a["avg_latency_per_output_token_ms"] == pytest.approx(900 / 5)  # (0.4 + 0.5) / 5 tokens
    assert a["slo_attainment"] == pytest.approx(0.5)
    assert b["slo_attainment"] == pytest.approx(0.5)  # B meets it, the failure does not
    assert b["mean_tpot_ms"] == pytest.approx(300)


def test_tpot_definition():
    assert tpot(_r("a", 0.1, [0.1, 0.2], 3)) == pytest.approx(0.15)
    assert tpot(_r("a", 0.1, [], 1)) is None


def test_empty_and_all_failed():
    m = compute_metrics([_r("a", 0, [], 0, ok=False)], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["slo_attainment"] == 0.0


def test_printed_block_uses_vllm_labels():
    m = compute_metrics(RESULTS, 2.0, percentiles=(99,), goodput_ms={"e2el": 500})
    result = {
        **m,
        "duration": 2.0,
        "request_rate": 4.0,
        "max_concurrency": None,
        "per_adapter": per_adapter_metrics(RESULTS, 2.0),
    }
    text = format_result(result, ("ttft", "tpot", "itl"), (99,))
    lines = text.splitlines()
    assert lines[0] == "{:=^50}".format(" Serving Benchmark Result ")
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Request goodput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Peak concurrent requests:",
        "Total token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "{:<40} {:<10}".format("Successful requests:", 3) in lines
    assert "{:-^50}".format("Time per Output Token (excl. 1st token)") in lines
    assert "Per Adapter" in text and lines[-1] == "=" * 50
