"""dlora as configs/default.yaml runs it vs vLLM's own OpenAI server with LoRA and without LoRA.

Each server runs as a user would start it on this machine: dlora with configs/default.yaml (two
single-core replicas, its dtype and engine sizes) serving 4 random rank-8 q/k/v/o adapters; vLLM's
server on the same model, dtype and engine sizes, one engine over the machine's cores, once with
`--enable-lora` and the same adapters, and once with LoRA off, which gets every request on the base
model: the speed any LoRA server on this engine could reach. All three stay up; each workload
(`uniform`: the requests round-robin over the adapters; `skewed`: about 90% to one adapter) goes to
each in turn, `--reps` times, rotating the order. Writes bench/vs_vllm_server/headline.json (+ .png).

    .venv/bin/python -m bench.vs_vllm_server.headline            # 64 streams x 64 tokens, 3 reps
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from dlora import env
from dlora.bench.plot import plot_grouped_servers
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import METRICS, alternate_runs, run_once
from dlora.bench.server_configs import (
    adapter_entries,
    shipped_engine_settings,
    shipped_server_config,
    vllm_server_command,
)
from dlora.bench.servers import make_random_adapters, serving, start, start_dlora
from dlora.bench.stats import medians
from dlora.bench.workload import Request, WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
PORTS = {"dlora": 8331, "vllm-lora": 8332, "vllm-base": 8333}
NUM_ADAPTERS, RANK = 4, 8
# `skewed`: adapter a gets alpha times the requests of adapter a + 1, so with 4 adapters and alpha 10
# the first gets 1 / (1 + 0.1 + 0.01 + 0.001) = 90% of them
POPULARITY = {"uniform": ("distinct", None), "skewed": ("skewed", 10.0)}


def workload(name: str, args) -> list[Request]:
    distribution, alpha = POPULARITY[name]
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=tuple(f"a{i}" for i in range(NUM_ADAPTERS)),
        distribution=distribution,
        alpha=alpha,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=float("inf"),
        max_model_len=2048,
        seed=0,
    )
    return generate_workload(spec)


def on_base_model(requests: Sequence[Request]) -> list[Request]:
    """The same requests on the base model: what vLLM's server without LoRA serves."""
    return [dataclasses.replace(r, adapter=None) for r in requests]


def summarize(median: dict[str, dict]) -> dict:
    tp = {n: m["output_throughput"] for n, m in median.items()}
    return {
        "dlora_over_vllm_lora": tp["dlora"] / tp["vllm-lora"],
        "dlora_over_vllm_base": tp["dlora"] / tp["vllm-base"],
        "vllm_lora_over_vllm_base": tp["vllm-lora"] / tp["vllm-base"],
        "ttft_p50_vllm_lora_over_dlora": median["vllm-lora"]["median_ttft_ms"] / median["dlora"]["median_ttft_ms"],
        "tpot_p50_vllm_lora_over_dlora": median["vllm-lora"]["median_tpot_ms"] / median["dlora"]["median_tpot_ms"],
    }


def plot(result: dict, path: Path) -> None:
    plot_grouped_servers(
        result["workloads"],
        path,
        list(PORTS),
        (
            ("output_throughput", "output tok/s (higher is better)"),
            ("median_ttft_ms", "median TTFT ms"),
            ("median_tpot_ms", "median TPOT ms"),
        ),
        f"dlora (configs/default.yaml) vs vLLM's server with and without LoRA: {result['workload']['num_prompts']} "
        f"streams x {result['workload']['output_len']} tokens, 4 rank-8 adapters (medians of {result['reps']} runs)",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=list(POPULARITY), choices=list(POPULARITY))
    ap.add_argument("--out", default=str(HERE / "headline.json"))
    args = ap.parse_args()

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", NUM_ADAPTERS, RANK)
    work = Path(env.cache_dir()) / "bench-headline"
    work.mkdir(parents=True, exist_ok=True)
    settings = shipped_engine_settings()
    dlora_cfg = shipped_server_config(PORTS["dlora"], str(work / "state"))
    dlora_cfg["adapters"] = adapter_entries(adapters)
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": str(int(settings.kv_cache_space_gib))}
    vllm_cmds = {
        "vllm-lora": vllm_server_command(base, adapters, PORTS["vllm-lora"], settings),
        "vllm-base": vllm_server_command(base, [], PORTS["vllm-base"], settings),
    }
    procs = {"dlora": start_dlora(dlora_cfg, work, "dlora")}
    procs |= {n: start(cmd, work / f"{n}.log", vllm_env) for n, cmd in vllm_cmds.items()}
    urls = {name: f"http://127.0.0.1:{PORTS[name]}" for name in PORTS}
    results: dict[str, dict] = {}
    with serving(procs, urls, work):
        for w_i, wname in enumerate(args.workloads):
            requests = workload(wname, args)
            sent = {n: on_base_model(requests) if n == "vllm-base" else requests for n in urls}
            warmup = NUM_ADAPTERS * 2 if w_i == 0 else 0  # once: oneDNN's first-shape builds, adapter loads
            runs = alternate_runs(urls, sent, args.reps, run_once, warmup, label=f"[{wname}] ")
            median = medians(runs, METRICS)
            share = max(sum(r.adapter == a for r in requests) for a in {r.adapter for r in requests}) / len(requests)
            results[wname] = {"top_adapter_share": share, "runs": runs, "median": median, "summary": summarize(median)}

    result = {
        **provenance("bench.vs_vllm_server.headline"),
        "question": "dlora as configs/default.yaml runs it vs vLLM's server with LoRA, and without LoRA as the limit",
        "vllm_commands": {n: shlex.join(cmd) for n, cmd in vllm_cmds.items()},
        "vllm_env": vllm_env,
        "dlora_config": dlora_cfg,
        "workload": {
            "num_prompts": args.num_prompts,
            "num_adapters": NUM_ADAPTERS,
            "rank": RANK,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": "inf",
            "ignore_eos": True,
            "stream": True,
            "popularity": {
                w: POPULARITY[w][0] + (f" alpha {POPULARITY[w][1]:g}" if POPULARITY[w][1] else "")
                for w in args.workloads
            },
            "vllm_base_requests": "the same prompts on the base model",
        },
        "reps": args.reps,
        "workloads": results,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
