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
import statistics
import sys
from pathlib import Path

import yaml

from dlora import env
from dlora.bench.provenance import provenance
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import (
    EngineSettings,
    single_replica_config,
    vllm_server_command,
)
from dlora.bench.servers import (
    alternate_runs,
    make_random_adapters,
    start,
    stop,
    wait_healthy,
    write_result,
)
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "median_itl_ms")


def engine_settings(args) -> EngineSettings:
    return EngineSettings(
        max_model_len=args.max_model_len,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.num_prompts,
        kv_cache_space_gib=2,
        enforce_eager=not args.compile,
    )


def vllm_command(args, base: Path, adapters: list[Path], port: int) -> list[str]:
    return vllm_server_command(base, adapters, port, engine_settings(args))


def dlora_config(args, base: Path, adapters: list[Path], port: int, state: Path) -> dict:
    return single_replica_config(
        base,
        adapters,
        port,
        state,
        engine_settings(args),
        lora_backend=args.lora_backend,
        scheduling={"policy": args.policy},
    )


def mixed_adapter_workload(args):
    """The fixed-length, round-robin-over-adapters, all-at-once workload both LoRA comparisons send."""
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=tuple(f"a{i}" for i in range(args.num_adapters)),
        distribution="distinct",
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=float("inf"),
        max_model_len=args.max_model_len,
        seed=0,
    )
    return generate_workload(spec)


def workload_record(args) -> dict:
    """What `mixed_adapter_workload` sends, as a result records it."""
    return {
        "num_prompts": args.num_prompts,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf",
        "popularity": "distinct (round-robin)",
        "ignore_eos": True,
        "stream": True,
    }


def run_once(url: str, requests) -> dict:
    r = run_benchmark(
        url,
        requests,
        ignore_eos=True,
        disable_tqdm=True,
        print_result=False,
        percentile_metrics=("ttft", "tpot", "itl"),
        percentiles=(50.0, 90.0, 99.0),
    )
    return {k: r[k] for k in METRICS} | {"completed": r["completed"], "duration": r["duration"]}


def plot(results: dict, path: Path, title: str = "dlora vs vLLM server") -> None:
    """Medians as bars, every run as a dot, for each server of `results["median"]`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label in zip(
        axes,
        ("output_throughput", "median_ttft_ms", "median_tpot_ms"),
        ("output tok/s (higher is better)", "median TTFT ms", "median TPOT ms"),
    ):
        names = list(results["median"])
        ax.bar(names, [results["median"][n][key] for n in names], color=["#4477aa", "#cc6677"])
        for n_i, n in enumerate(names):
            ax.scatter([n_i] * len(results["runs"][n]), [r[key] for r in results["runs"][n]], color="k", s=8)
        ax.set_title(label, fontsize=9)
    fig.suptitle(
        f"{title}: {results['workload']['num_prompts']} streamed requests over "
        f"{results['workload']['num_adapters']} adapters (medians of {results['reps']} alternating runs)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="let both engines use torch.compile (no --enforce-eager)")
    ap.add_argument(
        "--lora-backend",
        default="vllm",
        choices=("vllm", "einsum"),
        help="dlora's engine.lora_backend (vllm: the same LoRA ops as vLLM's server, for parity)",
    )
    ap.add_argument("--policy", default="unmerged", help="dlora's scheduling.policy (unmerged: vLLM's behaviour)")
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
    try:
        for name, proc in procs.items():
            wait_healthy(f"http://127.0.0.1:{ports[name]}", proc, work / f"{name}.log")
        requests = mixed_adapter_workload(args)
        urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("dlora", "vllm")}
        runs = alternate_runs(urls, requests, args.reps, run_once, warmup=args.num_adapters * 2)
    finally:
        for proc in procs.values():
            stop(proc)

    median = {n: {k: statistics.median(r[k] for r in rs) for k in METRICS} for n, rs in runs.items()}
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
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
