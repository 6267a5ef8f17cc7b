"""One point of a benchmark that compares dlora's batching policies (and vLLM's server) on one
replica: the warm-up every server gets, and the run of one workload with the switch counters read
from /metrics around it.

Used by bench/dynamic_batching_skew and bench/where_merging_pays."""

from __future__ import annotations

import re

from dlora.bench.runner import first_errors, run_benchmark
from dlora.bench.scrape import scrape
from dlora.bench.stats import percentile
from dlora.bench.workload import Request, WorkloadSpec, generate_workload


def batching_metrics(base_url: str) -> dict:
    """Switch count and switch-time sums from a one-replica dlora server's /metrics (cumulative),
    and the dlora policy's current alpha/beta (why it did or did not merge)."""
    text = scrape(base_url)
    out = {"switches": 0.0, "merge_count": 0.0, "merge_sum_s": 0.0, "unmerge_count": 0.0, "unmerge_sum_s": 0.0}
    for line in text.splitlines():
        if m := re.fullmatch(r'dlora_switches_total\{replica="0"\} (\S+)', line):
            out["switches"] = float(m.group(1))
        elif m := re.fullmatch(r'dlora_switch_seconds_(count|sum)\{op="(\w+)",replica="0"\} (\S+)', line):
            out[f"{m.group(2)}_{'count' if m.group(1) == 'count' else 'sum_s'}"] = float(m.group(3))
        elif m := re.fullmatch(r'dlora_batching_threshold\{replica="0",threshold="(alpha|beta)"\} (\S+)', line):
            out[m.group(1)] = float(m.group(2))  # where Alg. 2 left them: not a counter
    return out


def point_metrics(r: dict) -> dict:
    """The metrics a point keeps from one `run_benchmark` result."""
    ok = [(lat, n) for lat, n, err in zip(r["latencies"], r["output_lens"], r["errors"]) if not err and n > 0]
    per_token_ms = [1000 * lat / n for lat, n in ok]
    return {
        "avg_latency_per_output_token_ms": r["avg_latency_per_output_token_ms"],
        "p90_latency_per_output_token_ms": percentile(per_token_ms, 90),
        "mean_normalized_latency_ms": r["mean_normalized_latency_ms"],
        "output_throughput": r["output_throughput"],
        "median_ttft_ms": r["median_ttft_ms"],
        "p90_ttft_ms": r.get("p90_ttft_ms"),
        "median_tpot_ms": r["median_tpot_ms"],
        "mean_e2el_ms": r["mean_e2el_ms"],
        "completed": r["completed"],
        "failed": r["failed"],
        "first_errors": first_errors(r),
        "duration_s": r["duration"],
    }


def run_point(base_url: str, requests: list[Request], dlora_server: bool) -> dict:
    """One streamed run of `requests`; on a dlora server also the switches it made and their times."""
    before = batching_metrics(base_url) if dlora_server else None
    r = run_benchmark(
        base_url,
        requests,
        ignore_eos=True,
        disable_tqdm=True,
        print_result=False,
        percentile_metrics=("ttft", "tpot", "e2el"),
        percentiles=(50.0, 90.0),
    )
    m = point_metrics(r)
    if before is not None:
        after = batching_metrics(base_url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after if k not in ("alpha", "beta")}
        m.update({f"{k}_after": after[k] for k in ("alpha", "beta") if k in after})
        m["switches"] = delta["switches"]
        for op in ("merge", "unmerge"):
            n = delta[f"{op}_count"]
            m[f"mean_{op}_ms"] = 1000 * delta[f"{op}_sum_s"] / n if n else None
    return m


def warm_up(base_url: str, names: tuple[str, ...], input_len: int, max_model_len: int) -> None:
    """A burst over all adapters, then each adapter's requests alone: oneDNN primitives for the
    first shapes, adapter loads, and the first merge of each adapter for the policies that merge,
    so the points that follow measure a server in its steady state."""
    burst = generate_workload(
        WorkloadSpec(
            num_prompts=2 * len(names),
            adapters=names,
            distribution="distinct",
            input_len=input_len,
            output_len=8,
            request_rate=float("inf"),
            max_model_len=max_model_len,
            seed=99,
        )
    )
    run_benchmark(base_url, burst, ignore_eos=True, disable_tqdm=True, print_result=False)
    for name in names:
        alone = generate_workload(
            WorkloadSpec(
                num_prompts=4,
                adapters=(name,),
                input_len=input_len,
                output_len=16,
                request_rate=float("inf"),
                max_model_len=max_model_len,
                seed=98,
            )
        )
        run_benchmark(base_url, alone, ignore_eos=True, disable_tqdm=True, print_result=False)
