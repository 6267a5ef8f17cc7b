"""Where the memory of `make serve` goes: PSS of every process of the server's tree (the API
process, Ray's processes, each replica's actor and engine process) and, inside each, per group of
mappings (heap, malloc arenas, KV cache, libraries, weights).

Starts configs/default.yaml as shipped (own port and state dir), sends a few requests to each
adapter and the base model, reads /proc (`dlora/bench/memory.py`), optionally soaks it with
Poisson traffic for `--soak-s` and reads it again, then stops it. `--set engine.X=Y` changes the
config and `--env K=V` the server tree's environment, to measure what a change saves.

    .venv/bin/python -m bench.memory_footprint.run                      # warm only, ~1.5 min
    .venv/bin/python -m bench.memory_footprint.run --soak-s 300 --rate 1
    .venv/bin/python -m bench.memory_footprint.run --set engine.kv_cache_space_gib=1 --out /tmp/kv1.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from dlora.bench.memory import tree_pss
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.scrape import metric_total, metric_values
from dlora.bench.server_configs import shipped_server_config
from dlora.bench.servers import serving, start_dlora

HERE = Path(__file__).resolve().parent
GIB = 1 << 30
PROMPTS = (
    "Tell me about the sea and the ships that sail on it.",
    "Write a short note to a friend about the weather today.",
    "List three things to pack for a trip to the mountains.",
    "Explain in two sentences why the sky is blue.",
)


def parse_value(raw: str):
    """A --set value as YAML reads it: 1 -> int, 0.5 -> float, null -> None, true -> bool."""
    return yaml.safe_load(raw)


def apply_sets(cfg: dict, sets: list[str]) -> dict:
    for item in sets:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        cfg.setdefault(section, {})[name] = parse_value(raw)
    return cfg


def kv_cache_bytes(engine: dict) -> int:
    """The KV cache an engine allocates, as far as the config alone says: whole GiB (vLLM CPU)."""
    return int(engine.get("kv_cache_space_gib", 1) * GIB)


def models(cfg: dict) -> list[str]:
    return [cfg["model"]["served_name"], *(a["name"] for a in cfg.get("adapters", []))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> int:
    """Output tokens of one completion (0 on failure)."""
    try:
        r = await client.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
            timeout=300,
        )
    except httpx.HTTPError:
        return 0
    if r.status_code != 200:
        return 0
    return int(r.json().get("usage", {}).get("completion_tokens", 0))


async def warm(url: str, names: list[str], per_model: int, max_tokens: int) -> dict:
    """Every model in turn, `per_model` requests at once: each adapter is loaded and run, and on
    more than one replica where the router spreads them."""
    tokens: list[int] = []
    async with httpx.AsyncClient() as client:
        for m in names:
            tokens += await asyncio.gather(
                *(one_request(client, url, m, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(per_model))
            )
    return {"requests": len(tokens), "failed": sum(t == 0 for t in tokens), "output_tokens": sum(tokens)}


async def soak(url: str, names: list[str], seconds: float, rate: float, max_in_flight: int, max_tokens: int) -> dict:
    """Poisson arrivals at `rate` per second over random models and prompts for `seconds`; at most
    `max_in_flight` requests at once (arrivals beyond wait), so the load stays bounded."""
    rng = random.Random(0)
    gate = asyncio.Semaphore(max_in_flight)
    results: list[int] = []

    async def send(client: httpx.AsyncClient) -> None:
        async with gate:
            results.append(await one_request(client, url, rng.choice(names), rng.choice(PROMPTS), max_tokens))

    start = time.monotonic()
    kv_usage: list[float] = []
    async with httpx.AsyncClient() as client:
        tasks = []
        next_sample = start
        while time.monotonic() - start < seconds:
            tasks.append(asyncio.create_task(send(client)))
            if time.monotonic() >= next_sample:  # how full the KV caches get at this load
                kv_usage += await kv_usage_now(client, url)
                next_sample += 5
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        preemptions = metric_total((await client.get(f"{url}/metrics")).text, "dlora_preemptions_total")
    took = time.monotonic() - start
    return {
        "kv_usage_max": max(kv_usage, default=0.0),
        "preemptions": preemptions,
        "seconds": round(took, 1),
        "rate": rate,
        "requests": len(results),
        "failed": sum(t == 0 for t in results),
        "output_tokens": sum(results),
        "output_tok_per_s": round(sum(results) / took, 2),
    }


async def kv_usage_now(client: httpx.AsyncClient, url: str) -> list[float]:
    """Each replica's fraction of its KV cache in use now (none if /metrics does not answer)."""
    try:
        return metric_values((await client.get(f"{url}/metrics", timeout=10)).text, "dlora_replica_kv_usage")
    except httpx.HTTPError:
        return []


def summary(snapshot: dict) -> dict:
    """Totals per role and the engines' groups summed, the headline of a snapshot."""
    engine_groups: dict[str, float] = {}
    for p in snapshot["processes"]:
        if p["role"] == "engine_core":
            for g, v in p["groups_mib"].items():
                engine_groups[g] = round(engine_groups.get(g, 0.0) + v, 1)
    return {
        "total_pss_mib": snapshot["total_pss_mib"],
        "by_role_mib": snapshot["by_role_mib"],
        "engine_groups_mib": dict(sorted(engine_groups.items(), key=lambda kv: -kv[1])),
    }


def plot(result: dict, path: Path) -> None:
    from dlora.bench.plot import pyplot, save_figure

    plt = pyplot()
    snap = result["snapshots"][-1]
    procs = sorted(snap["processes"], key=lambda p: -p["pss_mib"])[:8]
    groups = sorted({g for p in procs for g in p["groups_mib"]})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(procs)
    for g in groups:
        values = [p["groups_mib"].get(g, 0.0) for p in procs]
        if max(values) < 20:
            continue
        ax.bar(range(len(procs)), values, bottom=bottom, label=g)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(procs)), [f"{p['role']}\n{p['pid']}" for p in procs], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("PSS (MiB)")
    ax.set_title(f"{snap['label']}: {snap['total_pss_mib'] / 1024:.2f} GiB PSS in all")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--warm-per-model", type=int, default=3, help="requests to each model before the first read")
    ap.add_argument("--soak-s", type=float, default=0.0, help="seconds of traffic after warming (0: none)")
    ap.add_argument("--rate", type=float, default=1.2, help="soak arrivals per second")
    ap.add_argument("--max-in-flight", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], help="config key=value, e.g. engine.kv_cache_space_gib=1")
    ap.add_argument("--env", action="append", default=[], help="K=V in the server tree's environment")
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()

    extra_env = dict(item.partition("=")[::2] for item in args.env)
    os.environ.update(extra_env)  # start_dlora passes this process's environment on
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory(prefix="dlora-memory-") as tmp:
        work = Path(tmp)
        cfg = apply_sets(shipped_server_config(args.port, str(work / "state")), args.set)
        names = models(cfg)
        kv = kv_cache_bytes(cfg["engine"])
        proc = start_dlora(cfg, work, "memory")
        snapshots = []
        with serving({"memory": proc}, {"memory": url}, work):
            load = {"warm": asyncio.run(warm(url, names, args.warm_per_model, args.max_tokens))}
            snapshots.append({"label": "warm", **tree_pss(proc.pid, kv)})
            print(summary(snapshots[-1]), flush=True)
            if args.soak_s > 0:
                load["soak"] = asyncio.run(
                    soak(url, names, args.soak_s, args.rate, args.max_in_flight, args.max_tokens)
                )
                snapshots.append({"label": f"after {args.soak_s:g} s at {args.rate:g} req/s", **tree_pss(proc.pid, kv)})
    result = {
        **provenance("bench.memory_footprint.run"),
        "config": {"engine": cfg["engine"], "model": cfg["model"], "cluster": cfg["cluster"]},
        "env": extra_env,
        "load": load,
        "summary": summary(snapshots[-1]),
        "snapshots": snapshots,
    }
    write_result(result, args.out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
