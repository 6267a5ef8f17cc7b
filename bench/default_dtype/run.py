"""What does serving the demo model in float32 instead of bfloat16 cost?

configs/default.yaml serves SmolLM2-135M-Instruct in float32 because bf16 cannot settle the near-tie
at the first answer token of the README's demo prompt (README, "Models and demo adapters"). This
measures the price: the shipped config as it is (two replicas, einsum LoRA kernels) with `--dtype
float32` and with `--dtype bfloat16`, one server at a time, alternating which goes first each round.
Each rep sends 64 streams x 64 output tokens at once (`ignore_eos`), once to the base model only and
once spread over the base model and the three demo adapters. Reported: output tokens/s per rep,
medians per dtype and workload, and the ratio bf16 / fp32.

Run from the repository root:  .venv/bin/python -m bench.default_dtype.run
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.runner import run_benchmark
from dlora.bench.server_configs import shipped_server_config
from dlora.bench.servers import dlora_server
from dlora.bench.workload import WorkloadSpec, generate_workload

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16")
WORKLOADS = {"base": ("",), "mixed": ("", "upper", "json", "pirate")}  # "" = the base model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="server starts per dtype (alternating order)")
    p.add_argument("--reps", type=int, default=2, help="reps per workload per server start")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--out", default=str(HERE / "result.json"))
    return p.parse_args(argv)


def one_rep(url: str, requests) -> float:
    r = run_benchmark(url, requests, ignore_eos=True, disable_tqdm=True, print_result=False)
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} request(s) failed: {r['errors'][:3]}")
    return r["output_throughput"]


def plot(result: dict, png: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, workload in enumerate(WORKLOADS):
        for j, dtype in enumerate(DTYPES):
            vals = result["runs"][dtype][workload]
            x = i * 3 + j
            ax.bar(x, statistics.median(vals), color=("tab:blue", "tab:orange")[j], label=dtype if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="black", s=10, zorder=3)
    ax.set_xticks([0.5, 3.5], list(WORKLOADS))
    ax.set_ylabel("output tokens/s")
    s = result["summary"]
    ax.set_title(
        f"default config: bf16 / fp32 = {s['bf16_vs_fp32_base']:.2f} (base), {s['bf16_vs_fp32_mixed']:.2f} (mixed)",
        fontsize=10,
    )
    ax.legend()
    save_figure(fig, png)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    workloads = {
        name: generate_workload(
            WorkloadSpec(
                num_prompts=args.streams,
                adapters=adapters,
                distribution="distinct",
                input_len=args.input_len,
                output_len=args.output_len,
                seed=0,
            )
        )
        for name, adapters in WORKLOADS.items()
    }
    runs: dict[str, dict[str, list[float]]] = {d: {w: [] for w in WORKLOADS} for d in DTYPES}
    for rnd in range(args.rounds):
        for dtype in DTYPES if rnd % 2 == 0 else DTYPES[::-1]:
            with tempfile.TemporaryDirectory(prefix="dlora-dtype-") as tmp:
                cfg = shipped_server_config(args.port, f"{tmp}/state")
                cfg["model"]["dtype"] = dtype
                with dlora_server(cfg, Path(tmp), "server"):
                    one_rep(url, workloads["mixed"][:8])  # warm-up: adapter loads, first-shape kernels
                    for _ in range(args.reps):
                        for name, reqs in workloads.items():
                            runs[dtype][name].append(one_rep(url, reqs))
            print(
                f"round {rnd} {dtype}: " + ", ".join(f"{w} {v[-args.reps :]}" for w, v in runs[dtype].items()),
                flush=True,
            )
    med = {d: {w: statistics.median(v) for w, v in r.items()} for d, r in runs.items()}
    result = {
        "question": "what does serving the demo model in float32 instead of bfloat16 cost?",
        **provenance("bench.default_dtype.run", argv),
        "config": "configs/default.yaml (port, state_dir and model.dtype changed)",
        "workload": {
            "streams": args.streams,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
            "workloads": {k: [a or "<base>" for a in v] for k, v in WORKLOADS.items()},
        },
        "runs": runs,
        "median_output_tok_s": med,
        "summary": {f"bf16_vs_fp32_{w}": med["bfloat16"][w] / med["float32"][w] for w in WORKLOADS},
    }
    write_result(result, args.out, plot)


if __name__ == "__main__":
    main()
