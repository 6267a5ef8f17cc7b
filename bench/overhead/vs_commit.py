"""The base-model workload of run.py on configs/default.yaml at an older commit vs this checkout.

Each commit serves its own configs/default.yaml (so the older one keeps its KV cache size and
everything else it shipped), one server up at a time, started fresh for every rep, the order
alternating (`dlora/bench/commit_comparison.py`). Target: this checkout's median output throughput
within 3% of the older commit's. Writes bench/overhead/vs_<commit>.json (+ .png).

    .venv/bin/python -m bench.overhead.vs_commit --old-commit 8618c61     # 3 reps each
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.overhead.run import base_model_workload, workload_record
from dlora import env
from dlora.bench.commit_comparison import commit_trees, fresh_server_runs, shipped_launchers
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import METRICS, run_once
from dlora.bench.stats import medians

HERE = Path(__file__).resolve().parent
PORT = 8324
TARGET = 0.97


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-commit", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="default: bench/overhead/vs_<old commit>.json")
    args = ap.parse_args()

    trees, commits = commit_trees(args.old_commit)
    work = Path(env.cache_dir()) / "bench-overhead-commits"
    work.mkdir(parents=True, exist_ok=True)
    requests = base_model_workload(args)
    url = f"http://127.0.0.1:{PORT}"
    runs = fresh_server_runs(
        shipped_launchers(trees, PORT, work),
        url,
        work,
        args.reps,
        measure=lambda u: run_once(u, requests),
        warm=lambda u: run_once(u, requests[:4]),
        sources=trees,
    )
    median = medians(runs, (*METRICS, "startup_s"))
    ratio = median["new"]["output_throughput"] / median["old"]["output_throughput"]
    rep_ratios = [n["output_throughput"] / o["output_throughput"] for n, o in zip(runs["new"], runs["old"])]
    result = {
        **provenance("bench.overhead.vs_commit"),
        "question": "does this checkout's default config serve base-model traffic as fast as an older commit's?",
        "commits": commits,
        "workload": workload_record(args)
        | {"servers": "each commit's own configs/default.yaml, one up at a time, fresh per rep"},
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": {
            "throughput_ratio_new_over_old": ratio,
            "median_of_rep_throughput_ratios": statistics.median(rep_ratios),
            "rep_throughput_ratios": rep_ratios,
            "ttft_ratio_old_over_new": median["old"]["median_ttft_ms"] / median["new"]["median_ttft_ms"],
            "tpot_ratio_old_over_new": median["old"]["median_tpot_ms"] / median["new"]["median_tpot_ms"],
            "target": f"throughput_ratio_new_over_old >= {TARGET}",
            "target_met": ratio >= TARGET,
        },
    }
    title = f"default config at HEAD / {args.old_commit}, base model: throughput ratio {ratio:.3f}"
    out = args.out or HERE / f"vs_{args.old_commit}.json"
    write_result(result, out, lambda r, p: plot_server_comparison(r, p, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
