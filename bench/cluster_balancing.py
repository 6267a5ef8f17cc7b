#!/usr/bin/env python
"""Cluster balancing: round-robin over a static placement vs proactive dispatch vs dispatch + migration.

Two real replicas (one vLLM engine per core) serve a bursty (Gamma, CV > 1), skewed (Zipf) workload
from `dlora bench` over 8 adapters. The three policies see the same requests; each runs on a fresh
server. Queueing delay is measured as TTFT (the workload's prompts are short, so TTFT is dominated
by waiting for a batch slot), next to dLoRA's average latency per output token.
Writes bench/results/cluster_balancing.json (+ .png).

    .venv/bin/python bench/cluster_balancing.py
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
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

    names = list(result["policies"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, label in zip(axes, ("mean_ttft_ms", "avg_latency_per_output_token_ms"),
                              ("mean queueing delay (TTFT), ms", "avg latency per output token, ms")):
        ax.bar(names, [result["policies"][n][key] for n in names], color=["#999999", "#4477aa", "#228833"])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"2 replicas, {result['workload']['num_prompts']} requests, Zipf α={result['workload']['alpha']}, "
                 f"CV={result['workload']['cv']}, {result['workload']['request_rate']} req/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--request-rate", type=float, default=3.0)
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

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", 8, 8)
    work = env.cache_dir() / "bench-run" / "cluster"
    work.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(num_prompts=args.num_prompts, adapters=tuple(f"a{i}" for i in range(8)), distribution="zipf",
                        alpha=args.alpha, request_rate=args.request_rate, cv=args.cv, input_len=args.input_len,
                        output_len=args.output_len, max_model_len=1024, seed=0)
    requests = generate_workload(spec)
    results, port = {}, 8321
    for name in args.policies.split(","):
        cfg = server_config(args, base, adapters, port, work / f"state-{name}", POLICIES[name])
        proc = start_dlora(cfg, work, name)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, work / f"{name}.log")
            run_benchmark(f"http://127.0.0.1:{port}", requests[:8], ignore_eos=True, disable_tqdm=True,
                          print_result=False)  # warm-up
            r = run_benchmark(f"http://127.0.0.1:{port}", requests, ignore_eos=True, print_result=False,
                              percentile_metrics=("ttft", "tpot"), percentiles=(50.0, 99.0))
            results[name] = {k: r[k] for k in KEYS} | {"config": cfg["cluster"]}
            print(f"{name:20s} mean TTFT {r['mean_ttft_ms']:.0f} ms, latency/token "
                  f"{r['avg_latency_per_output_token_ms']:.1f} ms, {r['output_throughput']:.1f} tok/s", flush=True)
        finally:
            stop(proc)
        port += 1

    pol = results
    summary = {}
    if "round_robin_static" in pol and "proactive_migration" in pol:
        summary["queueing_vs_round_robin"] = pol["round_robin_static"]["mean_ttft_ms"] / pol["proactive_migration"]["mean_ttft_ms"]
    if "proactive" in pol and "proactive_migration" in pol:
        summary["queueing_vs_proactive_only"] = pol["proactive"]["mean_ttft_ms"] / pol["proactive_migration"]["mean_ttft_ms"]
        summary["latency_per_token_vs_proactive_only"] = (pol["proactive"]["avg_latency_per_output_token_ms"]
                                                         / pol["proactive_migration"]["avg_latency_per_output_token_ms"])
    result = {
        "command": shlex.join([".venv/bin/python", *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workload": {"num_prompts": args.num_prompts, "request_rate": args.request_rate, "cv": args.cv,
                     "alpha": args.alpha, "distribution": "zipf", "adapters": 8, "input_len": args.input_len,
                     "output_len": args.output_len, "ignore_eos": True, "model": "SmolLM2-135M-Instruct bf16"},
        "queueing_delay_metric": "TTFT (mean), see docstring",
        "policies": results,
        "summary": summary,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
