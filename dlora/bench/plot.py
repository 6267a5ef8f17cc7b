"""PNG plots of benchmark results (matplotlib, Agg backend, no display needed).

- `plot_latency_vs_rate`: dLoRA's figure — average latency per output token, TTFT and SLO
  attainment against request rate, one point per rate of a sweep;
- `plot_per_adapter`: per-adapter bars of requests, mean TTFT, mean TPOT and SLO attainment;
- `plot_timeline`: one horizontal line per request from send to last token, coloured by adapter,
  faint until the first token;
- `plot_server_comparison`: servers compared on one workload, medians as bars and every run as a dot;
- `save_figure`: how every benchmark's figure is written.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: figures are written to files, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate_of(result: dict[str, Any]) -> float:
    rate = result.get("request_rate")
    if rate in (None, "inf") or (isinstance(rate, float) and math.isinf(rate)):
        return float(result["request_throughput"])
    return float(rate)


def _tail_key(result: dict[str, Any], metric: str) -> str | None:
    keys = [k for k in result if k.startswith("p") and k.endswith(f"_{metric}_ms")]
    return max(keys, key=lambda k: float(k[1:].split("_")[0])) if keys else None


def plot_latency_vs_rate(results: Sequence[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    plt = pyplot()
    rs = sorted(results, key=_rate_of)
    x = [_rate_of(r) for r in rs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(x, [r["avg_latency_per_output_token_ms"] for r in rs], "o-", label="Σ latency / Σ tokens (dLoRA)")
    ax.plot(x, [r["mean_normalized_latency_ms"] for r in rs], "s--", label="mean(latency / tokens)")
    ax.set_ylabel("latency per output token (ms)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(x, [r["mean_ttft_ms"] for r in rs], "o-", label="mean")
    if tail := _tail_key(rs[0], "ttft"):
        ax.plot(x, [r.get(tail, float("nan")) for r in rs], "s--", label=tail.split("_")[0].upper())
    ax.set_ylabel("TTFT (ms)")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.plot(x, [100 * r["slo_attainment"] for r in rs], "o-")
    ax.set_ylim(-2, 102)
    ax.set_ylabel(f"SLO attainment (%) @ {rs[0]['slo_per_token_ms']:g} ms/token")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"{rs[0].get('model_id')} — latency vs request rate")
    return save_figure(fig, path)


def plot_per_adapter(result: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    plt = pyplot()
    per = result["per_adapter"]
    names = sorted(per, key=lambda n: -(per[n]["completed"] + per[n]["failed"]))
    x = range(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 0.35 * len(names) + 4), 7), sharex=True)
    ok = [per[n]["completed"] for n in names]
    axes[0, 0].bar(x, ok, label="completed")
    axes[0, 0].bar(x, [per[n]["failed"] for n in names], bottom=ok, color="tab:red", label="failed")
    axes[0, 0].set_ylabel("requests")
    axes[0, 0].legend(fontsize=8)
    axes[0, 1].bar(x, [per[n]["mean_ttft_ms"] for n in names], color="tab:orange")
    axes[0, 1].set_ylabel("mean TTFT (ms)")
    axes[1, 0].bar(x, [per[n]["mean_tpot_ms"] for n in names], color="tab:green")
    axes[1, 0].set_ylabel("mean TPOT (ms)")
    axes[1, 1].bar(x, [100 * per[n]["slo_attainment"] for n in names], color="tab:purple")
    axes[1, 1].set_ylabel(f"SLO attainment (%) @ {result['slo_per_token_ms']:g} ms/token")
    axes[1, 1].set_ylim(0, 102)
    for ax in axes[1]:
        ax.set_xticks(list(x), names, rotation=60, ha="right", fontsize=7)
    for ax in axes.flat:
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title or f"per adapter — {_rate_label(result)}")
    return save_figure(fig, path)


def plot_timeline(result: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Needs the per-request arrays (start_times, ttfts, latencies, adapters, errors)."""
    plt = pyplot()
    from matplotlib.collections import LineCollection

    starts, ttfts, lats = result["start_times"], result["ttfts"], result["latencies"]
    adapters, errors = result["adapters"], result["errors"]
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    names = sorted({a for a in adapters if a is not None})
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    wait, run, colors, failed = [], [], [], []
    for y, i in enumerate(order):
        if errors[i]:
            failed.append((starts[i], y))
            continue
        s, f, e = starts[i], starts[i] + ttfts[i], starts[i] + lats[i]
        wait.append([(s, y), (f, y)])
        run.append([(f, y), (e, y)])
        colors.append(color.get(adapters[i], "gray"))
    fig, ax = plt.subplots(figsize=(12, max(4, min(12, 0.02 * len(order) + 3))))
    ax.add_collection(LineCollection(wait, colors=colors, alpha=0.25, linewidths=1))
    ax.add_collection(LineCollection(run, colors=colors, linewidths=1.5))
    if failed:
        ax.scatter(*zip(*failed), marker="x", color="red", s=12, label="failed")
    ax.autoscale()
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("request (by send time)")
    handles = [plt.Line2D([], [], color=color[n], label=n) for n in names[:20]]
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="upper left", ncol=2, title="adapter (faint = before first token)")
    ax.set_title(title or f"request timeline — {_rate_label(result)}")
    return save_figure(fig, path)


SERVER_PANELS = (
    ("output_throughput", "output tok/s (higher is better)"),
    ("median_ttft_ms", "median TTFT ms"),
    ("median_tpot_ms", "median TPOT ms"),
)


def plot_server_comparison(
    results: dict[str, Any],
    path: str | Path,
    title: str = "dlora vs vLLM server",
    panels: tuple[tuple[str, str], ...] = SERVER_PANELS,
    subtitle: str | None = None,
) -> Path:
    """Medians as bars, every run as a dot, for each server of `results["median"]`: one panel per
    (metric, label) of `panels`."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 3.2))
    for ax, (key, label) in zip(axes, panels):
        names = list(results["median"])
        ax.bar(names, [results["median"][n][key] for n in names], color=["#4477aa", "#cc6677"])
        for n_i, n in enumerate(names):
            ax.scatter([n_i] * len(results["runs"][n]), [r[key] for r in results["runs"][n]], color="k", s=8)
        ax.set_title(label, fontsize=9)
    subtitle = subtitle or (
        f"{results['workload']['num_prompts']} streamed requests over "
        f"{results['workload']['num_adapters']} adapters (medians of {results['reps']} alternating runs)"
    )
    fig.suptitle(f"{title}: {subtitle}", fontsize=9)
    return save_figure(fig, path)


def _rate_label(result: dict[str, Any]) -> str:
    rate = result.get("request_rate")
    return f"{rate:g} req/s" if rate not in (None, "inf") else "all requests at t=0"


def save_figure(fig: Any, path: str | Path, dpi: int = 110, tight: bool = True) -> Path:
    """Lay out `fig` (`tight`: matplotlib's tight layout; off for figures laid out by hand, such as
    those with a colorbar over several axes), write it as `path` (its folder made) and free it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_grouped_servers(
    workloads: dict[str, Any],
    path: str | Path,
    servers: Sequence[str],
    panels: tuple[tuple[str, str], ...],
    title: str,
) -> Path:
    """One group of bars per workload, one bar per server (its median) with every run as a dot:
    `workloads[w]["median"][server][key]` and `workloads[w]["runs"][server]`, one panel per
    (key, label) of `panels`."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 3.4))
    colors = ("#4477aa", "#cc6677", "#999999", "#228833")
    width = len(servers) + 1
    for ax, (key, label) in zip(axes, panels):
        for w_i, w in enumerate(workloads.values()):
            for n_i, name in enumerate(servers):
                x = w_i * width + n_i
                ax.bar(x, w["median"][name][key], color=colors[n_i % len(colors)], label=name if w_i == 0 else None)
                ax.scatter([x] * len(w["runs"][name]), [r[key] for r in w["runs"][name]], color="k", s=8)
        ax.set_xticks([w_i * width + (len(servers) - 1) / 2 for w_i in range(len(workloads))])
        ax.set_xticklabels(list(workloads))
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)
