"""run.py's dlora side at an older commit vs this checkout: 1,024 adapters found by name, Zipf 1.0.

Each commit serves its own configs/default.yaml with `server.resolve_adapters` on over the same
adapter directory (`max_loras` 8, as run.py), one server up at a time, started fresh for every rep
(so every rep's adapters start cold), the order alternating (`dlora/bench/commit_comparison.py`).
Targets: this checkout's median output throughput >= 0.95 of the older commit's, and its cold-tail
TTFT p99 (requests for adapters outside the 8 most popular) no more than 5% above it. Writes
bench/many_adapters/vs_<commit>.json (+ .png).

    .venv/bin/python -m bench.many_adapters.vs_commit --old-commit 827b8d9     # 1,024 adapters, 3 reps
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from bench.many_adapters.run import adapters_for, found_by_name, measure, workload, workload_record
from dlora import env
from dlora.bench.commit_comparison import commit_trees, fresh_server_runs, shipped_launchers
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
PORT = 8353
KEYS = ("output_throughput", "ttft_p50_ms", "ttft_p99_ms", "cold_ttft_p50_ms", "cold_ttft_p99_ms", "startup_s")


def plot(result: dict, path: Path) -> None:
    commits = result["commits"]
    plot_server_comparison(
        result,
        path,
        f"{result['workload']['adapters']} adapters found by name",
        panels=(
            ("output_throughput", "output tok/s"),
            ("ttft_p99_ms", "TTFT p99 ms"),
            ("cold_ttft_p99_ms", "cold-tail TTFT p99 ms"),
        ),
        subtitle=f"{commits['old'][:7]} vs {commits['new'][:7]} (medians of {result['reps']} fresh starts each)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-commit", required=True)
    ap.add_argument("--adapters", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="default: bench/many_adapters/vs_<old commit>.json")
    args = ap.parse_args()

    trees, commits = commit_trees(args.old_commit)
    base = prepare_smollm2()
    adapter_dir = adapters_for(base, args.adapters)[0].parent
    work = Path(env.cache_dir()) / "bench-many-adapters-commits"
    work.mkdir(parents=True, exist_ok=True)
    requests = workload(args, args.adapters)
    warm = generate_workload(WorkloadSpec(num_prompts=4, input_len=args.input_len, output_len=8, seed=1))

    runs = fresh_server_runs(
        shipped_launchers(trees, PORT, work, lambda cfg, state: found_by_name(cfg, adapter_dir)),
        f"http://127.0.0.1:{PORT}",
        work,
        args.reps,
        measure=lambda u: measure(u, requests),
        warm=lambda u: measure(u, warm),  # oneDNN's first-shape builds on the base model, no adapter load
        sources=trees,
    )
    median = {n: {k: statistics.median(r[k] for r in rs) for k in KEYS} for n, rs in runs.items()}
    tp = median["new"]["output_throughput"] / median["old"]["output_throughput"]
    cold = median["new"]["cold_ttft_p99_ms"] / median["old"]["cold_ttft_p99_ms"]
    result = {
        **provenance("bench.many_adapters.vs_commit"),
        "question": "do adapters found by name serve as fast with the node cache as at the older commit?",
        "commits": commits,
        "workload": {"adapters": args.adapters}
        | workload_record(args)
        | {"servers": "each commit's own configs/default.yaml with resolve_adapters, one up at a time, fresh per rep"},
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": {
            "throughput_ratio_new_over_old": tp,
            "cold_ttft_p99_ratio_new_over_old": cold,
            "ttft_p99_ratio_new_over_old": median["new"]["ttft_p99_ms"] / median["old"]["ttft_p99_ms"],
            "startup_ratio_new_over_old": median["new"]["startup_s"] / median["old"]["startup_s"],
            "failed": {n: sum(r["failed"] for r in rs) for n, rs in runs.items()},
            "targets": "throughput_ratio_new_over_old >= 0.95, cold_ttft_p99_ratio_new_over_old <= 1.05",
            "targets_met": tp >= 0.95 and cold <= 1.05,
        },
    }
    write_result(result, args.out or HERE / f"vs_{args.old_commit}.json", plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
