"""Autoscaling on a diurnal day, in the replica model: replica-seconds and SLO attainment of a
fixed cluster sized for the peak, one sized for the mean, and the autoscaler (dlora/sim/elastic.py).

The day: `--period` seconds (an hour by default: the replica model is fast, and an hour is long
against a replica's `--startup` of 30 s, as a day is against minutes) of arrivals at
lambda(t) = lambda_bar * (1 + A sin 2 pi t / T), `--amplitude` A 0.8, Gamma bursts (CV `--cv`) on
top; ShareGPT first turns and replies cut at 256 tokens (SmolLM2 tokens, as bench/slo_sim counts
them), Zipf(1.0) over as many adapters as replicas; KV-bound replicas (48 blocks of 128 tokens, 16
running slots). The peak is `--peak-load` (0.8) of what `--scales` replicas serve at full batches
(`capacity_rps`).

Configurations, each on the same requests, dispatched at arrival by dLoRA's proactive dispatch:
- `fixed_max`: the scale's replica count all day (sized for the peak);
- `fixed_mean`: the replicas the day's mean rate needs at the same utilization target;
- `autoscaled`: from the replicas the first minute's rate needs, the autoscaler between 1 and
  the scale's count (`dlora.cluster.autoscale.AutoscaleConfig`'s defaults; heartbeat 5 s, the
  capacity prior from the replica model's cost parameters, which the server's calibrated cost
  models give it), drains by moving queued and running requests.

Per configuration: replica-seconds (billed from start to stop), SLO attainment (SeaLLM's relative
SLO, 5 x isolated), TTFT p50/p99, requests drained. Summary per scale:
`replica_seconds_saved_vs_fixed_max` (1 - autoscaled / fixed_max; target >= 0.30) and
`attainment_vs_fixed_max` (autoscaled / fixed_max; target >= 0.99).

    .venv/bin/python -m bench.autoscale_sim.run            # 8 and 32 replicas, about 10 minutes
    .venv/bin/python -m bench.autoscale_sim.run --quick    # smoke run: 4 replicas, a 10-minute day
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from dlora import env
from dlora.bench.adapter_slo import slo_summary
from dlora.bench.cluster_bench import CHAT_TEMPLATE, sharegpt_chat_workload
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.stats import percentile
from dlora.cluster.autoscale import AutoscaleConfig
from dlora.sim.elastic import simulate_elastic
from dlora.sim.migration_bound import Outcome, ReplicaModel, TraceRequest, capacity_rps, simulate

HERE = Path(__file__).resolve().parent
CONFIGS = ("fixed_max", "fixed_mean", "autoscaled")
UTILIZATION = AutoscaleConfig().target_utilization


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="8,32", help="replica counts (the fixed cluster, the autoscaler's ceiling)")
    ap.add_argument("--period", type=float, default=3600.0, help="the day's length, seconds")
    ap.add_argument("--amplitude", type=float, default=0.8, help="A in lambda_bar (1 + A sin 2 pi t / T)")
    ap.add_argument("--peak-load", type=float, default=0.8, help="the peak rate, x the scale's capacity")
    ap.add_argument("--cv", type=float, default=1.0, help="Gamma arrivals' coefficient of variation")
    ap.add_argument("--startup", type=float, default=30.0, help="seconds from a scale-out to the replica serving")
    ap.add_argument("--heartbeat", type=float, default=5.0, help="seconds between autoscaler decisions")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kv-blocks", type=int, default=48)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 replicas, a 600 s day")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.scales, args.period = "4", 600.0
    try:
        args.scales = [int(x) for x in args.scales.split(",")]
    except ValueError:
        ap.error(f"--scales {args.scales!r}: expected replica counts, e.g. 8,32")
    if any(n < 1 for n in args.scales):
        ap.error(f"--scales {args.scales}: replica counts must be >= 1")
    if not 0 <= args.amplitude < 1:
        ap.error(f"--amplitude {args.amplitude}: must be in [0, 1)")
    if args.out is None:
        quick = env.cache_dir() / "bench-run" / "autoscale_sim" / "autoscale_sim.quick.json"
        args.out = str(quick if args.quick else HERE / "result.json")
    return args


def replica_model(args) -> ReplicaModel:
    return ReplicaModel(max_running=16, max_loras=8, adapter_slots=8, kv_blocks=args.kv_blocks)


def day(replicas: int, seed: int, args, tokenizer, model: ReplicaModel) -> tuple[list[TraceRequest], float]:
    """The day's requests for `replicas`, and one replica's modelled capacity (req/s) on them."""
    probe = _jobs(replicas, 2000, 1.0, seed, args, tokenizer, diurnal=False)
    per_replica = capacity_rps(model, 1, probe)
    mean_rate = args.peak_load * replicas * per_replica / (1 + args.amplitude)
    n = max(1, round(mean_rate * args.period))
    return _jobs(replicas, n, mean_rate, seed, args, tokenizer, diurnal=True), per_replica


def _jobs(adapters: int, n: int, rate: float, seed: int, args, tokenizer, diurnal: bool) -> list[TraceRequest]:
    """ShareGPT chat requests over Zipf(1.0) adapters as modelled jobs (prompts with the chat
    template, outputs cut at --max-tokens), as bench/slo_sim counts them."""
    spec = {"diurnal_amplitude": args.amplitude, "diurnal_period": args.period} if diurnal else {}
    cap = args.max_tokens
    requests = sharegpt_chat_workload(adapters, n, seed, tokenizer, alpha=1.0, cv=args.cv, request_rate=rate, **spec)
    return [
        TraceRequest(r.arrival_time, str(r.adapter), r.prompt_len + CHAT_TEMPLATE, min(r.output_len, cap), cap)
        for r in requests
    ]


def report(jobs: list[TraceRequest], outcome: Outcome, replica_seconds: float) -> dict[str, Any]:
    assert outcome.slo is not None
    slo = slo_summary(outcome.slo, Counter(j.adapter for j in jobs), None)
    ttft_ms = 1000 * np.asarray(outcome.ttft_s)
    return {
        "replica_seconds": replica_seconds,
        "slo_attainment": slo["slo_attainment"],
        "median_ttft_ms": percentile(ttft_ms, 50),
        "p99_ttft_ms": percentile(ttft_ms, 99),
        "preemptions": outcome.preemptions,
    }


def run_one(config: str, jobs: list[TraceRequest], replicas: int, per_replica: float, args) -> dict[str, Any]:
    """One configuration on one day (in a worker process)."""
    model = replica_model(args)
    start = min(j.arrival for j in jobs)
    if config == "autoscaled":
        cfg = AutoscaleConfig(
            min_replicas=1, max_replicas=replicas, heartbeat_s=args.heartbeat, capacity_rps_prior=per_replica
        )
        first_minute = sum(1 for j in jobs if j.arrival < start + 60) / 60
        initial = min(replicas, max(1, math.ceil(first_minute / (per_replica * UTILIZATION))))
        e = simulate_elastic(jobs, model, cfg, initial=initial, startup_s=args.startup)
        got = report(jobs, e.outcome, e.replica_seconds)
        got["replicas"] = None
        got["initial_replicas"] = initial
        got["drained_requests"] = e.drained_requests
        got["scale_events"] = [asdict(ev) for ev in e.events]
        got["replicas_over_time"] = e.replicas_over_time
        return got
    n = replicas if config == "fixed_max" else fixed_mean(jobs, per_replica, args.period, replicas)
    outcome = simulate(jobs, n, model, "soonest_start")  # dispatch as the server ships it
    end = max(a + lat for a, lat in zip((j.arrival for j in jobs), outcome.latency_s))
    got = report(jobs, outcome, n * (end - start))
    got["replicas"] = n
    return got


def fixed_mean(jobs: list[TraceRequest], per_replica: float, period: float, most: int) -> int:
    """Replicas for the day's mean rate at the autoscaler's utilization target."""
    return min(most, max(1, math.ceil(len(jobs) / period / (per_replica * UTILIZATION))))


def summarize(scales: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for s in scales:
        runs = s["runs"]
        fm, auto = runs["fixed_max"], runs["autoscaled"]
        saved = 1 - auto["replica_seconds"] / fm["replica_seconds"]
        att = auto["slo_attainment"] / fm["slo_attainment"] if fm["slo_attainment"] else None
        out[f"{s['replicas']}_replicas"] = {
            "replica_seconds_saved_vs_fixed_max": saved,
            "attainment_vs_fixed_max": att,
            "slo_attainment": {c: runs[c]["slo_attainment"] for c in CONFIGS},
            "replica_seconds": {c: runs[c]["replica_seconds"] for c in CONFIGS},
            "target": "saved >= 0.30 at attainment_vs_fixed_max >= 0.99",
            "met": saved >= 0.30 and att is not None and att >= 0.99,
        }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    scales = result["scales"]
    fig, axes = plt.subplots(len(scales), 2, figsize=(14, 3.6 * len(scales)), squeeze=False)
    for (ax, bar), s in zip(axes, scales):
        runs = s["runs"]
        times = [t / 60 for t, _ in runs["autoscaled"]["replicas_over_time"]]
        ax.step(times, [n for _, n in runs["autoscaled"]["replicas_over_time"]], where="post", label="autoscaled")
        for c in ("fixed_max", "fixed_mean"):
            ax.axhline(runs[c]["replicas"], linestyle="--", color="C1" if c == "fixed_max" else "C2", label=c)
        rate = ax.twinx()
        rate.plot(
            [t / 60 for t in s["arrival_rate_per_minute"]["t"]],
            s["arrival_rate_per_minute"]["rps"],
            color="grey",
            alpha=0.5,
        )
        rate.set_ylabel("arrivals (req/s, grey)")
        ax.set_xlabel("minutes")
        ax.set_ylabel("replicas")
        ax.set_title(f"{s['replicas']} replicas at most: replicas over the day", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        names = list(CONFIGS)
        bars = bar.bar(names, [runs[c]["replica_seconds"] / 3600 for c in names], color=["C1", "C2", "C0"])
        bar.bar_label(bars, labels=[f"attainment {runs[c]['slo_attainment']:.3f}" for c in names], fontsize=8)
        bar.set_ylabel("replica-hours")
        bar.set_title(f"{s['replicas']} replicas: replica-hours and SLO attainment", fontsize=9)
    fig.suptitle(
        f"Modelled replicas (dlora/sim/elastic.py): a {result['period_s']:.0f} s diurnal day, amplitude "
        f"{result['amplitude']}, peak {result['peak_load']} x capacity, replica start {result['startup_s']:.0f} s",
        fontsize=9,
    )
    save_figure(fig, path)


def per_minute(jobs: list[TraceRequest]) -> dict[str, list[float]]:
    counts = Counter(int(j.arrival // 60) for j in jobs)
    minutes = range(max(counts) + 1) if counts else range(0)
    return {"t": [60.0 * m + 30 for m in minutes], "rps": [counts.get(m, 0) / 60 for m in minutes]}


def main() -> int:
    args = parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from dlora.bench.prompts import load_tokenizer
    from dlora.models.smollm2 import prepare_smollm2

    tokenizer = load_tokenizer(str(prepare_smollm2()))
    model = replica_model(args)
    t0 = time.monotonic()
    scales: list[dict[str, Any]] = []
    futures: dict[Future, tuple[int, str]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for k, replicas in enumerate(args.scales):
            jobs, per_replica = day(replicas, 0, args, tokenizer, model)
            scales.append(
                {
                    "replicas": replicas,
                    "requests": len(jobs),
                    "capacity_rps_per_replica": per_replica,
                    "mean_rate": len(jobs) / args.period,
                    "arrival_rate_per_minute": per_minute(jobs),
                    "runs": {},
                }
            )
            print(f"[{time.monotonic() - t0:5.0f}s] {replicas} replicas: {len(jobs)} requests", flush=True)
            for c in CONFIGS:
                futures[pool.submit(run_one, c, jobs, replicas, per_replica, args)] = (k, c)
        for fut in as_completed(futures):
            k, c = futures[fut]
            got = fut.result()
            scales[k]["runs"][c] = got
            print(
                f"[{time.monotonic() - t0:5.0f}s] {scales[k]['replicas']} replicas {c:10s} replica-hours "
                f"{got['replica_seconds'] / 3600:6.2f}, SLO attainment {got['slo_attainment']:.4f}, TTFT p99 "
                f"{got['p99_ttft_ms']:.0f} ms",
                flush=True,
            )
    result = {
        **provenance("bench.autoscale_sim.run"),
        "model": asdict(model),
        "period_s": args.period,
        "amplitude": args.amplitude,
        "peak_load": args.peak_load,
        "cv": args.cv,
        "startup_s": args.startup,
        "heartbeat_s": args.heartbeat,
        "autoscale": asdict(AutoscaleConfig()),
        "workload": "ShareGPT first turns and replies cut at 256 (SmolLM2 tokens), Zipf 1.0, diurnal Gamma",
        "slo": "SeaLLM's relative default: 5 x each request's isolated TTFT and time per output token",
        "scales": scales,
        "summary": summarize(scales),
        "wall_s": time.monotonic() - t0,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
