"""dlora's `einsum` LoRA backend vs vLLM's default CPU LoRA path, in the real server.

Two dlora servers with identical configs except `engine.lora_backend` (`vllm` and `einsum`) run at
once, both pinned to core 0, which only one of them uses at a time; the same streamed
mixed-adapter workload as bench/vs_vllm_server is sent to them alternately, `--reps` times
each, and the medians are compared. Writes bench/lora_backend_cpu/result.json (+ .png).

    .venv/bin/python -m bench.lora_backend_cpu.run      # default: 64 requests x 4 adapters, 5 reps
"""

from __future__ import annotations

import argparse
import functools
import platform
import sys
from pathlib import Path

from dlora import env
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import machine as provenance_machine
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import (
    METRICS,
    alternate_runs,
    dlora_config,
    mixed_adapter_workload,
    run_once,
    workload_record,
)
from dlora.bench.servers import make_random_adapters, serving, start_dlora
from dlora.bench.stats import medians
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
BACKENDS = ("vllm", "einsum")
# the workload of bench/vs_vllm_server, with more repetitions (the machine is shared and noisy)
DEFAULTS = {
    "num_prompts": 64,
    "num_adapters": 4,
    "rank": 8,
    "input_len": 64,
    "output_len": 64,
    "max_model_len": 2048,
    "reps": 5,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, default in DEFAULTS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=int, default=default)
    ap.add_argument(
        "--policy",
        default="unmerged",
        help="scheduling.policy of both servers (unmerged: every step runs every adapter's LoRA)",
    )
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    args.compile = False  # dlora's backends need enforce_eager

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", args.num_adapters, args.rank)
    work = Path(env.cache_dir()) / "bench-run-lora-backend"
    work.mkdir(parents=True, exist_ok=True)
    ports = {"vllm": 8321, "einsum": 8322}
    configs = {}
    for name in BACKENDS:
        args.lora_backend = name  # the one difference between the two servers' configs
        configs[name] = dlora_config(args, base, adapters, ports[name], work / f"state-{name}")
    procs = {name: start_dlora(configs[name], work, name) for name in BACKENDS}
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in BACKENDS}
    with serving(procs, urls, work):
        requests = mixed_adapter_workload(args)
        runs = alternate_runs(urls, requests, args.reps, run_once, warmup=args.num_adapters * 2)
    in_use = {
        name: f"Using PunicaWrapper{'Einsum' if name == 'einsum' else 'CPU'}."
        in (work / f"{name}.log").read_text(errors="replace")
        for name in BACKENDS
    }

    median = medians(runs, METRICS)
    per_rep = [e["output_throughput"] / v["output_throughput"] for e, v in zip(runs["einsum"], runs["vllm"])]
    result = {
        **provenance("bench.lora_backend_cpu.run"),
        "dlora_config": configs["einsum"],
        "machine": {
            **provenance_machine(),
            "platform": platform.platform(),
            "note": "shared 2-core machine with other CPU-heavy work running; both engines on core 0, "
            "runs alternate so both see the same background load on average",
        },
        "workload": workload_record(args),
        "wrapper_in_use_per_log": in_use,
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": {
            "throughput_ratio_einsum_over_vllm": median["einsum"]["output_throughput"]
            / median["vllm"]["output_throughput"],
            "per_rep_throughput_ratio": per_rep,
            "tpot_ratio_vllm_over_einsum": median["vllm"]["median_tpot_ms"] / median["einsum"]["median_tpot_ms"],
            "ttft_ratio_vllm_over_einsum": median["vllm"]["median_ttft_ms"] / median["einsum"]["median_ttft_ms"],
        },
    }
    write_result(
        result, args.out, functools.partial(plot_server_comparison, title="dlora LoRA backend, einsum vs vllm")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
