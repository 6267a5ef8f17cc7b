"""Merged/unmerged dynamic batching under adapter skew: `unmerged`, `merged`, `dlora` and vLLM's server.

One replica of the default model (SmolLM2-135M-Instruct, bf16) with 8 random rank-8 q/k/v/o
adapters. Each point is one `dlora bench` workload at a fixed Poisson arrival rate whose adapter
popularity goes from uniform to one adapter taking >= 90% of the requests (`skewed` popularity:
adapter a gets alpha^-a of the requests). The four servers run at once, every engine pinned to
core 0; they take turns on each workload, so only one is loaded at a time. The machine's speed
drifts by 10-20% over minutes, more than the differences the targets ask about, so each point runs
every batching policy `--reps` times (3 by default) in rotating order, and the point's value is
the median over its reps (vLLM's server, far behind, runs once per point). The summary is computed
from those medians; `median_of_rep_ratios` beside it takes each ratio per rep (the systems of one
rep ran back to back) and reports the median over reps.

A last point sends the most skewed workload's requests to the base model (no adapter) on the
`unmerged` server: a bound no policy can beat (merged inference is base-model speed plus the
switches), against which the summary reports the best ratio any policy could reach over the worse
baseline at that skew.

Metrics per point: dLoRA's average latency per output token (sum of E2E latencies / sum of output
tokens), P90 of the per-request latency per output token, throughput, TTFT; for dlora's servers
also the switches and switch times read from /metrics. Before the points, every server gets the
same warm-up: a burst over all adapters, then each adapter's requests alone (oneDNN primitives for
the first shapes, adapter loads, and the first merge of each adapter for the policies that merge),
so the points measure a server in its steady state. Writes
bench/dynamic_batching_skew/result.json (+ .png).

    .venv/bin/python -m bench.dynamic_batching_skew.run           # about 45 min on 2 cores (--reps 3)
    .venv/bin/python -m bench.dynamic_batching_skew.run --quick   # a 5-minute smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import yaml

from dlora import env
from dlora.bench.palette import BATCHING_POLICY_COLORS
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.policy_servers import run_point as run_policy_point
from dlora.bench.policy_servers import warm_up as shared_warm_up
from dlora.bench.popularity import popularity_shares
from dlora.bench.provenance import machine, provenance
from dlora.bench.results import write_result
from dlora.bench.server_configs import (
    EngineSettings,
    single_replica_config,
    vllm_server_command,
)
from dlora.bench.servers import make_random_adapters, serving, start
from dlora.bench.shipped import shipped_config, shipped_scheduling
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
POLICIES = ("unmerged", "merged", "dlora")
SYSTEMS = (*POLICIES, "vllm")
NUM_ADAPTERS, RANK = 8, 8
PORTS = {"unmerged": 8321, "merged": 8322, "dlora": 8323, "vllm": 8324}
KV_GIB = 1  # ample for 64 x 128-token sequences; four servers share the machine's memory


def engine_settings(args) -> EngineSettings:
    return EngineSettings(
        max_model_len=args.max_model_len,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK,
        max_num_seqs=args.max_num_seqs,
        kv_cache_space_gib=KV_GIB,
    )


def vllm_command(args, base: Path, adapters: list[Path]) -> list[str]:
    return vllm_server_command(base, adapters, PORTS["vllm"], engine_settings(args))


def scheduling(policy: str, mixed_merged: bool = False) -> dict:
    return shipped_scheduling(policy, mixed_merged)


def dlora_config(args, policy: str, base: Path, adapters: list[Path], state: Path) -> dict:
    return single_replica_config(
        base,
        adapters,
        PORTS[policy],
        state,
        engine_settings(args),
        lora_backend=args.lora_backend,
        # baselines stay as they are
        scheduling=scheduling(policy, args.mixed_merged and policy == "dlora"),
    )


def url(system: str) -> str:
    return f"http://127.0.0.1:{PORTS[system]}"


def run_point(system: str, requests) -> dict:
    return run_policy_point(url(system), requests, dlora_server=system in POLICIES)


POINT_METRICS = ("avg_latency_per_output_token_ms", "p90_latency_per_output_token_ms", "output_throughput", "switches")


def median_points(runs: list[list[dict]]) -> list[dict]:
    """One point per (system, skew) over several runs (or reps) of the same points: the median of
    each metric, and every run's latency per output token in `per_run`."""
    out = []
    for first in runs[0]:
        same = [p for run in runs for p in run if (p["policy"], p["skew"]) == (first["policy"], first["skew"])]
        if len(same) != len(runs):
            raise SystemExit(f"point {first['policy']} at skew {first['skew']} is missing from some runs")
        metrics = {
            k: statistics.median(p["metrics"][k] for p in same)
            for k in POINT_METRICS
            if all(p["metrics"].get(k) is not None for p in same)
        }
        out.append(
            {
                "policy": first["policy"],
                "skew": first["skew"],
                "top_share": first["top_share"],
                "metrics": metrics,
                "per_run": [p["metrics"]["avg_latency_per_output_token_ms"] for p in same],
            }
        )
    return out


def median_ratios(summaries: list[dict]) -> dict:
    """Each headline ratio, and each per-skew ratio, as the median of the runs' own values: robust
    to a machine that is slower in one run for every system alike (point medians are not)."""
    keys = ("dlora_vs_better_baseline_min", "dlora_vs_worse_baseline_min", "dlora_vs_vllm_server_max_skew")
    per_skew = {
        skew: {k: statistics.median(s["per_skew"][skew][k] for s in summaries) for k in ratios}
        for skew, ratios in summaries[0]["per_skew"].items()
    }
    return {**{k: statistics.median(s[k] for s in summaries) for k in keys}, "per_skew": per_skew}


def rep_points(points: list[dict], reps: int) -> list[list[dict]]:
    """The points of each rep; systems measured once per point (vLLM's server) join every rep."""
    once = [p for p in points if p.get("rep") is None]
    return [[p for p in points if p.get("rep") == r] + once for r in range(reps)]


def summarize(points: list[dict], skews: list[float], base_reference: dict | None = None) -> dict:
    lat = {(p["policy"], p["skew"]): p["metrics"]["avg_latency_per_output_token_ms"] for p in points}
    better = {s: min(lat[("unmerged", s)], lat[("merged", s)]) for s in skews}
    worse = {s: max(lat[("unmerged", s)], lat[("merged", s)]) for s in skews}
    ends = [skews[0], skews[-1]]
    bound = {}
    if base_reference is not None:
        base = base_reference["avg_latency_per_output_token_ms"]
        bound = {
            "base_model_latency_per_output_token_ms": base,
            "best_possible_vs_worse_baseline_max_skew": worse[skews[-1]] / base,
        }
    return {
        **bound,
        "metric": "avg_latency_per_output_token_ms; ratios are baseline / dlora (> 1: dlora faster)",
        "dlora_vs_better_baseline_min": min(better[s] / lat[("dlora", s)] for s in skews),
        "dlora_vs_worse_baseline_min": min(worse[s] / lat[("dlora", s)] for s in ends),
        "dlora_vs_vllm_server_max_skew": lat[("vllm", skews[-1])] / lat[("dlora", skews[-1])],
        "per_skew": {
            str(s): {
                "dlora_vs_better_baseline": better[s] / lat[("dlora", s)],
                "dlora_vs_worse_baseline": worse[s] / lat[("dlora", s)],
                "dlora_vs_vllm_server": lat[("vllm", s)] / lat[("dlora", s)],
            }
            for s in skews
        },
        "targets": {
            "dlora_vs_better_baseline_min": ">= 0.95",
            "dlora_vs_worse_baseline_min": ">= 1.5",
            "dlora_vs_vllm_server_max_skew": ">= 2",
        },
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(
        axes,
        ("avg_latency_per_output_token_ms", "p90_latency_per_output_token_ms", "output_throughput"),
        ("avg latency per output token (ms)", "P90 latency per output token (ms)", "output tok/s"),
    ):
        for system in SYSTEMS:
            pts = sorted((p for p in result["points"] if p["policy"] == system), key=lambda p: p["top_share"])
            ax.plot(
                [p["top_share"] for p in pts],
                [p["metrics"][key] for p in pts],
                "o-",
                color=BATCHING_POLICY_COLORS[system],
                label="vLLM server" if system == "vllm" else f"dlora {system}",
            )
        base = (result.get("base_model_reference") or {}).get("metrics", {}).get(key)
        if base is not None:
            ax.axhline(base, color="black", lw=0.8, ls=":", label="base model, no adapter (bound)")
        ax.set_xlabel("share of the most popular adapter")
        ax.set_title(label, fontsize=9)
        if key != "output_throughput":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(
        f"SmolLM2-135M bf16, 1 replica (1 core), {NUM_ADAPTERS} rank-{RANK} adapters, "
        f"{w['num_prompts']} requests/point at {w['request_rate']} req/s, in {w['input_len']} / out "
        f"{w['output_len']} tokens",
        fontsize=9,
    )
    save_figure(fig, path)


def schedule(k: int, reps: int) -> list[tuple[int | None, str]]:
    """(rep, system) in the order point k runs them: the batching policies `reps` times, each rep's
    order rotated, so no policy always runs first or last; vLLM's server once, in the middle."""
    runs = []
    for rep in range(reps):
        shift = (k + rep) % len(POLICIES)
        runs.extend((rep, system) for system in POLICIES[shift:] + POLICIES[:shift])
    runs.insert(len(runs) // 2, (None, "vllm"))
    return runs


def summarize_reps(points: list[dict], skews: list[float], reps: int, base_reference: dict | None) -> dict:
    """The summary from the point medians, plus the median of each rep's own ratios."""
    per_rep = [summarize(run, skews, base_reference) for run in rep_points(points, reps)]
    return summarize(median_points(rep_points(points, reps)), skews, base_reference) | {
        "median_of_rep_ratios": median_ratios(per_rep),
        "per_rep_summary": per_rep,
    }


def warm_up(base_url: str, names: tuple[str, ...], args) -> None:
    shared_warm_up(base_url, names, args.input_len, args.max_model_len)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1.0, help="arrival rate, requests/s (Poisson)")
    ap.add_argument("--num-prompts", type=int, default=56, help="requests per point")
    ap.add_argument(
        "--alphas",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 4.0, 10.0],
        help="`skewed` popularity: adapter a gets alpha^-a of the requests (1 = uniform)",
    )
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="runs of each batching policy per point (median)")
    ap.add_argument("--quick", action="store_true", help="2 skews x 32 requests, 1 rep: a smoke run")
    ap.add_argument(
        "--lora-backend",
        default=shipped_config("engine").get("lora_backend", "vllm"),
        help="engine.lora_backend of dlora's servers (default: configs/default.yaml's); vLLM's "
        "server always runs its own LoRA ops",
    )
    ap.add_argument(
        "--mixed-merged",
        action="store_true",
        help="scheduling.mixed_merged for dlora's servers: "
        "while an adapter is merged, other requests run in the same step (compensated)",
    )
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    if args.quick:
        args.alphas, args.num_prompts, args.reps = [1.0, 10.0], 32, 1
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be >= 1")

    t_start = time.monotonic()
    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", NUM_ADAPTERS, RANK)
    work = Path(env.cache_dir()) / "bench-run" / "skew"
    work.mkdir(parents=True, exist_ok=True)
    procs = {}
    for policy in POLICIES:
        cfg = work / f"{policy}.yaml"
        cfg.write_text(yaml.safe_dump(dlora_config(args, policy, base, adapters, work / f"state-{policy}")))
        procs[policy] = start(
            [sys.executable, "-m", "dlora.cli", "serve", "--config", str(cfg)], work / f"{policy}.log", {}
        )
    procs["vllm"] = start(
        vllm_command(args, base, adapters),
        work / "vllm.log",
        {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    with serving(procs, {system: url(system) for system in procs}, work, timeout=600):
        print(f"[{time.monotonic() - t_start:5.0f}s] all four servers are up", flush=True)

        names = tuple(f"a{i}" for i in range(NUM_ADAPTERS))
        for system in SYSTEMS:
            warm_up(url(system), names, args)

        points = []
        for k, alpha in enumerate(args.alphas):
            spec = WorkloadSpec(
                num_prompts=args.num_prompts,
                adapters=names,
                distribution="skewed",
                alpha=alpha,
                input_len=args.input_len,
                output_len=args.output_len,
                request_rate=args.rate,
                max_model_len=args.max_model_len,
                seed=k,
            )
            requests = generate_workload(spec)
            top_share = float(popularity_shares("skewed", NUM_ADAPTERS, alpha)[0])
            realized = sum(r.adapter == "a0" for r in requests) / len(requests)
            for rep, system in schedule(k, args.reps):
                m = run_point(system, requests)
                if m["failed"]:
                    raise RuntimeError(
                        f"{system}: {m['failed']} requests failed at alpha {alpha}: {m['first_errors']} "
                        f"(server died? see {work / system}.log); no result written"
                    )
                points.append(
                    {
                        "policy": system,
                        "skew": alpha,
                        "top_share": top_share,
                        "rep": rep,
                        "realized_top_share": realized,
                        "metrics": m,
                    }
                )
                extra = f", {m['switches']:.0f} switches" if "switches" in m else ""
                p90 = m["p90_latency_per_output_token_ms"] or float("nan")
                print(
                    f"[{time.monotonic() - t_start:5.0f}s] alpha {alpha:>4} (top {top_share:.2f}) rep "
                    f"{'-' if rep is None else rep} {system:8s} "
                    f"lat/token {m['avg_latency_per_output_token_ms']:8.1f} ms  "
                    f"P90 {p90:8.1f} ms  {m['output_throughput']:6.1f} tok/s, {m['failed']} failed{extra}",
                    flush=True,
                )
        # The speed-of-light point: the most skewed workload with every request on the base model.
        base_requests = [dataclasses.replace(r, adapter=None) for r in requests]
        base_reference = run_point("unmerged", base_requests)
        print(
            f"[{time.monotonic() - t_start:5.0f}s] base model (no adapter), unmerged server: lat/token "
            f"{base_reference['avg_latency_per_output_token_ms']:8.1f} ms",
            flush=True,
        )

    result = {
        **provenance("bench.dynamic_batching_skew.run"),
        "vllm_command": shlex.join(vllm_command(args, base, adapters)),
        "dlora_config": dlora_config(args, "dlora", base, adapters, work / "state-dlora"),
        "machine": {
            **machine(),
            "platform": platform.platform(),
            "note": "2 shared cores; other CPU-heavy jobs ran at the same time (noisy)",
        },
        "workload": {
            "num_prompts": args.num_prompts,
            "num_adapters": NUM_ADAPTERS,
            "rank": RANK,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.rate,
            "arrivals": "Poisson",
            "popularity": "skewed (adapter a gets alpha^-a)",
            "alphas": args.alphas,
            "ignore_eos": True,
            "stream": True,
        },
        "skew": "alpha of the `skewed` popularity; top_share = expected share of the most popular adapter",
        "reps": args.reps,
        "points": median_points(rep_points(points, args.reps)),
        "rep_points": points,
        "base_model_reference": {
            "workload": f"alpha {args.alphas[-1]}'s requests, every one on the base model",
            "server": "unmerged",
            "metrics": base_reference,
        },
        "summary": summarize_reps(points, args.alphas, args.reps, base_reference),
        "wall_seconds": time.monotonic() - t_start,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
