"""The two-replica cluster benchmark's settings and servers, shared by the benchmarks that run its
workloads (bench/cluster_balancing, bench/slo) or model them (bench/migration_bound, bench/slo_sim):
its flags, the cluster policies, each server's config, the workload at one rate, and the capacity
calibration that turns load fractions into request rates."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from dlora.bench.palette import cluster_policy_colors
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import adapter_entries
from dlora.bench.servers import dlora_server
from dlora.bench.shipped import shipped_config
from dlora.bench.workload import Request, WorkloadSpec, generate_workload

POLICIES: dict[str, dict] = {
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
CHAT_TEMPLATE = 30  # tokens SmolLM2's chat template adds to a ShareGPT prompt (system turn + markers)


def settings_parser(description: str) -> argparse.ArgumentParser:
    """Every flag of the cluster benchmark but where its result goes."""
    ap = argparse.ArgumentParser(description=description)
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
    return ap


def check_settings(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse contradictory flags by name."""
    unknown = [p for p in args.policies.split(",") if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.adapters < 1:
        ap.error(f"--adapters must be >= 1, got {args.adapters}")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        ap.error(f"--max-cpu-loras must be >= --max-loras ({args.max_loras}), got {args.max_cpu_loras}")


def fill_defaults(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on other flags (calibration on unless rates are given, its size)."""
    if args.capacity_calibration is None:
        args.capacity_calibration = args.request_rates is None
    if args.request_rates is None and not args.capacity_calibration:
        ap.error("--no-capacity-calibration needs --request-rates")
    args.calibration_prompts = args.calibration_prompts or 8 * args.max_num_seqs
    return args


def parse_settings(argv: list[str]) -> argparse.Namespace:
    """The cluster benchmark's settings for these flags, as its own run would take them."""
    ap = settings_parser("the cluster benchmark's settings")
    args = ap.parse_args(argv)
    check_settings(ap, args)
    return fill_defaults(ap, args)


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


def sharegpt_chat_workload(
    adapters: int, n: int, seed: int, tokenizer, *, alpha: float, cv: float, **spec
) -> list[Request]:
    """`n` ShareGPT chat requests over Zipf(`alpha`) adapters `a0`, `a1`, ... with the cluster
    benchmark's prompt budget (room left for the chat template), outputs the dataset's replies;
    `spec` sets other `WorkloadSpec` fields (default: 1 request/s)."""
    ws = WorkloadSpec(
        num_prompts=n,
        adapters=tuple(f"a{i}" for i in range(adapters)),
        distribution="zipf",
        alpha=alpha,
        cv=cv,
        dataset="sharegpt",
        max_model_len=MAX_MODEL_LEN - CHAT_TEMPLATE_TOKENS,
        seed=seed,
        **{"request_rate": 1.0, **spec},
    )
    return generate_workload(ws, tokenizer=tokenizer, with_prompts=False)


class Server:
    """One dlora server of the bench, started on enter and stopped on exit."""

    def __init__(self, args, base: Path, adapters: list[Path], work: Path, name: str, policy: str, port: int):
        self.name, self.url, self.work = name, f"http://127.0.0.1:{port}", work
        self.cfg = server_config(args, base, adapters, port, work / f"state-{name}", POLICIES[policy])
        self.sent = 0  # requests sent so far, all observed in its queue-time histogram once settled

    def __enter__(self) -> Server:
        self._serving = ExitStack()
        self._serving.enter_context(dlora_server(self.cfg, self.work, self.name))
        return self

    def __exit__(self, *exc) -> None:
        self._serving.close()

    def run(self, requests: list, run_kw: dict, **kw) -> dict:
        r = run_benchmark(self.url, requests, **run_kw, print_result=False, **kw)
        self.sent += len(requests)
        return r


def calibrate_capacity(args, server_args: tuple[Any, Path, list[Path], Path], calibration: list, run_kw: dict) -> dict:
    """The sustained request rate of the calibration policy's server on `calibration` sent at once
    (`steady_rate`); `server_args` are `Server`'s settings, base model, adapters and work dir."""
    settings, base, adapters, work = server_args
    with Server(settings, base, adapters, work, "calibration", CALIBRATION_POLICY, 8320) as server:
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


def policy_colors() -> dict[str, str]:
    """One colour per policy (the baselines and dlora fixed across results, the variants after)."""
    return cluster_policy_colors(POLICIES)
