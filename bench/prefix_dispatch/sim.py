"""Multi-turn chat in the replica model at 8 and 32 replicas: today's dispatch vs prefix-aware
dispatch vs round-robin, the server's own dispatch code over modelled replicas with prefix caches
(`dlora/sim/prefix_model.py`).

Workload, as run.py's: conversations of `--turns` turns, each adapter (8, Zipf 1.0) with its own
system prompt of 500-1,000 tokens, each turn resending the history (the previous prompt, a 64-token
reply and a 40-120-token user turn); (a) `shared` as said, (b) `unique` with the same lengths and
arrivals and no shared prefix. The model is open-loop: a conversation's turns arrive `--gap` seconds
apart. Its replicas have the default config's KV (182 blocks of 128 tokens, fp32 SmolLM2 with 1 GiB)
and the CPU step costs (`cpu-einsum`). Conversations start as a Poisson stream at `--load` times the
request rate `today` completes on (a) with every request arriving at once (measured per seed).
Writes bench/prefix_dispatch/sim.json (+ .png).

    .venv/bin/python -m bench.prefix_dispatch.sim            # 8 and 32 replicas, 3 seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import numpy as np

from dlora.bench.plot import plot_grouped_servers
from dlora.bench.popularity import zipf_weights
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.stats import percentile
from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.sim.prefix_model import DISPATCH, PrefixCluster

HERE = Path(__file__).resolve().parent
NUM_ADAPTERS = 8
VOCAB = 49_152  # SmolLM2's; only distinctness matters
MODEL = ReplicaModel(max_running=64, kv_blocks=182, block_tokens=128)


@dataclasses.dataclass(frozen=True)
class Conversations:
    jobs: list[TraceRequest]
    prompts: list[tuple[int, ...]]
    turn: list[int]  # each request's turn in its conversation, from 1


def conversations(args, n: int, rate: float, shared: bool, seed: int) -> Conversations:
    """`n` conversations starting as a Poisson stream at `rate` per second (inf: all at 0)."""
    rng = np.random.default_rng(seed)
    shares = zipf_weights(NUM_ADAPTERS, 1.0)
    systems = [tuple(rng.integers(0, VOCAB, int(rng.integers(500, 1001)))) for _ in range(NUM_ADAPTERS)]
    starts = np.zeros(n) if rate == float("inf") else np.cumsum(rng.exponential(1 / rate, n))
    jobs, prompts, turns = [], [], []
    for c in range(n):
        a = int(rng.choice(NUM_ADAPTERS, p=shares))
        history: tuple[int, ...] = systems[a]
        for k in range(args.turns):
            prompt = history + tuple(rng.integers(0, VOCAB, int(rng.integers(40, 121))))
            sent = prompt if shared else tuple(rng.integers(0, VOCAB, len(prompt)))
            arrival = float(starts[c]) + (0.0 if rate == float("inf") else k * args.gap)
            jobs.append(TraceRequest(arrival, f"a{a}", len(sent), args.output_len, args.output_len))
            prompts.append(sent)
            turns.append(k + 1)
            history = prompt + tuple(rng.integers(0, VOCAB, args.output_len))
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrival)
    return Conversations([jobs[i] for i in order], [prompts[i] for i in order], [turns[i] for i in order])


def simulate(work: Conversations, replicas: int, dispatch: str, start_slack_s: float | None) -> dict:
    model = PrefixCluster(work.jobs, work.prompts, replicas, MODEL, dispatch, start_slack_s)
    out = model.run()
    later = [t for t, k in zip(out.ttft_s, work.turn) if k >= 2]
    span = max(j.arrival + lat for j, lat in zip(work.jobs, out.latency_s)) - min(j.arrival for j in work.jobs)
    return {
        "ttft_p50_s": percentile(out.ttft_s, 50),
        "ttft_p99_s": percentile(out.ttft_s, 99),
        "ttft_turn2plus_p50_s": percentile(later, 50),
        "output_throughput": sum(j.output_len for j in work.jobs) / span,
        "requests_per_s": len(work.jobs) / span,
        "hit_rate": model.hit_rate(),
        "locality_dispatches": model.locality_dispatches,
    }


def one_size(args, replicas: int) -> dict:
    n = args.conversations_per_replica * replicas
    runs: dict[str, dict[str, list[dict]]] = {"shared": {d: [] for d in DISPATCH}, "unique": {d: [] for d in DISPATCH}}
    rates = []
    for seed in range(args.seeds):
        burst = simulate(conversations(args, n, float("inf"), True, seed), replicas, "today", args.start_slack)
        rate = args.load * burst["requests_per_s"] / args.turns  # conversations per second
        rates.append(rate)
        for w in runs:
            work = conversations(args, n, rate, w == "shared", seed)
            for d in DISPATCH:
                runs[w][d].append(simulate(work, replicas, d, args.start_slack))
        print(f"[{replicas} replicas] seed {seed}: {rate:.3f} conversations/s", flush=True)
    out: dict = {"replicas": replicas, "conversations": n, "conversation_rates": rates, "workloads": {}}
    for w, by_d in runs.items():
        median = {d: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for d, rs in by_d.items()}
        out["workloads"][w] = {
            "runs": by_d,
            "median": median,
            "ttft_p50_today_over_prefix": median["today"]["ttft_p50_s"] / median["prefix"]["ttft_p50_s"],
            "ttft_p99_today_over_prefix": median["today"]["ttft_p99_s"] / median["prefix"]["ttft_p99_s"],
            "throughput_prefix_over_today": median["prefix"]["output_throughput"]
            / median["today"]["output_throughput"],
        }
        hits = ", ".join(f"{d} {m['hit_rate']:.2f}" for d, m in median.items())
        ratio = out["workloads"][w]["ttft_p50_today_over_prefix"]
        print(f"[{replicas} replicas] {w}: TTFT p50 today/prefix {ratio:.2f}, hit rate {hits}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    groups = {
        f"{s['replicas']} replicas\n{w}": s["workloads"][w] for s in result["sizes"] for w in ("shared", "unique")
    }
    plot_grouped_servers(
        groups,
        path,
        list(DISPATCH),
        (("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"), ("hit_rate", "prefix-cache hit rate")),
        f"multi-turn chat in the replica model, load {result['load']} of today's burst rate "
        f"(medians of {result['seeds']} seeds)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--conversations-per-replica", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--gap", type=float, default=10.0, help="seconds between a conversation's turns")
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--start-slack",
        type=float,
        default=0.05,
        help="cluster.dispatch_start_slack_s (the default config's); <0: none",
    )
    ap.add_argument("--out", default=str(HERE / "sim.json"))
    args = ap.parse_args()
    args.start_slack = None if args.start_slack < 0 else args.start_slack
    sizes = [one_size(args, n) for n in args.replicas]
    result = {
        **provenance("bench.prefix_dispatch.sim"),
        "question": "how much does prefix-aware dispatch lower multi-turn TTFT as replicas grow (model)?",
        "model": dataclasses.asdict(MODEL) | {"costs": "cpu-einsum"},
        "workload": {
            "turns": args.turns,
            "output_len": args.output_len,
            "gap_s": args.gap,
            "system_prompt_tokens": [500, 1000],
            "user_turn_tokens": [40, 120],
            "adapters": NUM_ADAPTERS,
            "popularity": "zipf alpha 1.0",
        },
        "load": args.load,
        "start_slack_s": args.start_slack,
        "seeds": args.seeds,
        "sizes": sizes,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
