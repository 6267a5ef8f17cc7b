"""The grid both halves of bench/where_merging_pays share: its cells, each cell's workload, the
per-cell ratios, the summary over the grid and the heat maps.

A cell is (rank, projections, prompt length, top-adapter share). Its workload: `num_prompts`
requests sent at once over `NUM_ADAPTERS` adapters, the first adapter taking round(share x n) of
them and the others the rest in turn, in a seeded random order, every request `prompt_len`
tokens in and exactly `output_len` out (ignore_eos). Throughput is output tokens per second.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from dlora.bench.plot import pyplot, save_figure
from dlora.bench.workload import Request, WorkloadSpec, generate_workload
from dlora.sim.step_costs import ALL_PROJECTIONS, QKVO

NUM_ADAPTERS = 4
ADAPTERS = tuple(f"a{i}" for i in range(NUM_ADAPTERS))
POLICIES = ("unmerged", "merged", "dlora")
MODULE_SETS = {"qkvo": QKVO, "all": ALL_PROJECTIONS}
TARGET_BETTER_BASELINE = 0.95
REGIME_KEYS = ("rank", "modules", "prompt_len", "top_share", "preset")


@dataclass(frozen=True)
class Cell:
    rank: int
    modules: str  # a key of MODULE_SETS
    prompt_len: int
    top_share: float

    def key(self) -> dict:
        return {"rank": self.rank, "modules": self.modules, "prompt_len": self.prompt_len, "top_share": self.top_share}


def top_share_adapters(n: int, top_share: float, adapters: tuple[str, ...], seed: int) -> list[str]:
    """n adapter names: round(top_share x n) of the first, the others in turn, shuffled (seeded)."""
    if not 0 < top_share <= 1 or not adapters:
        raise ValueError(f"top_share {top_share} must be in (0, 1] and adapters non-empty")
    top = round(top_share * n)
    rest = adapters[1:] or adapters
    names = [adapters[0]] * top + [rest[i % len(rest)] for i in range(n - top)]
    random.Random(seed).shuffle(names)
    return names


def cell_requests(
    cell: Cell, num_prompts: int, output_len: int, max_model_len: int, seed: int, with_prompts: bool = True
) -> list[Request]:
    """The cell's workload: every request at t=0, lengths fixed, adapters by `top_share_adapters`."""
    spec = WorkloadSpec(
        num_prompts=num_prompts,
        adapters=ADAPTERS,
        distribution="distinct",
        input_len=cell.prompt_len,
        output_len=output_len,
        request_rate=float("inf"),
        max_model_len=max_model_len,
        seed=seed,
    )
    names = top_share_adapters(num_prompts, cell.top_share, ADAPTERS, seed)
    return [replace(r, adapter=a) for r, a in zip(generate_workload(spec, with_prompts=with_prompts), names)]


def cell_ratios(throughput: dict[str, float]) -> dict[str, float]:
    """dlora's throughput against the unmerged, the better of unmerged/merged, and vLLM's server."""
    out = {
        "dlora_vs_unmerged": throughput["dlora"] / throughput["unmerged"],
        "dlora_vs_better_baseline": throughput["dlora"] / max(throughput["unmerged"], throughput["merged"]),
        "merged_vs_unmerged": throughput["merged"] / throughput["unmerged"],
    }
    if throughput.get("vllm"):
        out["dlora_vs_vllm_server"] = throughput["dlora"] / throughput["vllm"]
    return out


def summarize(cells: list[dict], source: str) -> dict:
    """The largest dlora/unmerged gain and the smallest dlora/better-baseline ratio over `cells`
    (each: the Cell's key, `preset` for the simulator's, and `ratios` from `cell_ratios`), and
    the cells below the target."""
    if not cells:
        raise ValueError("no cells to summarize")

    def regime(c: dict) -> dict:
        return {k: c[k] for k in REGIME_KEYS if k in c} | {"source": source}

    best = max(cells, key=lambda c: c["ratios"]["dlora_vs_unmerged"])
    worst = min(cells, key=lambda c: c["ratios"]["dlora_vs_better_baseline"])
    below = [c for c in cells if c["ratios"]["dlora_vs_better_baseline"] < TARGET_BETTER_BASELINE]
    return {
        "dlora_vs_unmerged_best": {"value": best["ratios"]["dlora_vs_unmerged"], "regime": regime(best)},
        "dlora_vs_better_baseline_min": {
            "value": worst["ratios"]["dlora_vs_better_baseline"],
            "regime": regime(worst),
            "target": f">= {TARGET_BETTER_BASELINE}",
            "met": worst["ratios"]["dlora_vs_better_baseline"] >= TARGET_BETTER_BASELINE,
        },
        "cells_below_target": [regime(c) | {"value": c["ratios"]["dlora_vs_better_baseline"]} for c in below],
        "metric": "output tokens/s; ratios are dlora / baseline (> 1: dlora faster)",
    }


def heat_map_panels(cells: list[dict], modules: str) -> dict[int, tuple[list[int], list[float], dict]]:
    """Per prompt length: (ranks, shares, {(rank, share): ratios}) of the cells on `modules`."""
    out: dict[int, tuple[list[int], list[float], dict]] = {}
    for p in sorted({c["prompt_len"] for c in cells if c["modules"] == modules}):
        sel = [c for c in cells if c["modules"] == modules and c["prompt_len"] == p]
        ranks = sorted({c["rank"] for c in sel})
        shares = sorted({c["top_share"] for c in sel})
        out[p] = (ranks, shares, {(c["rank"], c["top_share"]): c["ratios"] for c in sel})
    return out


def plot(result: dict, path: Path) -> None:
    """Heat maps, skew x rank, one column per prompt length: for the real grid and each simulator
    preset, a row of dlora / better baseline and a row of dlora / unmerged."""
    plt = pyplot()
    import numpy as np

    rows = []
    if result.get("real"):
        rows.append(("real servers (this CPU)", result["real"]["cells"]))
    for preset, cells in (result.get("sim") or {}).get("cells_by_preset", {}).items():
        rows.append((f"simulator, {preset}", cells))
    if not rows:
        return
    panels = [(title, heat_map_panels(cells, "all")) for title, cells in rows]
    ncols = max(len(p) for _, p in panels)
    metrics = (("dlora_vs_better_baseline", "dlora / max(unmerged, merged)"), ("dlora_vs_unmerged", "dlora / unmerged"))
    fig, axes = plt.subplots(
        2 * len(panels), ncols, figsize=(4.6 * ncols, 2.8 * 2 * len(panels)), squeeze=False, layout="constrained"
    )
    for r, (title, by_prompt) in enumerate(panels):
        for m, (key, label) in enumerate(metrics):
            for c, (prompt_len, (ranks, shares, ratios)) in enumerate(sorted(by_prompt.items())):
                ax = axes[2 * r + m][c]
                grid = np.array([[ratios.get((rk, s), {}).get(key, np.nan) for s in shares] for rk in ranks])
                im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2, aspect="auto", origin="lower")
                for i in range(len(ranks)):
                    for j in range(len(shares)):
                        if not np.isnan(grid[i, j]):
                            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
                ax.set_xticks(range(len(shares)), [f"{s:g}" for s in shares])
                ax.set_yticks(range(len(ranks)), [str(rk) for rk in ranks])
                ax.set_title(f"{title}\nprompt {prompt_len}: {label}", fontsize=8)
                ax.set_xlabel("top adapter's share", fontsize=7)
                ax.set_ylabel("rank (all 7 projections)", fontsize=7)
            for c in range(len(by_prompt), ncols):
                axes[2 * r + m][c].axis("off")
    fig.colorbar(im, ax=axes, shrink=0.5, label="ratio (> 1: dlora faster)")
    fig.suptitle("Where merging pays: dlora's throughput over the baselines", fontsize=10)
    save_figure(fig, path, dpi=100, tight=False)
