"""A cold adapter load next to a running stream: TTFT of the cold request, and the stall of the other.

One replica engine (`EngineHost`, as a replica actor runs it, its engine pinned to one core) runs a
long greedy base-model stream (the hot stream). After its first tokens a request for an adapter the
engine does not hold arrives: the host loads the adapter (`add_adapter`) and then runs the request;
afterwards the same request is sent again, now warm. Measured per rep: the cold and the warm
request's TTFT (from its arrival at the host to its first token), and the hot stream's inter-token
gaps while the cold request waited for its first token (p50 and max), next to its steady gaps
before the load. Two adapter kinds of SmolLM2-135M: rank-8 q/k/v/o and rank-64 on every
projection. Two modes, alternating within each rep: `engine.prefetch_adapters: false` (vLLM's own
`add_lora`, the whole read between two steps) and `true` (the read in a background thread,
engine_ext/lora_prefetch.py). Each cold load uses a fresh adapter id, so nothing is cached in the
engine; the files are in the OS page cache after the first rep, as a replica's popular adapters are.

    .venv/bin/python -m bench.cold_load.run --reps 7

Writes bench/cold_load/result.json (+ .png).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

from dlora import config, env
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.servers import make_random_adapters
from dlora.models.smollm2 import resolve_model_path
from dlora.replica.engine import EngineHost
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import replica_runtime_env
from dlora.sim.step_costs import ALL_PROJECTIONS, QKVO

HERE = Path(__file__).resolve().parent
KINDS = {"r8-qkvo": (8, QKVO), "r64-all": (64, ALL_PROJECTIONS)}
MODES = {"in-step": False, "prefetch": True}  # engine.prefetch_adapters
HOT_PROMPT = tuple(range(1000, 1064))
COLD_PROMPT = tuple(range(2000, 2032))
STEADY_TOKENS = 24  # hot tokens before the cold request arrives
COLD_MAX_TOKENS = 16


@dataclasses.dataclass
class HotStream:
    """A long greedy stream and the arrival time of each of its deltas."""

    host: EngineHost
    request_id: str
    arrivals: list[float] = dataclasses.field(default_factory=list)
    task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        req = GenerateRequest(self.request_id, HOT_PROMPT, _greedy(1500), None)
        async for d in self.host.generate(req):
            if d.token_ids:
                self.arrivals.append(time.perf_counter())

    async def tokens(self, n: int) -> None:
        while len(self.arrivals) < n:
            await asyncio.sleep(0.002)

    def gaps(self, start: float, end: float) -> list[float]:
        """Gaps ending in (start, end]; the first one spans `start` itself."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if start < a[i] <= end]

    def gaps_over(self, start: float, end: float) -> list[float]:
        """Gaps that overlap [start, end]: a step held up by the load ends after it."""
        a = self.arrivals
        return [a[i] - a[i - 1] for i in range(1, len(a)) if a[i] > start and a[i - 1] < end]

    async def stop(self) -> None:
        await self.host.abort(self.request_id)
        assert self.task is not None
        await self.task


def _greedy(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def first_token(host: EngineHost, req: GenerateRequest) -> tuple[float, list[int]]:
    """Seconds to the request's first token, and all its tokens."""
    t0, ttft, ids = time.perf_counter(), None, []
    async for d in host.generate(req):
        if d.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        ids += d.token_ids
    assert ttft is not None
    return ttft, ids


async def one_rep(host: EngineHost, base_cfg, ref: AdapterRef, prefetch: bool, tag: str) -> dict:
    host.cfg = dataclasses.replace(base_cfg, engine=dataclasses.replace(base_cfg.engine, prefetch_adapters=prefetch))
    hot = HotStream(host, f"hot-{tag}")
    hot.start()
    await hot.tokens(STEADY_TOKENS)
    steady = hot.gaps(hot.arrivals[4], hot.arrivals[-1])
    cold_req = GenerateRequest(f"cold-{tag}", COLD_PROMPT, _greedy(COLD_MAX_TOKENS), ref)
    t0 = time.perf_counter()
    await host.add_adapter(ref)
    load_s = time.perf_counter() - t0
    ttft_rest, cold_ids = await first_token(host, cold_req)
    cold_ttft = load_s + ttft_rest
    during_load = hot.gaps_over(t0, t0 + load_s)
    during = hot.gaps(t0, t0 + cold_ttft)
    await hot.tokens(len(hot.arrivals) + 8)
    t2 = time.perf_counter()
    warm_ttft, warm_ids = await first_token(host, dataclasses.replace(cold_req, request_id=f"warm-{tag}"))
    during_warm = hot.gaps(t2, t2 + warm_ttft)
    await hot.stop()
    await host.remove_adapter(ref.int_id)
    return {
        "load_s": load_s,
        "cold_ttft_s": cold_ttft,
        "warm_ttft_s": warm_ttft,
        "hot_steady_gap_p50_s": statistics.median(steady),
        "hot_gap_p50_during_load_s": statistics.median(during_load) if during_load else None,
        "hot_gap_max_during_load_s": max(during_load) if during_load else None,
        "hot_gap_p50_during_cold_s": statistics.median(during) if during else None,
        "hot_gap_max_during_cold_s": max(during) if during else None,
        "hot_gap_max_during_warm_s": max(during_warm) if during_warm else None,
        "cold_equals_warm": cold_ids == warm_ids,
    }


def engine_config(model: str):
    return config.from_dict(
        {
            "model": {"path": model, "dtype": "float32", "max_model_len": 2048},
            "engine": {
                "max_loras": 4,
                "max_lora_rank": 64,
                "max_cpu_loras": 8,
                "max_num_seqs": 16,
                "lora_backend": "einsum",  # configs/default.yaml's
            },
            # unmerged: a load is add_lora alone (other policies also prepare the merged weights)
            "scheduling": {"policy": "unmerged"},
        }
    )


def start_pinned(host: EngineHost, loop, core: int | None) -> None:
    """Start the engine with its engine-core process on `core`, as `ReplicaActor.start` does."""
    previous = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        loop.run_until_complete(host.start())
    finally:
        os.sched_setaffinity(0, previous)


def median_of(reps: list[dict], key: str) -> float | None:
    values = [r[key] for r in reps if r[key] is not None]
    return statistics.median(values) if values else None


def summarize(runs: dict) -> dict:
    out = {}
    for kind, by_mode in runs.items():
        keys = [k for k in next(iter(by_mode.values()))[0] if k != "cold_equals_warm"]
        med = {mode: {k: median_of(reps, k) for k in keys} for mode, reps in by_mode.items()}
        before, after = med["in-step"], med["prefetch"]
        out[kind] = {
            "medians": med,
            "hot_gap_max_during_load_ratio_in_step_over_prefetch": before["hot_gap_max_during_load_s"]
            / after["hot_gap_max_during_load_s"],
            "cold_ttft_ratio_prefetch_over_in_step": after["cold_ttft_s"] / before["cold_ttft_s"],
            "cold_equals_warm_every_rep": all(r["cold_equals_warm"] for reps in by_mode.values() for r in reps),
        }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    kinds = list(result["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    metrics = [
        ("hot stream: inter-token gap (ms)", ["hot_steady_gap_p50_s", "hot_gap_max_during_load_s"]),
        ("TTFT (ms)", ["warm_ttft_s", "cold_ttft_s"]),
    ]
    colors = {"in-step": "#c0504d", "prefetch": "#4f81bd"}
    for ax, (title, keys) in zip(axes, metrics):
        labels, x = [], 0
        for kind in kinds:
            for key in keys:
                for j, mode in enumerate(MODES):
                    v = result["summary"][kind]["medians"][mode][key]
                    ax.bar(x + 0.4 * j, (v or 0) * 1000, 0.4, color=colors[mode], label=mode if x == 0 else None)
                labels.append((x + 0.2, f"{kind}\n{key.removesuffix('_s').replace('hot_', '').replace('_', ' ')}"))
                x += 1
        ax.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=6)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle("Cold adapter load beside a running stream (SmolLM2-135M, 1 core; medians)", fontsize=10)
    save_figure(fig, path)


def _line(r: dict) -> str:
    ms = {k: (v or 0.0) * 1e3 for k, v in r.items() if k.endswith("_s")}
    return (
        f"load {ms['load_s']:6.1f} ms  TTFT cold {ms['cold_ttft_s']:6.1f} warm {ms['warm_ttft_s']:6.1f}  "
        f"hot gap: steady p50 {ms['hot_steady_gap_p50_s']:5.1f}, during the load p50 "
        f"{ms['hot_gap_p50_during_load_s']:5.1f} max {ms['hot_gap_max_during_load_s']:6.1f}, until the cold "
        f"first token max {ms['hot_gap_max_during_cold_s']:6.1f}, warm {ms['hot_gap_max_during_warm_s']:6.1f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--core", type=int, default=1, help="the engine's core (-1: no pinning)")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()

    model = resolve_model_path(config.ModelConfig().path)
    out = env.cache_dir() / "bench-adapters" / "smollm2"
    adapters = {k: make_random_adapters(Path(model), out, 1, r, None, t)[0] for k, (r, t) in KINDS.items()}
    cfg = engine_config(model)
    for key, value in replica_runtime_env(cfg)["env_vars"].items():
        os.environ[key] = value
    loop = asyncio.new_event_loop()
    host = EngineHost(cfg, model)
    start_pinned(host, loop, None if args.core < 0 else args.core)
    ids = itertools.count(1000)
    runs: dict[str, dict[str, list[dict]]] = {k: {m: [] for m in MODES} for k in KINDS}
    try:
        for rep in range(args.reps):
            for kind, path in adapters.items():
                order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]
                for mode in order:
                    int_id = next(ids)
                    ref = AdapterRef(f"{kind}-{int_id}", int_id, str(path))
                    r = loop.run_until_complete(one_rep(host, cfg, ref, MODES[mode], f"{kind}-{mode}-{rep}"))
                    runs[kind][mode].append(r)
                    print(f"rep {rep} {kind:8s} {mode:8s} " + _line(r), flush=True)
    finally:
        host.shutdown()
    result = {
        "provenance": provenance("bench.cold_load.run"),
        "settings": {
            "model": "SmolLM2-135M-Instruct fp32",
            "engine_core": args.core,
            "kinds": {k: {"rank": r, "targets": list(t)} for k, (r, t) in KINDS.items()},
            "policy": "unmerged",
            "reps": args.reps,
        },
        "summary": summarize(runs),
        "runs": runs,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
