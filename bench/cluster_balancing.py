#!/usr/bin/env python
"""Cluster balancing: round-robin over a static placement vs proactive dispatch vs dispatch + migration.

Two real replicas (one vLLM engine per core) serve a bursty (Gamma, CV > 1), skewed (Zipf) workload
from `dlora bench` over 8 adapters, at each of a few total request rates. The three policies see the
same requests; each runs on a fresh server that then serves the rates in order. Queueing delay is measured as TTFT (the workload's prompts are short, so TTFT is dominated
by waiting for a batch slot), next to dLoRA's average latency per output token.
Writes bench/results/cluster_balancing.json (+ .png).

    .venv/bin/python bench/cluster_balancing.py
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from dlora import env  # noqa: E402
from dlora.bench.runner import run_benchmark  # noqa: E402
from dlora.bench.workload import WorkloadSpec, generate_workload  # noqa: E402
from dlora.models.smollm2 import prepare_smollm2  # noqa: E402
from servers import make_random_adapters, start_dlora, stop, wait_healthy, write_result  # noqa: E402

RESULTS = ROOT / "bench" / "results"
POLICIES = {
    "round_robin_static": {"dispatch": "round_robin", "placement": "static", "migration": False},
    "proactive": {"dispatch": "proactive", "placement": "dynamic", "migration": False},
    "proactive_migration": {"dispatch": "proactive", "placement": "dynamic", "migration": True},
}
KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "avg_latency_per_output_token_ms", "mean_tpot_ms",
        "output_throughput", "completed", "duration")


def server_config(args, base: Path, adapters: list[Path], port: int, state: Path, policy: dict) -> dict:
    return {
        "model": {"path": str(base), "served_name": "base", "dtype": "bfloat16", "max_model_len": 1024},
        "engine": {"max_loras": 4, "max_lora_rank": 8, "max_cpu_loras": 8, "kv_cache_space_gib": 1,
                   "max_num_seqs": args.max_num_seqs},
        "server": {"port": port, "state_dir": str(state)},
        "cluster": {"num_replicas": 2, "cpu_cores": [0, 1], "migration_interval_s": args.migration_interval,
                    "monitor_interval_s": 0.5, "count_imbalance": args.count_imbalance, **policy},
        "adapters": [{"name": f"a{i}", "path": str(p)} for i, p in enumerate(adapters)],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = result["workload"]["request_rates"]
    names = list(POLICIES)
    colors = {"round_robin_static": "#999999", "proactive": "#4477aa", "proactive_migration": "#228833"}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(names)
    for ax, key, label in zip(axes, ("mean_ttft_ms", "avg_latency_per_output_token_ms"),
                              ("mean queueing delay (TTFT), ms", "avg latency per output token, ms")):
        for k, name in enumerate(names):
            ys = [result["per_rate"][str(r)].get(name, {}).get(key, 0) for r in rates]
            ax.bar([i + k * width for i in range(len(rates))], ys, width, label=name, color=colors[name])
        ax.set_xticks([i + width for i in range(len(rates))], [f"{r} req/s" for r in rates])
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    w = result["workload"]
    fig.suptitle(f"2 replicas, {w['num_prompts']} requests per rate, Zipf α={w['alpha']} over 8 adapters, "
                 f"Gamma CV={w['cv']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def ratios(per_policy: dict) -> dict:
    """Baseline ÷ dlora (proactive + migration) mean queueing delay: > 1 means dlora waits less."""
    out = {}
    if "round_robin_static" in per_policy and "proactive_migration" in per_policy:
        out["queueing_vs_round_robin"] = (per_policy["round_robin_static"]["mean_ttft_ms"]
                                          / per_policy["proactive_migration"]["mean_ttft_ms"])
    if "proactive" in per_policy and "proactive_migration" in per_policy:
        out["queueing_vs_proactive_only"] = (per_policy["proactive"]["mean_ttft_ms"]
                                             / per_policy["proactive_migration"]["mean_ttft_ms"])
        out["latency_per_token_vs_proactive_only"] = (per_policy["proactive"]["avg_latency_per_output_token_ms"]
                                                      / per_policy["proactive_migration"]["avg_latency_per_output_token_ms"])
    return out


def migration_rounds(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.exists() else ""
    moved = [int(m) for m in re.findall(r"moved (\d+) of", text)]
    return {"rounds": len(moved), "requests_moved": sum(moved)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per rate")
    ap.add_argument("--request-rates", default="2,3", help="comma-separated total rates (req/s), run in this order "
                    "on one server per policy")
    ap.add_argument("--cv", type=float, default=3.0)
    ap.add_argument("--alpha", type=float, default=1.5, help="Zipf skew over the adapters")
    ap.add_argument("--input-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--migration-interval", type=float, default=2.0)
    ap.add_argument("--count-imbalance", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default=str(RESULTS / "cluster_balancing.json"))
    args = ap.parse_args()
    rates = [float(r) for r in args.request_rates.split(",")]

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", 8, 8)
    work = env.cache_dir() / "bench-run" / "cluster"
    work.mkdir(parents=True, exist_ok=True)
    workloads = {rate: generate_workload(WorkloadSpec(
        num_prompts=args.num_prompts, adapters=tuple(f"a{i}" for i in range(8)), distribution="zipf",
        alpha=args.alpha, request_rate=rate, cv=args.cv, input_len=args.input_len, output_len=args.output_len,
        max_model_len=1024, seed=k)) for k, rate in enumerate(rates)}
    per_rate: dict[str, dict] = {str(r): {} for r in rates}
    configs, port = {}, 8321
    for name in args.policies.split(","):
        cfg = server_config(args, base, adapters, port, work / f"state-{name}", POLICIES[name])
        configs[name] = cfg["cluster"]
        proc = start_dlora(cfg, work, name)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, work / f"{name}.log")
            run_benchmark(f"http://127.0.0.1:{port}", workloads[rates[0]][:8], ignore_eos=True, disable_tqdm=True,
                          print_result=False)  # warm-up
            for rate in rates:
                before = migration_rounds(work / f"{name}.log")
                r = run_benchmark(f"http://127.0.0.1:{port}", workloads[rate], ignore_eos=True, print_result=False,
                                  percentile_metrics=("ttft", "tpot"), percentiles=(50.0, 99.0))
                after = migration_rounds(work / f"{name}.log")
                per_rate[str(rate)][name] = {k: r[k] for k in KEYS} | {
                    "migration_rounds": after["rounds"] - before["rounds"],
                    "requests_migrated": after["requests_moved"] - before["requests_moved"]}
                print(f"{rate:4.1f} req/s {name:20s} mean TTFT {r['mean_ttft_ms']:.0f} ms, latency/token "
                      f"{r['avg_latency_per_output_token_ms']:.1f} ms, {r['output_throughput']:.1f} tok/s, "
                      f"{per_rate[str(rate)][name]['requests_migrated']} migrated", flush=True)
                time.sleep(5)  # let the queues drain before the next rate
        finally:
            stop(proc)
        port += 1

    by_rate = {rate: ratios(pol) for rate, pol in per_rate.items()}
    summary: dict = {"per_rate": by_rate}
    for key in ("queueing_vs_round_robin", "queueing_vs_proactive_only", "latency_per_token_vs_proactive_only"):
        values = [v[key] for v in by_rate.values() if key in v]
        if values:
            summary[key] = min(values)  # the worst rate: no rate is picked for the headline
    result = {
        "command": shlex.join([".venv/bin/python", *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "workload": {"num_prompts": args.num_prompts, "request_rates": rates, "cv": args.cv,
                     "alpha": args.alpha, "distribution": "zipf", "adapters": 8, "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True, "model": "SmolLM2-135M-Instruct bf16"},
        "queueing_delay_metric": "TTFT (mean), see docstring",
        "summary_rule": "each ratio is baseline / proactive_migration at one rate; the headline is the minimum over rates",
        "configs": configs,
        "per_rate": per_rate,
        "summary": summary,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
