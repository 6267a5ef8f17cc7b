"""Cluster balancing with more replicas than this machine has cores: the real router, dispatch and
balancer over simulated replicas (dlora/sim/cluster.py).

bench/cluster_balancing runs the policies on two real engines, where the static placement of
8 Zipf(1.5) adapters is only 69/31 unbalanced and a CV-3 burst fills both replicas at once. This
runs the same policies and workload shape (Zipf adapters, Gamma arrivals, 48 in / 32 out) on
`--replicas` queueing-model replicas over `--adapters` adapters, at `--loads` fractions of the
cluster's capacity, over `--seeds` workload seeds. Reported per load: the median over seeds of each
policy's mean queueing delay, and baseline / dlora ratios (median of each seed's own ratio), the
same rule as the real benchmark. `--eos-means 16,32,64` makes lengths unknown at dispatch
(per-adapter geometric lengths capped at `--output-len`). Writes bench/cluster_sim/result.json (+ .png).

    .venv/bin/python -m bench.cluster_sim.run                      # 8 replicas, 32 adapters (~10 min)
    .venv/bin/python -m bench.cluster_sim.run --replicas 2 --adapters 8 --out bench/cluster_sim/runs/DATE-2x8.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.sim.cluster import POLICIES, ClusterSimSpec, simulate, static_shares

HERE = Path(__file__).resolve().parent

DLORA = "proactive_migration"
BASELINES = ("round_robin_static", "round_robin", "proactive")


def run_load(spec: ClusterSimSpec, load: float, args, t0: float) -> dict:
    rate = load * spec.capacity_rps
    runs: dict[str, list[dict]] = {p: [] for p in args.policies}
    for seed in range(args.seeds):
        for policy in args.policies:
            r = asyncio.run(simulate(spec, policy, rate, args.num_requests, seed)).summary()
            runs[policy].append(r)
            print(
                f"[{time.monotonic() - t0:5.0f}s] load {load:.2f} seed {seed} {policy:20s} queue "
                f"{r['mean_queue_ms']:7.0f} ms (p90 {r['p90_queue_ms']:7.0f})  TTFT {r['mean_ttft_ms']:7.0f} ms  "
                f"migrated {r['migrations']}",
                flush=True,
            )
    point = {
        "load": load,
        "rate": rate,
        "runs": runs,
        **{
            key: {p: statistics.median(r[key] for r in rs) for p, rs in runs.items()}
            for key in ("mean_queue_ms", "mean_ttft_ms", "migrations")
        },
    }
    if DLORA in runs:
        point["queueing_vs"] = {
            b: statistics.median(
                x["mean_queue_ms"] / max(d["mean_queue_ms"], 1e-9) for x, d in zip(runs[b], runs[DLORA])
            )
            for b in BASELINES
            if b in runs
        }
    return point


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    points = result["points"]
    for policy in result["policies"]:
        ax.plot([p["load"] for p in points], [p["mean_queue_ms"][policy] for p in points], "o-", label=policy)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (fraction of the cluster's capacity)")
    ax.set_ylabel("mean queueing delay (ms), median over seeds")
    s = result["spec"]
    ax.set_title(
        f"simulated: {s['replicas']} replicas, {s['adapters']} adapters (Zipf {s['alpha']}), CV {s['cv']}, "
        f"{result['num_requests']} requests x {result['seeds']} seeds",
        fontsize=8,
    )
    ax.legend(fontsize=8)
    save_figure(fig, path)


def parse_args() -> argparse.Namespace:
    d = ClusterSimSpec()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument("--adapters", type=int, default=d.adapters)
    ap.add_argument("--max-running", type=int, default=d.max_running)
    ap.add_argument(
        "--max-loras", type=int, default=None, help="distinct adapters per replica at once (default: no limit)"
    )
    ap.add_argument("--step-s", type=float, default=d.step_s)
    ap.add_argument("--output-len", type=int, default=d.output_len)
    ap.add_argument(
        "--eos-means", default="", help="comma-separated mean lengths cycled over adapters (unknown lengths)"
    )
    ap.add_argument("--alpha", type=float, default=d.alpha)
    ap.add_argument("--cv", type=float, default=d.cv)
    ap.add_argument("--loads", default="0.5,0.7,0.85")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    args.policies = args.policies.split(",")
    for p in args.policies:
        if p not in POLICIES:
            ap.error(f"--policies: unknown policy {p!r}; known: {', '.join(POLICIES)}")
    return args


def main() -> int:
    args = parse_args()
    spec = ClusterSimSpec(
        replicas=args.replicas,
        adapters=args.adapters,
        max_running=args.max_running,
        max_loras=args.max_loras,
        step_s=args.step_s,
        output_len=args.output_len,
        alpha=args.alpha,
        cv=args.cv,
        eos_means=tuple(int(x) for x in args.eos_means.split(",") if x),
    )
    shares = static_shares(spec)
    print(
        f"capacity {spec.capacity_rps:.1f} req/s; static placement's busiest replica gets {max(shares):.2f} "
        f"of the requests (even: {1 / spec.replicas:.2f})",
        flush=True,
    )
    t0 = time.monotonic()
    points = [run_load(spec, float(x), args, t0) for x in args.loads.split(",")]
    summary = {}
    if all("queueing_vs" in p for p in points):
        for b in BASELINES:
            if b in args.policies:
                summary[f"queueing_vs_{b}_min"] = min(p["queueing_vs"][b] for p in points)
        summary["per_load"] = {str(p["load"]): p["queueing_vs"] for p in points}
    result = {
        **provenance("bench.cluster_sim.run"),
        "spec": asdict(spec),
        "capacity_rps": spec.capacity_rps,
        "static_placement_shares": shares,
        "policies": args.policies,
        "num_requests": args.num_requests,
        "seeds": args.seeds,
        "points": points,
        "summary": summary,
        "wall_s": time.monotonic() - t0,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
