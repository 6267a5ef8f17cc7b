"""How long sample-then-simulate takes on a large offline batch: 100,000 requests over 256 adapters
on 32 replicas (the size a batch planner must handle in a few seconds).

    .venv/bin/python -m bench.batch_predict.run            # 32 x 256 x 100,000, 5 reps, ~1 min
    .venv/bin/python -m bench.batch_predict.run --quick    # 8 x 64 x 10,000

Requests pick adapters by Zipf(1.0); prompt lengths are log-normal (median 150 tokens, clipped to
4..2048), max_tokens 512. Each adapter has a history of 256 output lengths (geometric, its own mean
drawn from 20..400), as the router's output-length window would hold. Every replica has the
default step-cost priors. Each rep times `dlora.batch.predict.predict` (draw lengths, dispatch,
simulate every replica) on the same inputs with a different sampling seed; reported: the median
and max time, the predicted makespan per rep (its spread is the sampling noise), and the number
of simulated engine steps. Writes bench/batch_predict/result.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

from dlora.batch.predict import Work, predict
from dlora.bench.provenance import provenance
from dlora.cluster.estimators.cost_model import CostParams

HERE = Path(__file__).resolve().parent


def workload(requests: int, adapters: int, seed: int) -> tuple[list[Work], dict[str, list[int]]]:
    rng = random.Random(seed)
    names = [f"a{i}" for i in range(adapters)]
    weights = [1 / (k + 1) for k in range(adapters)]
    chosen = rng.choices(names, weights, k=requests)
    works = [Work(a, min(2048, max(4, int(rng.lognormvariate(5.0, 1.0)))), 512) for a in chosen]
    history = {}
    for a in names:
        mean = rng.uniform(20, 400)
        history[a] = [min(512, 1 + int(rng.expovariate(1 / mean))) for _ in range(256)]
    return works, history


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
        "summary": {
            "predict_seconds_median": statistics.median(seconds),
            "predict_seconds_max": max(seconds),
            "target_seconds": 5.0,
            "predicted_makespan_spread": (max(makespans) - min(makespans)) / statistics.median(makespans),
        },
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
