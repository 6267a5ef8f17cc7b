"""The batching policies on the skew benchmark's workloads in the replica simulator (dlora/sim).

The real benchmark (bench/dynamic_batching_skew) measures 56-request runs per point on a machine
whose speed drifts 10-20% within minutes, about the size of the differences its targets ask about.
Here the same workloads (8 adapters, 1 req/s Poisson, 64 in / 64 out, top-adapter share 0.12 to
0.9) go through `BatchingSim`, where the real policy objects (`dlora.scheduling`, with the
parameters of configs/default.yaml's `scheduling:`) decide every step and step times come from
cost models fitted to measured steps. Each point is run over `--seeds` workload seeds, each with
seeded per-step noise (`--noise`, log-normal sd), and three cost regimes are compared:
`cpu-einsum` (the default config: unmerged LoRA ~12% above a base step), `cpu-vllm-ops` (vLLM's
own CPU LoRA ops: unmerged ~3x), `gpu-like` (merged at 0.6 of an unmerged step, a 20 ms switch). Reported per point: the
median latency per output token of each policy, and dlora against the better and the worse of
`unmerged`/`merged`, as the median and the minimum over seeds of each seed's own ratio.
Writes bench/batching_sim/result.json (+ .png). About 30 s.

    .venv/bin/python -m bench.batching_sim.run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from dlora.bench.cost_presets import BACKEND_OF
from dlora.bench.palette import BATCHING_POLICY_COLORS
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.shipped import shipped_batching_parameters
from dlora.scheduling import BatchingConfig
from dlora.sim.skew import SkewWorkload, simulate
from dlora.sim.step_costs import PRESETS

HERE = Path(__file__).resolve().parent

POLICIES = ("unmerged", "merged", "dlora")


def run_point(preset: str, alpha: float, args) -> dict:
    costs = PRESETS[preset]
    configs = {
        p: BatchingConfig(**(shipped_batching_parameters() if p == "dlora" else {})).for_lora_backend(
            BACKEND_OF[preset]
        )
        for p in POLICIES
    }
    lat: dict[str, list[float]] = {p: [] for p in POLICIES}
    switches: dict[str, list[int]] = {p: [] for p in POLICIES}
    for seed in range(args.seeds):
        requests = SkewWorkload(alpha=alpha, rate=args.rate, seed=seed).requests()
        for p in POLICIES:
            r = simulate(p, configs[p], costs, requests, noise_sd=args.noise, seed=seed)
            lat[p].append(1000 * r.avg_latency_per_output_token)
            switches[p].append(r.switches)
    better = [min(u, m) / d for u, m, d in zip(lat["unmerged"], lat["merged"], lat["dlora"])]
    worse = [max(u, m) / d for u, m, d in zip(lat["unmerged"], lat["merged"], lat["dlora"])]
    return {
        "preset": preset,
        "skew": alpha,
        "top_share": SkewWorkload(alpha=alpha).top_share,
        "latency_per_output_token_ms": {p: statistics.median(v) for p, v in lat.items()},
        "switches": {p: statistics.median(v) for p, v in switches.items()},
        "dlora_vs_better_baseline": {"median": statistics.median(better), "min": min(better)},
        "dlora_vs_worse_baseline": {"median": statistics.median(worse), "min": min(worse)},
        "per_seed_ms": lat,
    }


def summarize(points: list[dict], alphas: list[float]) -> dict:
    out = {}
    for preset in PRESETS:
        pts = [p for p in points if p["preset"] == preset]
        ends = [p for p in pts if p["skew"] in (alphas[0], alphas[-1])]
        out[preset] = {
            "dlora_vs_better_baseline_min_of_medians": min(p["dlora_vs_better_baseline"]["median"] for p in pts),
            "dlora_vs_better_baseline_min_over_seeds": min(p["dlora_vs_better_baseline"]["min"] for p in pts),
            "dlora_vs_worse_baseline_at_extremes_min_of_medians": min(
                p["dlora_vs_worse_baseline"]["median"] for p in ends
            ),
        }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    presets = list(PRESETS)
    fig, axes = plt.subplots(1, len(presets), figsize=(4.3 * len(presets), 3.5))
    for ax, preset in zip(axes, presets):
        pts = sorted((p for p in result["points"] if p["preset"] == preset), key=lambda p: p["top_share"])
        for policy in POLICIES:
            ax.plot(
                [p["top_share"] for p in pts],
                [p["latency_per_output_token_ms"][policy] for p in pts],
                "o-",
                color=BATCHING_POLICY_COLORS[policy],
                label=policy,
            )
        ax.set_title(
            f"{preset}: dlora vs better, min over seeds "
            f"{result['summary'][preset]['dlora_vs_better_baseline_min_over_seeds']:.2f}",
            fontsize=8,
        )
        ax.set_xlabel("share of the most popular adapter")
        ax.set_yscale("log")
    axes[0].set_ylabel("avg latency per output token (ms), median over seeds")
    axes[0].legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(
        f"replica simulator: {w['num_prompts']} requests at {w['rate']} req/s per point, {w['seeds']} seeds, "
        f"step noise sd {w['noise_sd']}",
        fontsize=9,
    )
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.0, 2.0, 4.0, 10.0])
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--noise", type=float, default=0.15, help="log-normal sd of each step's time")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    t0 = time.monotonic()
    points = []
    for preset in PRESETS:
        for alpha in args.alphas:
            p = run_point(preset, alpha, args)
            points.append(p)
            lat = p["latency_per_output_token_ms"]
            print(
                f"[{time.monotonic() - t0:4.0f}s] {preset:13s} top {p['top_share']:.2f}: "
                + "  ".join(f"{k} {v:6.1f}" for k, v in lat.items())
                + f"  dlora vs better {p['dlora_vs_better_baseline']['median']:.3f} "
                f"(min {p['dlora_vs_better_baseline']['min']:.3f})",
                flush=True,
            )
    result = {
        **provenance("bench.batching_sim.run"),
        "workload": {
            "num_prompts": SkewWorkload(alpha=1.0).num_prompts,
            "rate": args.rate,
            "alphas": args.alphas,
            "seeds": args.seeds,
            "noise_sd": args.noise,
            "input_len": 64,
            "output_len": 64,
            "adapters": 8,
        },
        "dlora_scheduling": shipped_batching_parameters(),
        "presets": {name: vars(c) for name, c in PRESETS.items()},
        "points": points,
        "summary": summarize(points, args.alphas),
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
