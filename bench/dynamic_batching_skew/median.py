"""Medians over repeated bench.dynamic_batching_skew runs: one noisy run decides nothing.

Each run's points are (system, skew) -> latency per output token. This takes the median of every
point over the runs, recomputes the summary from those medians (`summarize`, the same
function a single run uses), and keeps each run's own summary beside it, so both "the median run"
and "the median of each ratio" can be read. The runs must share a workload (checked).

    .venv/bin/python -m bench.dynamic_batching_skew.median bench/dynamic_batching_skew/result.json \\
        RUN2.json ... --out bench/dynamic_batching_skew/runs/DATE-median-of-runs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.dynamic_batching_skew.run import (
    SYSTEMS,
    median_points,
    median_ratios,
    plot,
    summarize,
)
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="result JSONs of bench.dynamic_batching_skew.run (same workload)")
    ap.add_argument("--out", required=True, help="result JSON of the medians")
    args = ap.parse_args()
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    if any(r["workload"] != runs[0]["workload"] for r in runs):
        raise SystemExit("the runs have different workloads; medians over them would mean nothing")
    skews = runs[0]["workload"]["alphas"]
    points = median_points([r["points"] for r in runs])
    bases = [r["base_model_reference"] for r in runs if r.get("base_model_reference")]
    base = (
        {
            "avg_latency_per_output_token_ms": statistics.median(
                b["metrics"]["avg_latency_per_output_token_ms"] for b in bases
            )
        }
        if len(bases) == len(runs)
        else None
    )
    summary = summarize(points, skews, base)
    per_run = [r["summary"] for r in runs]
    result = {
        **provenance("bench.dynamic_batching_skew.median"),
        "runs": args.runs,
        "workload": runs[0]["workload"],
        "points": points,
        "base_model_reference": {"metrics": base} if base else None,
        "summary": summary | {"median_of_run_ratios": median_ratios(per_run)},
        "per_run_summary": per_run,
    }
    for system in SYSTEMS:
        row = [p for p in points if p["policy"] == system]
        print(f"{system:9s}", " ".join(f"{p['metrics']['avg_latency_per_output_token_ms']:7.1f}" for p in row))
    print({k: round(v, 3) for k, v in summary.items() if isinstance(v, float)})
    own = median_ratios(per_run)
    print("median of the runs' own ratios:", {k: round(v, 3) for k, v in own.items() if k != "per_skew"})
    for skew, r in own["per_skew"].items():
        print(f"  skew {skew}:", {k: round(v, 3) for k, v in r.items()})
    write_result(result, args.out, plot)  # the same plot, of the medians
    return 0


if __name__ == "__main__":
    sys.exit(main())
