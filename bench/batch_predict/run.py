"""How long sample-then-simulate and the stage planner take on a large offline batch: 100,000
requests over 256 adapters on 32 replicas (the size a batch planner must handle in a few seconds),
and how much faster the stage plan is than sending everything at once, in simulation.

    .venv/bin/python -m bench.batch_predict.run            # 32 x 256 x 100,000, 5 reps, ~1 min
    .venv/bin/python -m bench.batch_predict.run --quick    # 8 x 64 x 10,000

Requests pick adapters by Zipf(1.0); prompt lengths are log-normal (median 150 tokens, clipped to
4..2048), max_tokens 512. Each adapter has a history of 256 output lengths (geometric, its own mean
drawn from 20..400), as the router's output-length window would hold. Every replica has the
default step-cost priors. Each rep times `dlora.batch.predict.predict` (draw lengths, dispatch,
simulate every replica) on the same inputs with a different sampling seed; reported: the median
and max time, the predicted makespan per rep (its spread is the sampling noise). Then, per merged
step cost ratio (0.6, the GPU-shaped prior, and 0.85, the einsum CPU kernels' prior), each rep
times `dlora.batch.plan.plan_stages` (lengths drawn, then the plan) and compares its simulated
makespan with `dispatch_plan`'s (every request sent at once, the router's least-work dispatch,
steps merged only where a replica happens to run one adapter). Writes bench/batch_predict/result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

from dlora.batch.plan import PlannedLine, dispatch_plan, plan_stages
from dlora.batch.predict import RequestWork, predict, sample_lengths
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.cluster.estimators.replica_cost import CostParams

HERE = Path(__file__).resolve().parent


def workload(requests: int, adapters: int, seed: int) -> tuple[list[RequestWork], dict[str, list[int]]]:
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(adapters)]
    weights = [1 / (k + 1) for k in range(adapters)]
    chosen = rng.choices(names, weights, k=requests)
    works = [RequestWork(a, min(2048, max(4, int(rng.lognormvariate(5.0, 1.0)))), 512) for a in chosen]
    history = {}
    for a in names:
        mean = rng.uniform(20, 400)
        history[a] = [min(512, 1 + int(rng.expovariate(1 / mean))) for _ in range(256)]
    return works, history


MERGED_RATIOS = (0.6, 0.85)


def plan_reps(works: list[RequestWork], history: dict[str, list[int]], args, ratio: float) -> dict:
    """Per rep: the stage planner's time (lengths drawn, segments chosen) and its makespan against
    sending every request at once, with merged steps at `ratio` of an unmerged step's cost."""
    params = [CostParams(merged_ratio=ratio)] * args.replicas
    out: dict[str, list] = {"plan_seconds": [], "plan_makespan_s": [], "fcfs_makespan_s": [], "segments": []}
    for rep in range(args.reps):
        t0 = time.perf_counter()
        drawn = sample_lengths(works, lambda a: history.get(a, []), random.Random(rep))
        jobs = [PlannedLine(w.adapter, (w.prompt_tokens,), (n,)) for w, n in zip(works, drawn)]
        plan = plan_stages(jobs, params)
        out["plan_seconds"].append(time.perf_counter() - t0)
        flat = dispatch_plan(jobs, params)
        out["plan_makespan_s"].append(plan.makespan_s)
        out["fcfs_makespan_s"].append(flat.makespan_s)
        out["segments"].append(len(plan.segments))
        print(
            f"merged ratio {ratio}, rep {rep + 1}/{args.reps}: planned in {out['plan_seconds'][-1]:.2f} s, "
            f"{len(plan.segments)} segments, makespan {plan.makespan_s:.0f} s vs {flat.makespan_s:.0f} s sent at once",
            flush=True,
        )
    out["makespan_vs_fcfs_plan"] = [f / p for f, p in zip(out["fcfs_makespan_s"], out["plan_makespan_s"])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=256)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 replicas, 64 adapters, 10,000 requests, 2 reps")
    ap.add_argument("--out", type=Path, default=HERE / "result.json")
    args = ap.parse_args()
    if args.quick:
        args.replicas, args.adapters, args.requests, args.reps = 8, 64, 10_000, 2
    works, history = workload(args.requests, args.adapters, args.seed)
    params = [CostParams()] * args.replicas
    seconds, makespans = [], []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        plan = predict(works, params, lambda a: history.get(a, []), seed=rep)
        seconds.append(time.perf_counter() - t0)
        makespans.append(plan.makespan_s)
        print(f"rep {rep + 1}/{args.reps}: {seconds[-1]:.2f} s, predicted makespan {plan.makespan_s:.0f} s", flush=True)
    per_replica = [plan.replica_of.count(r) for r in range(args.replicas)]
    planner = {str(ratio): plan_reps(works, history, args, ratio) for ratio in MERGED_RATIOS}
    result = {
        **provenance("bench.batch_predict.run"),
        "setup": {
            "replicas": args.replicas,
            "adapters": args.adapters,
            "requests": args.requests,
            "reps": args.reps,
            "cost_params": dataclasses.asdict(CostParams()),
        },
        "predict_seconds": seconds,
        "predicted_makespan_s": makespans,
        "requests_per_replica_min_max": [min(per_replica), max(per_replica)],
        "planner": planner,
        "summary": {
            "plan_seconds_median": statistics.median(t for p in planner.values() for t in p["plan_seconds"]),
            "plan_seconds_max": max(t for p in planner.values() for t in p["plan_seconds"]),
            **{
                f"makespan_vs_fcfs_plan_merged_ratio_{ratio}": statistics.median(p["makespan_vs_fcfs_plan"])
                for ratio, p in planner.items()
            },
            "predict_seconds_median": statistics.median(seconds),
            "predict_seconds_max": max(seconds),
            "target_seconds": 5.0,
            "predicted_makespan_spread": (max(makespans) - min(makespans)) / statistics.median(makespans),
        },
    }
    write_result(result, args.out, indent=1, print_summary=False)
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
