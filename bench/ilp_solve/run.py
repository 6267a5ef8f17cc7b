"""Co-migration planning time vs problem size: the selective, aggregated, relaxed ILP.

    .venv/bin/python -m bench.ilp_solve.run          # full grid, 20 seeds x 3 runs each, ~30-60 s
    .venv/bin/python -m bench.ilp_solve.run --quick  # 3 seeds, smallest and largest sizes

For each (requests, replicas, adapters) up to 1,000 x 32 x 128 and each seed it builds a skewed
snapshot (`dlora.bench.synthetic_cluster.skewed_cluster`: Zipf(1.1) adapters, Dirichlet(0.7) request
split) and times `plan_migration` with HiGHS, CBC and the greedy alone, `--reps` times each,
alternating the planner order between runs (percentiles are over seeds x reps). `solve_ms` is
the whole planning call (problem + PuLP model + solver + rounding; plus the greedy when the solver
hit the limit), `solver_ms` the PuLP model and solver part. The default config is used (top-K = 2,
time limit 50 ms, y relaxed and rounded); the largest size is also run with top-K = 4, with binary
y, and with an extreme skew (Dirichlet(0.05)). Quality is the planned makespan relative to before
(lower is better). Writes bench/ilp_solve/result.json and result.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from importlib.metadata import version
from pathlib import Path

from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import machine as provenance_machine
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.stats import percentile
from dlora.bench.synthetic_cluster import skewed_cluster
from dlora.cluster.migration.ilp import plan_migration
from dlora.cluster.migration.lp_solve import highs_available
from dlora.cluster.migration.problem import MigrationConfig

HERE = Path(__file__).resolve().parent
SIZES = [(100, 4, 16), (250, 8, 32), (500, 16, 64), (1000, 16, 128), (1000, 32, 128)]
EXTREME_SKEW = 0.05  # an extra run at the largest size: nearly all requests on a few replicas
TARGET_P95_MS = 50.0


def variants(largest: bool) -> list[tuple[str, MigrationConfig]]:
    solvers = (["highs"] if highs_available() else []) + ["cbc", "greedy"]
    out = [(s, MigrationConfig(solver=s)) for s in solvers]
    if largest:
        first = solvers[0]
        out += [
            (f"{first} top_k=4", MigrationConfig(solver=first, top_k=4)),
            (f"{first} binary y", MigrationConfig(solver=first, binary_adapters=True)),
        ]
    return out


def run_size(size: tuple[int, int, int], seeds: int, reps: int, skew: float = 0.7) -> list[dict]:
    names = variants(size == SIZES[-1] and skew == 0.7)
    samples: dict[str, list] = {name: [] for name, _ in names}
    for seed in range(seeds):
        cluster = skewed_cluster(*size, seed=seed, skew=skew)
        for rep in range(reps):
            order = names if (seed + rep) % 2 == 0 else names[::-1]
            for name, cfg in order:
                samples[name].append(plan_migration(cluster, {}, cfg))
    rows = []
    for name, cfg in names:
        plans = samples[name]
        total, solver = [p.solve_ms for p in plans], [p.solver_ms for p in plans]
        rows.append(
            {
                "requests": size[0],
                "replicas": size[1],
                "adapters": size[2],
                "skew": skew,
                "planner": name,
                "config": dataclasses.asdict(cfg),
                "seeds": seeds,
                "samples": len(plans),
                "p50_ms": round(statistics.median(total), 2),
                "p95_ms": round(percentile(total, 95), 2),
                "max_ms": round(max(total), 2),
                "solver_p50_ms": round(statistics.median(solver), 2),
                "fallbacks": sum(p.status.startswith("fallback") for p in plans),
                "statuses": sorted({p.status for p in plans}),
                "moves_mean": round(statistics.mean(len(p.moves) for p in plans), 1),
                "loads_mean": round(statistics.mean(len(p.loads) for p in plans), 1),
                "makespan_ratio_mean": round(statistics.mean(p.makespan_after / p.makespan_before for p in plans), 3),
                "objective_ratio_mean": round(
                    statistics.mean(p.objective_after / p.objective_before for p in plans), 3
                ),
            }
        )
    return rows


def machine(load_at_start: tuple[float, ...]) -> dict:
    """Versions and the host's load: other CPU-heavy jobs share these 2 vCPUs, which moves p95."""
    return {
        **provenance_machine(),
        "platform": platform.platform(),
        "pulp": version("pulp"),
        "highspy": version("highspy") if highs_available() else None,
        "loadavg_1_5_15min_at_start": load_at_start,
        "loadavg_1_5_15min_at_end": os.getloadavg(),
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = [r for r in result["rows"] if r["planner"] in ("highs", "cbc", "greedy") and r["skew"] == 0.7]
    labels = [f"{r}x{j}x{k}" for r, j, k in SIZES if any(x["requests"] == r and x["replicas"] == j for x in rows)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for planner, color in (("highs", "tab:blue"), ("cbc", "tab:orange"), ("greedy", "tab:green")):
        sel = [r for r in rows if r["planner"] == planner]
        if sel:
            xs = range(len(sel))
            ax.plot(xs, [r["p50_ms"] for r in sel], "o-", color=color, label=f"{planner} p50")
            ax.plot(xs, [r["p95_ms"] for r in sel], "s--", color=color, label=f"{planner} p95")
    ax.axhline(TARGET_P95_MS, color="red", lw=1, ls=":", label="target: 50 ms p95")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_xlabel("requests x replicas x adapters")
    ax.set_ylabel("plan_migration wall time (ms)")
    ax.set_title(f"Co-migration planning time, top-K=2, {result['machine']['cores']} vCPU (shared)", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per seed and planner")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=HERE / "result.json")
    args = ap.parse_args()
    sizes = [SIZES[0], SIZES[-1]] if args.quick else SIZES
    seeds = 3 if args.quick else args.seeds
    plan_migration(skewed_cluster(*SIZES[0], seed=99), {}, MigrationConfig())  # imports, warm caches
    load_at_start = os.getloadavg()
    t0 = time.perf_counter()
    rows = [row for size in sizes for row in run_size(size, seeds, args.reps)]
    rows += run_size(SIZES[-1], seeds, args.reps, skew=EXTREME_SKEW)
    largest = [r for r in rows if (r["requests"], r["replicas"], r["adapters"], r["skew"]) == (*SIZES[-1], 0.7)]
    default = next(r for r in largest if r["planner"] == ("highs" if highs_available() else "cbc"))
    result = {
        **provenance("bench.ilp_solve.run"),
        "machine": machine(load_at_start),
        "wall_s": round(time.perf_counter() - t0, 1),
        "summary": {
            "p95_ms_largest": default["p95_ms"],
            "p50_ms_largest": default["p50_ms"],
            "planner_largest": default["planner"],
            "target_p95_ms": TARGET_P95_MS,
            "meets_target": default["p95_ms"] <= TARGET_P95_MS,
            "size_largest": list(SIZES[-1]),
        },
        "rows": rows,
    }
    write_result(result, args.out, plot, indent=1, print_summary=False)
    print(f"{'size':>14} {'skew':>5} {'planner':>16} {'p50':>7} {'p95':>7} {'max':>7} {'solver':>7} fb  moves makespan")
    for r in rows:
        size = f"{r['requests']}x{r['replicas']}x{r['adapters']}"
        print(
            f"{size:>14} {r['skew']:5.2f} {r['planner']:>16} {r['p50_ms']:7.1f} {r['p95_ms']:7.1f} {r['max_ms']:7.1f} "
            f"{r['solver_p50_ms']:7.1f} {r['fallbacks']:2d} {r['moves_mean']:6.1f} {r['makespan_ratio_mean']:.3f}"
        )
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
