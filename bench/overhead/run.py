"""dlora's serving path vs vLLM's own server on base-model traffic (no adapter in any request).

dlora runs configs/default.yaml as shipped (two single-core replicas behind the router, the Ray hop
and the API process); vLLM's OpenAI server runs the same model, dtype and engine sizes as a user
would start it (one engine, its default CPU threads, LoRA off). Both stay up; the same streamed
workload goes to each in turn, `--reps` times, alternating the order. Writes
bench/overhead/result.json (+ .png).

    .venv/bin/python -m bench.overhead.run              # 64 streams x 64 tokens, 3 reps
    .venv/bin/python -m bench.overhead.run --dtype bfloat16 --out bench/overhead/runs/DATE-bf16.json
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import yaml

from dlora import env
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import METRICS, alternate_runs, run_once
from dlora.bench.server_configs import shipped_engine_settings, shipped_server_config, vllm_server_command
from dlora.bench.servers import serving, start, start_dlora
from dlora.bench.stats import medians
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
PORTS = {"dlora": 8321, "vllm": 8322, "dlora-1x2": 8323}
# --layouts: the same dlora config as one replica on two cores (two engine threads) instead of two
# single-core replicas, measured beside the other two
ONE_TWO_CORE_REPLICA = {"num_replicas": 1, "cores_per_replica": 2, "cpu_cores": [0, 1]}


def base_model_workload(args):
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=(),
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=float("inf"),
        max_model_len=2048,
        seed=0,
    )
    return generate_workload(spec)


def workload_record(args) -> dict:
    """What `base_model_workload` sends, as a result records it."""
    return {
        "num_prompts": args.num_prompts,
        "num_adapters": 0,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf",
        "ignore_eos": True,
        "stream": True,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "result.json"))
    ap.add_argument("--dlora-config", help="a dlora config to measure instead of configs/default.yaml")
    ap.add_argument("--dtype", help="serve both in this dtype instead of the shipped one (e.g. bfloat16)")
    ap.add_argument(
        "--layouts",
        action="store_true",
        help="also serve the dlora config as one two-core replica (cluster.cores_per_replica: 2) and compare",
    )
    args = ap.parse_args()

    base = prepare_smollm2()
    work = Path(env.cache_dir()) / "bench-overhead"
    work.mkdir(parents=True, exist_ok=True)
    settings = shipped_engine_settings()
    if args.dtype:
        settings = dataclasses.replace(settings, dtype=args.dtype)
    if args.dlora_config:
        dlora_cfg = yaml.safe_load(Path(args.dlora_config).read_text())
        dlora_cfg["server"] = {**dlora_cfg.get("server", {}), "port": PORTS["dlora"], "state_dir": str(work / "state")}
    else:
        dlora_cfg = shipped_server_config(PORTS["dlora"], str(work / "state"))
    dlora_cfg["model"] = {**dlora_cfg.get("model", {}), "dtype": settings.dtype}
    vllm_cmd = vllm_server_command(base, [], PORTS["vllm"], settings)
    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": str(int(settings.kv_cache_space_gib))}
    procs = {
        "dlora": start_dlora(dlora_cfg, work, "dlora"),
        "vllm": start(vllm_cmd, work / "vllm.log", vllm_env),
    }
    one_replica_cfg = None
    if args.layouts:
        one_replica_cfg = {
            **dlora_cfg,
            "cluster": {**dlora_cfg.get("cluster", {}), **ONE_TWO_CORE_REPLICA},
            "server": {**dlora_cfg["server"], "port": PORTS["dlora-1x2"], "state_dir": str(work / "state-1x2")},
        }
        procs["dlora-1x2"] = start_dlora(one_replica_cfg, work, "dlora-1x2")
    urls = {name: f"http://127.0.0.1:{PORTS[name]}" for name in procs}
    with serving(procs, urls, work):
        requests = base_model_workload(args)
        runs = alternate_runs(urls, requests, args.reps, run_once, warmup=4)

    median = medians(runs, METRICS)
    d, v = median["dlora"], median["vllm"]
    result = {
        **provenance("bench.overhead.run"),
        "vllm_command": shlex.join(vllm_cmd),
        "vllm_env": vllm_env,
        "dlora_config": dlora_cfg,
        "workload": workload_record(args),
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": {
            "throughput_ratio": d["output_throughput"] / v["output_throughput"],
            "ttft_ratio_vllm_over_dlora": v["median_ttft_ms"] / d["median_ttft_ms"],
            "tpot_ratio_vllm_over_dlora": v["median_tpot_ms"] / d["median_tpot_ms"],
            "target_throughput_ratio": 0.95,
        },
    }
    if one_replica_cfg is not None:
        one = median["dlora-1x2"]
        result["dlora_one_replica_config"] = one_replica_cfg
        result["summary"]["two_single_core_over_one_two_core"] = d["output_throughput"] / one["output_throughput"]
        result["summary"]["one_two_core_vs_vllm"] = one["output_throughput"] / v["output_throughput"]
    write_result(
        result, args.out, lambda r, p: plot_server_comparison(r, p, title="dlora vs vLLM server, base model only")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
