"""Multi-turn chat on two real replicas: today's dispatch vs prefix-aware dispatch vs round-robin.

Each system is configs/default.yaml (two single-core replicas, fp32 SmolLM2-135M) serving 8 random
rank-8 q/k/v/o adapters, with only `cluster.dispatch` / `cluster.prefix_aware_dispatch` changed:

- `today`: proactive dispatch blind to prefix caches (`prefix_aware_dispatch: false`);
- `prefix`: proactive dispatch pricing the prefill a replica's prefix cache saves (the default);
- `round_robin`: in turn, the locality-blind baseline.

Workloads (`dlora/bench/conversations.py`): (a) `shared`: conversations of `--turns` turns, each
adapter with its own system prompt of 500-1,000 tokens, every turn resending the history with the
real replies, Zipf 1.0 popularity over the adapters; (b) `unique`: the same adapters, lengths and
arrivals with no shared prefix. Conversations start as a Poisson stream at `--load` times the
conversation rate `today` sustains on (a) with every conversation started at once, measured first
in the same run. Each rep starts each system fresh (empty caches), in rotating order, and runs (a)
then (b) on it (`dlora/bench/commit_comparison.py`'s one-server-at-a-time runs). Reported per
system and workload: TTFT p50/p99 (all turns; turns >= 2), output throughput, and the prefix-cache
hit rate the engines report (`dlora_prefix_cache_hit_tokens_total` / `..._prompt_tokens_total`),
and, from each turn's cached prompt tokens, what TTFT p50 perfect locality would give
(`dlora/bench/locality_bound.py`).
Writes bench/prefix_dispatch/result.json (+ .png).

    .venv/bin/python -m bench.prefix_dispatch.run        # 12 conversations, 3 reps: about an hour on 2 cores
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from dlora import env
from dlora.bench.commit_comparison import fresh_server_runs
from dlora.bench.conversation_runner import run_conversations
from dlora.bench.conversations import ConversationSpec, generate_conversations
from dlora.bench.locality_bound import locality_bound
from dlora.bench.plot import plot_grouped_servers
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.scrape import metric_total, scrape
from dlora.bench.server_configs import adapter_entries, shipped_server_config
from dlora.bench.servers import make_random_adapters, start_dlora, stop, wait_healthy
from dlora.cluster.prefix_locality import DEFAULT_BLOCK_TOKENS
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
PORT = 8361
NUM_ADAPTERS = 8
SYSTEMS = {
    "today": {"dispatch": "proactive", "prefix_aware_dispatch": False},
    "prefix": {"dispatch": "proactive", "prefix_aware_dispatch": True},
    "round_robin": {"dispatch": "round_robin", "prefix_aware_dispatch": False},
}
# /metrics counters read before and after each workload run: the hit rate's two, dispatches decided
# by locality, and what makes a held history useless: a merge or unmerge (blocks are reused only in
# the weight state they were computed in), a move to the other replica, a preemption
COUNTERS = {
    "prompt_tokens": "dlora_prefix_cache_prompt_tokens_total",
    "hit_tokens": "dlora_prefix_cache_hit_tokens_total",
    "locality_dispatches": "dlora_dispatch_locality_total",
    "switches": "dlora_switches_total",
    "migrations": "dlora_migrations_total",
    "preemptions": "dlora_preemptions_total",
}
# What each turn's record keeps: enough for the perfect-locality estimate (dlora/bench/locality_bound.py)
TURN_KEYS = ("conversation_id", "turn", "status", "ttft_s", "prompt_tokens", "cached_tokens")
KEYS = (
    "ttft_p50_s",
    "ttft_p99_s",
    "ttft_turn2plus_p50_s",
    "ttft_turn2plus_p99_s",
    "output_throughput",
    "hit_rate",
    *(name for name in COUNTERS if not name.endswith("_tokens")),
)


def config(name: str, adapters: list[Path], work: Path) -> dict:
    cfg = shipped_server_config(PORT, str(work / f"state-{name}"))
    cfg["adapters"] = adapter_entries(adapters)
    cfg["cluster"] |= SYSTEMS[name]
    cfg["server"]["enable_prompt_tokens_details"] = True  # each turn's cached tokens, for the bound
    return cfg


def spec(args, shared: bool, rate: float) -> ConversationSpec:
    return ConversationSpec(
        num_conversations=args.conversations,
        adapters=tuple(f"a{i}" for i in range(NUM_ADAPTERS)),
        alpha=1.0,
        turns=args.turns,
        system_prompt_tokens=(500, 1000),
        output_len=args.output_len,
        conversation_rate=rate,
        think_time_s=args.think_time,
        max_model_len=2048,
        shared_prefixes=shared,
        seed=args.seed,
    )


def measure(url: str, conversations, deadline_s: float) -> dict:
    """One workload run: the driver's summary, the engines' prefix-cache hit rate over it, and the
    counters of what else moves a conversation's cache away (COUNTERS)."""
    before = scrape(url)
    out = run_conversations(url, conversations, deadline_s=deadline_s, disable_tqdm=True)
    after = scrape(url)
    counted = {name: metric_total(after, metric) - metric_total(before, metric) for name, metric in COUNTERS.items()}
    sent, hit = counted.pop("prompt_tokens"), counted.pop("hit_tokens")
    turns = [{k: t[k] for k in TURN_KEYS} for t in out["turns"]]
    return out["summary"] | {"hit_rate": hit / sent if sent else 0.0, **counted, "turns": turns}


def saturated_rate(args, adapters: list[Path], work: Path, tokenizer) -> dict:
    """Conversations per second `today` completes on (a) with every conversation started at once."""
    proc = start_dlora(config("today", adapters, work), work, "saturation")
    url = f"http://127.0.0.1:{PORT}"
    try:
        wait_healthy(url, proc, work / "saturation.log", timeout=1200)
        m = measure(url, generate_conversations(spec(args, True, math.inf), tokenizer), math.inf)
    finally:
        stop(proc)
    rate = args.conversations / m["duration_s"]
    print(f"saturated: {rate:.3f} conversations/s ({m['completed']} turns in {m['duration_s']:.0f} s)", flush=True)
    return {"conversations_per_s": rate, "run": m}


def plot(result: dict, path: Path) -> None:
    plot_grouped_servers(
        result["workloads"],
        path,
        list(SYSTEMS),
        (("ttft_p50_s", "TTFT p50 s"), ("ttft_p99_s", "TTFT p99 s"), ("output_throughput", "output tok/s")),
        f"multi-turn chat on 2 replicas, {NUM_ADAPTERS} adapters, load {result['load']} of today's saturated rate "
        f"(medians of {result['reps']} fresh starts each)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=2.0, help="seconds between a reply and the next turn")
    ap.add_argument("--load", type=float, default=0.6, help="of today's saturated conversation rate")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds a workload run may take")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    base = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(base)
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", NUM_ADAPTERS, 8)
    work = Path(env.cache_dir()) / "bench-prefix-dispatch"
    work.mkdir(parents=True, exist_ok=True)
    saturation = saturated_rate(args, adapters, work, tokenizer)
    rate = args.load * saturation["conversations_per_s"]
    workloads = {w: generate_conversations(spec(args, w == "shared", rate), tokenizer) for w in ("shared", "unique")}

    def measure_both(url: str) -> dict:
        return {w: measure(url, convs, args.deadline) for w, convs in workloads.items()}

    launchers = {n: (lambda n=n: start_dlora(config(n, adapters, work), work, n)) for n in SYSTEMS}
    runs = fresh_server_runs(launchers, f"http://127.0.0.1:{PORT}", work, args.reps, measure_both)
    by_workload: dict[str, dict] = {}
    for w in workloads:
        w_runs = {n: [r[w] for r in rs] for n, rs in runs.items()}
        median = {n: {k: statistics.median(r[k] for r in rs) for k in KEYS} for n, rs in w_runs.items()}
        by_workload[w] = {
            "runs": w_runs,
            "median": median,
            "summary": {
                "ttft_p50_today_over_prefix": median["today"]["ttft_p50_s"] / median["prefix"]["ttft_p50_s"],
                "ttft_p99_today_over_prefix": median["today"]["ttft_p99_s"] / median["prefix"]["ttft_p99_s"],
                "throughput_prefix_over_today": median["prefix"]["output_throughput"]
                / median["today"]["output_throughput"],
                "hit_rate": {n: m["hit_rate"] for n, m in median.items()},
            },
        }
    shared = by_workload["shared"]
    bound = {n: locality_bound([r["turns"] for r in rs], DEFAULT_BLOCK_TOKENS) for n, rs in shared["runs"].items()}
    shared["perfect_locality"] = bound
    shared["summary"]["ttft_p50_today_over_perfect_locality"] = (
        bound["today"]["ttft_p50_s"] / bound["today"]["ttft_p50_perfect_locality_s"]
    )
    result = {
        **provenance("bench.prefix_dispatch.run"),
        "question": "does pricing prefix-cache locality in dispatch lower multi-turn TTFT without costing throughput?",
        "systems": SYSTEMS,
        "dlora_config": config("prefix", adapters, work),
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "output_len": args.output_len,
            "think_time_s": args.think_time,
            "system_prompt_tokens": [500, 1000],
            "adapters": NUM_ADAPTERS,
            "popularity": "zipf alpha 1.0",
            "conversation_rate": rate,
            "shared": "per-adapter system prompt, history resent with the real replies",
            "unique": "the same adapters, lengths and arrivals, no shared prefix",
        },
        "load": args.load,
        "saturation": saturation,
        "reps": args.reps,
        "workloads": by_workload,
        "targets": "shared: TTFT p50 today / prefix >= 2 with p99 no worse; unique: throughput prefix / today >= 0.97",
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
