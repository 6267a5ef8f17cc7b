"""Two or more servers compared on one streamed workload (bench/vs_vllm_server, bench/overhead,
bench/lora_backend_cpu): the mixed-adapter workload and its options, a dlora config with the engine
sizes vLLM's server gets, one timed run, and the runs alternated between the servers."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import EngineSettings, single_replica_config
from dlora.bench.workload import Request, WorkloadSpec, generate_workload

METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "median_itl_ms")


def workload_args(
    ap: argparse.ArgumentParser,
    reps: int,
    lora_backend: str = "einsum",
    policy: str = "dlora",
    for_both: bool = False,
) -> None:
    """The mixed-adapter workload's and the engines' options, defaulting to dlora as
    configs/default.yaml runs it; `for_both`: the engine options apply to vLLM's server too."""
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=reps)
    engines = "both engines" if for_both else "the engines"
    ap.add_argument("--compile", action="store_true", help=f"let {engines} use torch.compile (no --enforce-eager)")
    backend_help = "dlora's engine.lora_backend (vllm: the same LoRA ops as vLLM's server, for parity)"
    ap.add_argument("--lora-backend", default=lora_backend, choices=("vllm", "einsum"), help=backend_help)
    ap.add_argument("--policy", default=policy, help="dlora's scheduling.policy (unmerged: vLLM's behaviour)")


def engine_settings(args) -> EngineSettings:
    return EngineSettings(
        max_model_len=args.max_model_len,
        max_loras=args.num_adapters,
        max_lora_rank=args.rank,
        max_num_seqs=args.num_prompts,
        kv_cache_space_gib=2,
        enforce_eager=not args.compile,
    )


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


def mixed_adapter_workload(args, seed: int = 0) -> list[Request]:
    """The fixed-length, round-robin-over-adapters, all-at-once workload the LoRA comparisons send
    (`seed` draws its prompts)."""
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=tuple(f"a{i}" for i in range(args.num_adapters)),
        distribution="distinct",
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=float("inf"),
        max_model_len=args.max_model_len,
        seed=seed,
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


def run_once(url: str, requests: Sequence[Request]) -> dict:
    """One streamed run, EOS ignored; the `METRICS` a comparison keeps of it."""
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


def rotated(names: Sequence[str], rep: int) -> list[str]:
    """The order of rep `rep`: every server first, middle and last equally often over reps (two
    servers: alternating)."""
    k = rep % len(names)
    return [*names[k:], *names[:k]]


def alternate_runs(
    urls: Mapping[str, str],
    requests: Sequence[Request] | Mapping[str, Sequence[Request]],
    reps: int,
    run_once: Callable[[str, Sequence[Request]], dict],
    warmup: int,
    label: str = "",
) -> dict[str, list[dict]]:
    """Warm every server with its first `warmup` requests (none: 0), then run the workload on each
    `reps` times, rotating the order (two servers: alternating) so every server sees the same
    background load on average. `requests` may name each server's own (the same prompts on the
    base model for a server without LoRA)."""
    names = list(urls)
    sent = requests if isinstance(requests, Mapping) else dict.fromkeys(names, requests)
    if warmup:
        for name in names:  # first-shape oneDNN primitive builds, adapter loads
            run_once(urls[name], sent[name][:warmup])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(reps):
        for name in rotated(names, rep):
            m = run_once(urls[name], sent[name])
            m["loadavg_1m"] = os.getloadavg()[0]
            runs[name].append(m)
            print(
                f"{label}rep {rep} {name:6s}: {m['output_throughput']:.1f} tok/s, TTFT p50 {m['median_ttft_ms']:.0f} "
                f"ms, TPOT p50 {m['median_tpot_ms']:.1f} ms (load {m['loadavg_1m']:.1f})",
                flush=True,
            )
    return runs
