"""dlora vs vLLM's own OpenAI server on the same model, adapters, engine settings and workload.

Both servers run at once (one engine each, both pinned to core 0, which only one of them uses at
a time); the same streamed mixed-adapter workload is sent to them alternately, `--reps` times each,
and the medians are compared. Writes bench/vs_vllm_server/result.json (+ .png).

    .venv/bin/python -m bench.vs_vllm_server.run        # default: 64 requests x 4 adapters, 3 reps
    .venv/bin/python -m bench.vs_vllm_server.run --lora-backend einsum --policy dlora \
        --out bench/vs_vllm_server/runs/DATE-default-config.json   # dlora as configs/default.yaml runs it
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

from dlora import env
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import (
    METRICS,
    alternate_runs,
    dlora_config,
    engine_settings,
    mixed_adapter_workload,
    run_once,
    workload_args,
    workload_record,
)
from dlora.bench.server_configs import vllm_server_command
from dlora.bench.servers import make_random_adapters, serving, start
from dlora.bench.stats import medians
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent


def vllm_command(args, base: Path, adapters: list[Path], port: int) -> list[str]:
    return vllm_server_command(base, adapters, port, engine_settings(args))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap, reps=3, lora_backend="vllm", policy="unmerged", for_both=True)
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", args.num_adapters, args.rank)
    work = Path(env.cache_dir()) / "bench-run"
    work.mkdir(parents=True, exist_ok=True)
    ports = {"vllm": 8311, "dlora": 8312}
    cfg_path = work / "dlora.yaml"
    cfg_path.write_text(yaml.safe_dump(dlora_config(args, base, adapters, ports["dlora"], work / "state")))

    vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    procs = {
        "vllm": start(vllm_command(args, base, adapters, ports["vllm"]), work / "vllm.log", vllm_env),
        "dlora": start([sys.executable, "-m", "dlora.cli", "serve", "--config", str(cfg_path)], work / "dlora.log", {}),
    }
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("dlora", "vllm")}
    with serving(procs, urls, work):
        requests = mixed_adapter_workload(args)
        runs = alternate_runs(urls, requests, args.reps, run_once, warmup=args.num_adapters * 2)

    median = medians(runs, METRICS)
    result = {
        **provenance("bench.vs_vllm_server.run"),
        "vllm_command": shlex.join(vllm_command(args, base, adapters, ports["vllm"])),
        "dlora_config": dlora_config(args, base, adapters, ports["dlora"], work / "state"),
        "workload": workload_record(args),
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": {
            "throughput_ratio": median["dlora"]["output_throughput"] / median["vllm"]["output_throughput"],
            "ttft_ratio_vllm_over_dlora": median["vllm"]["median_ttft_ms"] / median["dlora"]["median_ttft_ms"],
            "tpot_ratio_vllm_over_dlora": median["vllm"]["median_tpot_ms"] / median["dlora"]["median_tpot_ms"],
        },
    }
    write_result(result, args.out, plot_server_comparison)
    return 0


if __name__ == "__main__":
    sys.exit(main())
