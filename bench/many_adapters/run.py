"""Hundreds to a thousand adapters, most of them cold: dlora vs vLLM's server at 32, 256 and 1,024.

Adapters are random rank-8 q/k/v/o copies of one PEFT layout (generated once, cached). dlora runs
configs/default.yaml with `server.resolve_adapters` on and the adapters' directory as its root, so
nothing is registered by hand: each adapter is found by name on its first request. vLLM's server
runs the same model and engine sizes with `--enable-lora --max-loras 8 --max-cpu-loras N` and every
adapter in `--lora-modules`. Requests pick adapters by Zipf popularity (alpha 1.0) and arrive as a
Poisson stream. Each size starts both servers fresh (startup time is measured to the first healthy
/health), then sends the same workload to each in turn, `--reps` times, alternating the order.
Writes bench/many_adapters/result.json (+ .png).

    .venv/bin/python -m bench.many_adapters.run                      # 32, 256, 1024 adapters
    .venv/bin/python -m bench.many_adapters.run --sizes 32 --reps 1  # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from dlora import env
from dlora.bench.adapter_copies import copies_of
from dlora.bench.memory import rss_gib
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import shipped_engine_settings, shipped_server_config, vllm_server_command
from dlora.bench.servers import make_random_adapters, start, start_dlora, stop, wait_healthy
from dlora.bench.stats import percentile
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
PORTS = {"dlora": 8351, "vllm": 8352}
MAX_LORAS = 8


def adapters_for(base: Path, n: int) -> list[Path]:
    template = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", 1, 8)[0]
    return copies_of(template, env.cache_dir() / "bench-adapters" / "smollm2-many", n)


def workload(args, n: int):
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        adapters=tuple(f"a{i}" for i in range(n)),
        distribution="zipf",
        alpha=1.0,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.rate,
        max_model_len=2048,
        seed=n,
    )
    return generate_workload(spec)


def dlora_config(adapter_dir: Path, state: Path) -> dict:
    return found_by_name(shipped_server_config(PORTS["dlora"], str(state)), adapter_dir)


def found_by_name(cfg: dict, adapter_dir: Path) -> dict:
    """A shipped config that registers no adapter and finds each in `adapter_dir` on its first request."""
    cfg["server"] |= {"resolve_adapters": True, "adapter_roots": [str(adapter_dir)]}
    cfg["engine"] |= {"max_loras": MAX_LORAS}
    cfg["adapters"] = []
    return cfg


def workload_record(args) -> dict:
    """What `workload` sends, as a result records it."""
    return {
        "num_prompts": args.num_prompts,
        "popularity": "zipf alpha 1.0",
        "request_rate": args.rate,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "rank": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "max_loras": MAX_LORAS,
        "cold_tail": f"requests for adapters outside the {MAX_LORAS} most popular",
    }


def vllm_command(base: Path, adapters: list[Path]) -> list[str]:
    settings = dataclasses.replace(shipped_engine_settings(), max_loras=MAX_LORAS)
    cmd = vllm_server_command(base, adapters, PORTS["vllm"], settings)
    return cmd + ["--max-cpu-loras", str(max(len(adapters), MAX_LORAS))]


def cold_tail(adapter_of_request: list[str], ttfts: list[float]) -> list[float]:
    """TTFTs of requests whose adapter is outside the MAX_LORAS most popular (a0 is the hottest)."""
    return [
        t
        for a, t in zip(adapter_of_request, ttfts)
        if a and re.fullmatch(r"a\d+", a) and int(a[1:]) >= MAX_LORAS and t is not None
    ]


def measure(url: str, requests) -> dict:
    r = run_benchmark(
        url,
        requests,
        ignore_eos=True,
        disable_tqdm=True,
        print_result=False,
        percentiles=(50.0, 99.0),
        check_adapters=False,  # dlora finds them by name on first use; /v1/models lists registered ones
    )
    ttfts = [t * 1000 for t in r["ttfts"] if t]
    cold = [t * 1000 for t in cold_tail(r["adapters"], r["ttfts"])]
    return {
        "completed": r["completed"],
        "failed": len(requests) - r["completed"],
        "output_throughput": r["output_throughput"],
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "cold_ttft_p50_ms": percentile(cold, 50),
        "cold_ttft_p99_ms": percentile(cold, 99),
        "cold_requests": len(cold),
    }


def start_server(name: str, launch, url: str, work: Path) -> tuple:
    t0 = time.monotonic()
    proc = launch()
    wait_healthy(url, proc, work / f"{name}.log", timeout=1200)
    return proc, time.monotonic() - t0


def one_size(args, base: Path, n: int, work: Path) -> dict:
    paths = adapters_for(base, n)
    requests = workload(args, n)
    urls = {name: f"http://127.0.0.1:{port}" for name, port in PORTS.items()}
    launchers = {
        "dlora": lambda: start_dlora(dlora_config(paths[0].parent, work / f"state-{time.time_ns()}"), work, "dlora"),
        "vllm": lambda: start(vllm_command(base, paths), work / "vllm.log", {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    }
    names = [x for x in ("dlora", "vllm") if x not in args.skip]
    procs: dict = {}
    startup: dict[str, float | None] = {}
    runs: dict[str, list[dict]] = {x: [] for x in names}
    memory: dict = {}
    try:
        for name in names:
            print(f"[{n} adapters] starting {name}", flush=True)
            try:
                procs[name], startup[name] = start_server(name, launchers[name], urls[name], work)
            except (RuntimeError, TimeoutError) as e:
                print(f"[{n} adapters] {name} did not start: {e}", flush=True)
                startup[name] = None
                runs.pop(name)
        warm = generate_workload(WorkloadSpec(num_prompts=4, input_len=args.input_len, output_len=8, seed=1))
        for name in runs:  # oneDNN's first-shape builds, not adapter loads: base-model requests only
            measure(urls[name], warm)
        for rep in range(args.reps):
            for name in list(runs) if rep % 2 == 0 else list(runs)[::-1]:
                m = measure(urls[name], requests)
                runs[name].append(m)
                print(
                    f"[{n} adapters] rep {rep} {name:5s}: {m['output_throughput']:.1f} tok/s, TTFT p50/p99 "
                    f"{m['ttft_p50_ms']:.0f}/{m['ttft_p99_ms']:.0f} ms, cold p99 {m['cold_ttft_p99_ms'] or 0:.0f} ms, "
                    f"{m['failed']} failed",
                    flush=True,
                )
        memory = {name: rss_gib(procs[name].pid) for name in runs}
    finally:
        for proc in procs.values():
            stop(proc)
    med = {
        name: {k: statistics.median(r[k] for r in rs if r[k] is not None) for k in rs[0] if rs}
        for name, rs in runs.items()
        if rs
    }
    return {"adapters": n, "startup_s": startup, "memory_gib": memory, "runs": runs, "median": med}


def summary_of(sizes: list[dict]) -> dict:
    out: dict = {}
    for s in sizes:
        d, v = s["median"].get("dlora"), s["median"].get("vllm")
        key = str(s["adapters"])
        out[key] = {"dlora_throughput": d and d["output_throughput"], "vllm_started": v is not None}
        if d and v:
            out[key] |= {
                "throughput_ratio": d["output_throughput"] / v["output_throughput"],
                "ttft_p99_ratio_vllm_over_dlora": v["ttft_p99_ms"] / d["ttft_p99_ms"],
                "cold_ttft_p99_ratio_vllm_over_dlora": (v["cold_ttft_p99_ms"] or 0) / (d["cold_ttft_p99_ms"] or 1),
            }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for name, color in (("dlora", "#4477aa"), ("vllm", "#cc6677")):
        pts = [(s["adapters"], s["median"][name]) for s in result["sizes"] if name in s["median"]]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        axes[0].plot(xs, [p[1]["output_throughput"] for p in pts], "o-", color=color, label=name)
        axes[1].plot(xs, [p[1]["ttft_p99_ms"] for p in pts], "o-", color=color, label=f"{name} all")
        axes[1].plot(xs, [p[1]["cold_ttft_p99_ms"] for p in pts], "x--", color=color, label=f"{name} cold tail")
        axes[2].plot(xs, [p[1]["ttft_p50_ms"] for p in pts], "o-", color=color, label=name)
    for ax, title in zip(axes, ("output tok/s", "TTFT p99 ms", "TTFT p50 ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("adapters")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Many adapters, Zipf 1.0 popularity, max_loras 8 (medians of alternating runs)", fontsize=9)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 256, 1024])
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], choices=("dlora", "vllm"))
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()

    base = prepare_smollm2()
    work = Path(env.cache_dir()) / "bench-many-adapters"
    work.mkdir(parents=True, exist_ok=True)
    sizes = [one_size(args, base, n, work) for n in args.sizes]
    result = {
        **provenance("bench.many_adapters.run"),
        "vllm_command": shlex.join(vllm_command(base, [Path("<adapter i>")])) + " ... (every adapter)",
        "dlora_config": dlora_config(Path("<adapters>"), Path("<state>")),
        "workload": workload_record(args),
        "reps": args.reps,
        "sizes": sizes,
        "summary": summary_of(sizes),
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
