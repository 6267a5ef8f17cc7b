"""Where dLoRA's merged/unmerged switching pays: dlora vs `unmerged`, `merged` and vLLM's server
over adapter rank, prompt length and adapter skew.

Real servers: one replica of the default model (SmolLM2-135M-Instruct, bf16) with 4 random
adapters on all seven projections (q, k, v, o, gate, up, down). Per rank, four servers start once
and stay up across the rank's cells: dlora with `scheduling.policy` `unmerged`, `merged` and
`dlora` (configs/default.yaml otherwise: einsum LoRA kernels, its scheduling parameters) and
vLLM's own OpenAI server (`--enable-lora`, the same engine settings), every engine pinned to
core 0 and taking turns. A cell sends `--num-prompts` requests at once, the top adapter taking
the cell's share of them (grid.py), and measures output throughput; each policy runs `--reps`
times per cell in rotating order (median). vLLM's server, several times slower with its CPU LoRA
ops, runs only at the extreme skews of the shortest prompt unless `--vllm all`. dlora's
`unmerged` and `merged` servers record every engine step (`DLORA_STEP_TRACE`); a linear fit of
those steps checks the simulator's cost model (sim.py) against this CPU.

    .venv/bin/python -m bench.where_merging_pays.run          # default grid, about 50 min on 2 cores
    .venv/bin/python -m bench.where_merging_pays.run --sim    # the simulator's grid, about 15 s

Both write their half of bench/where_merging_pays/result.json (the other half is kept) and
redraw result.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import yaml

from bench.where_merging_pays import grid
from bench.where_merging_pays.grid import ADAPTERS, MODULE_SETS, POLICIES, Cell
from bench.where_merging_pays.step_fit import fit_traces
from dlora import env
from dlora.bench.policy_servers import run_point, warm_up
from dlora.bench.provenance import machine, provenance
from dlora.bench.results import write_result
from dlora.bench.server_configs import EngineSettings, single_replica_config, vllm_server_command
from dlora.bench.servers import make_random_adapters, serving, start
from dlora.bench.shipped import shipped_config, shipped_scheduling
from dlora.bench.workload import Request, WorkloadSpec, generate_workload

HERE = Path(__file__).resolve().parent
PORTS = {"unmerged": 8341, "merged": 8342, "dlora": 8343, "vllm": 8344}
TRACED = ("unmerged", "merged")
KV_GIB = 1  # 32 x 1,056-token sequences of SmolLM2-135M take 0.8 GiB
MAX_MODEL_LEN = 2048


def url(system: str) -> str:
    return f"http://127.0.0.1:{PORTS[system]}"


def engine_settings(rank: int) -> EngineSettings:
    engine = shipped_config("engine")
    return EngineSettings(
        max_model_len=MAX_MODEL_LEN,
        max_loras=engine["max_loras"],
        max_lora_rank=max(rank, engine["max_lora_rank"]),
        max_num_seqs=engine["max_num_seqs"],
        kv_cache_space_gib=KV_GIB,
    )


def dlora_config(policy: str, rank: int, base: Path, adapters: list[Path], state: Path) -> dict:
    return single_replica_config(
        base,
        adapters,
        PORTS[policy],
        state,
        engine_settings(rank),
        lora_backend=shipped_config("engine")["lora_backend"],
        scheduling=shipped_scheduling(policy),
    )


def vllm_cells(args) -> set[tuple[int, float]]:
    """(prompt_len, share) where vLLM's server runs."""
    if args.vllm == "none":
        return set()
    if args.vllm == "all":
        return {(p, s) for p in args.prompt_lens for s in args.skews}
    return {(min(args.prompt_lens), s) for s in (min(args.skews), max(args.skews))}


REP_SEED_STRIDE = 1000  # a cell's rep r sends the workload of seed k + 1000 r (k: the cell's index)


def rotation(k: int, reps: int) -> list[tuple[int, str]]:
    """(rep, policy) for cell k: each rep runs every policy, the order rotated per cell and rep."""
    out = []
    for rep in range(reps):
        shift = (k + rep) % len(POLICIES)
        out.extend((rep, p) for p in POLICIES[shift:] + POLICIES[:shift])
    return out


def work_units(prompt_len: int, args) -> float:
    """A cell's expected cost for the ETA: prompt tokens plus decode steps at ~80 prompt tokens each."""
    return args.num_prompts * prompt_len + 80 * args.output_len


class Eta:
    def __init__(self, total_units: float):
        self.t0, self.total, self.done, self.spent = time.monotonic(), total_units, 0.0, 0.0

    def add(self, units: float, seconds: float) -> None:
        self.done, self.spent = self.done + units, self.spent + seconds

    def line(self) -> str:
        elapsed = time.monotonic() - self.t0
        left = (self.total - self.done) * self.spent / self.done if self.done else float("nan")
        return f"[{elapsed / 60:5.1f} min, {100 * self.done / self.total:3.0f}% done, ETA {left / 60:4.1f} min]"


def start_servers(rank: int, base: Path, adapters: list[Path], work: Path, with_vllm: bool) -> dict:
    """Every policy's server (and vLLM's) for `rank`, started, not yet healthy."""
    procs = {}
    for policy in POLICIES:
        cfg = work / f"r{rank}-{policy}.yaml"
        cfg.write_text(yaml.safe_dump(dlora_config(policy, rank, base, adapters, work / f"state-r{rank}-{policy}")))
        extra = {env.DLORA_STEP_TRACE.name: str(work / f"trace-r{rank}" / policy)} if policy in TRACED else {}
        procs[policy] = start(
            [sys.executable, "-m", "dlora.cli", "serve", "--config", str(cfg)], work / f"r{rank}-{policy}.log", extra
        )
    if with_vllm:
        procs["vllm"] = start(
            vllm_server_command(base, adapters, PORTS["vllm"], engine_settings(rank)),
            work / f"r{rank}-vllm.log",
            {"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), "VLLM_CPU_OMP_THREADS_BIND": "0"},
        )
    return procs


def warm(system: str, args) -> None:
    """The shared warm-up at 64-token prompts, then one request per adapter at each longer prompt
    (the first prefill of a shape builds oneDNN primitives)."""
    warm_up(url(system), ADAPTERS, 64, MAX_MODEL_LEN)
    for p in sorted(set(args.prompt_lens) - {64}):
        spec = WorkloadSpec(
            num_prompts=len(ADAPTERS),
            adapters=ADAPTERS,
            distribution="distinct",
            input_len=p,
            output_len=4,
            request_rate=float("inf"),
            max_model_len=MAX_MODEL_LEN,
            seed=97,
        )
        run_point(url(system), generate_workload(spec), dlora_server=False)


def measure(system: str, requests: list[Request], cell: Cell, rep: int | None, work: Path) -> dict:
    t0 = time.time()
    m = run_point(url(system), requests, dlora_server=system in POLICIES)
    if m["failed"]:
        raise RuntimeError(
            f"{system}: {m['failed']} requests failed in {cell}: {m['first_errors']} "
            f"(see {work}/r{cell.rank}-{system}.log); no result written"
        )
    return {**cell.key(), "system": system, "rep": rep, "wall": [t0, time.time()], "metrics": m}


def cell_result(cell: Cell, points: list[dict]) -> dict:
    """The medians over reps of each system's runs of the cell, and their ratios."""
    mine = [p for p in points if {k: p[k] for k in cell.key()} == cell.key()]
    keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "avg_latency_per_output_token_ms", "switches")
    systems = {}
    for s in sorted({p["system"] for p in mine}):
        runs = [p["metrics"] for p in mine if p["system"] == s]
        systems[s] = {k: statistics.median(m[k] for m in runs) for k in keys if all(k in m for m in runs)}
    throughput = {s: m["output_throughput"] for s, m in systems.items()}
    return {**cell.key(), "throughput": throughput, "systems": systems, "ratios": grid.cell_ratios(throughput)}


def run_real(args) -> dict:
    from dlora.models.smollm2 import prepare_smollm2

    base = prepare_smollm2()
    work = Path(env.cache_dir()) / "bench-run" / "where-merging-pays"
    work.mkdir(parents=True, exist_ok=True)
    modules = MODULE_SETS[args.modules]
    with_vllm = vllm_cells(args)
    cells = [Cell(r, args.modules, p, s) for r in args.ranks for p in args.prompt_lens for s in args.skews]
    per_cell = len(POLICIES) * args.reps
    eta = Eta(
        sum(work_units(c.prompt_len, args) * (per_cell + ((c.prompt_len, c.top_share) in with_vllm) * 3) for c in cells)
    )
    points: list[dict] = []
    fits: dict[str, dict] = {}
    adapters: list[Path] = []
    for rank in args.ranks:
        adapters = make_random_adapters(
            base, env.cache_dir() / "bench-adapters" / "smollm2", len(ADAPTERS), rank, target_modules=modules
        )
        procs = start_servers(rank, base, adapters, work, bool(with_vllm))
        logs = {system: work / f"r{rank}-{system}.log" for system in procs}
        with serving(procs, {system: url(system) for system in procs}, work, timeout=900, logs=logs):
            print(f"{eta.line()} rank {rank}: servers up; warming up", flush=True)
            for system in procs:
                warm(system, args)
            for k, cell in enumerate(c for c in cells if c.rank == rank):
                order: list[tuple[int | None, str]] = list(rotation(k, args.reps))
                if (cell.prompt_len, cell.top_share) in with_vllm:
                    order.insert(len(order) // 2, (None, "vllm"))
                for rep, system in order:
                    # Other prompts every rep: the same ones again would be prefix-cache hits.
                    seed = k + REP_SEED_STRIDE * (rep or 0)
                    requests = grid.cell_requests(cell, args.num_prompts, args.output_len, MAX_MODEL_LEN, seed=seed)
                    p = measure(system, requests, cell, rep, work)
                    points.append(p)
                    (work / "points.json").write_text(json.dumps(points))  # survives a crash later on
                    eta.add(
                        work_units(cell.prompt_len, args) * (3 if system == "vllm" else 1), p["wall"][1] - p["wall"][0]
                    )
                    m = p["metrics"]
                    sw = f", {m['switches']:.0f} switches" if "switches" in m else ""
                    print(
                        f"{eta.line()} rank {rank} prompt {cell.prompt_len} share {cell.top_share:.2f} "
                        f"{system:8s} {m['output_throughput']:6.1f} tok/s{sw}",
                        flush=True,
                    )
        fits[str(rank)] = fit_traces(work / f"trace-r{rank}", [p for p in points if p["rank"] == rank], TRACED)
    results = [cell_result(c, points) for c in cells]
    return {
        **provenance("bench.where_merging_pays.run"),
        "machine": {**machine(), "platform": platform.platform(), "note": "2 shared cores, engines on core 0"},
        "workload": {
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "prompt_lens": args.prompt_lens,
            "top_shares": args.skews,
            "ranks": args.ranks,
            "modules": list(modules),
            "num_adapters": len(ADAPTERS),
            "arrivals": "all at once",
            "ignore_eos": True,
            "stream": True,
            "reps": args.reps,
            "vllm_cells": sorted(with_vllm),
        },
        "dlora_config_last_rank": dlora_config("dlora", args.ranks[-1], base, adapters, work / "state"),
        "vllm_command_last_rank": shlex.join(
            vllm_server_command(base, adapters, PORTS["vllm"], engine_settings(args.ranks[-1]))
        ),
        "cells": results,
        "points": points,
        "step_fits": fits,
        "summary": grid.summarize(results, "real"),
        "wall_seconds": time.monotonic() - eta.t0,
    }


def write_half(out: Path, half: str, data: dict) -> None:
    """Replace one half (`real` or `sim`) of the result file, keep the other, redo the summary."""
    result = json.loads(out.read_text()) if out.is_file() else {}
    result[half] = data
    result["summary"] = {
        key: {h: result[h]["summary"][key] for h in ("real", "sim") if result.get(h)}
        for key in ("dlora_vs_unmerged_best", "dlora_vs_better_baseline_min")
    }
    write_result(result, out, grid.plot)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sim", action="store_true", help="the simulator's grid (sim.py) instead of real servers")
    ap.add_argument("--ranks", type=int, nargs="+", default=None, help="default: 8 64 (real), 8 32 64 (sim)")
    ap.add_argument("--skews", type=float, nargs="+", default=None, help="top adapter's shares; default 0.25 0.6 0.95")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 1024])
    ap.add_argument("--modules", choices=tuple(MODULE_SETS), default="all", help="real servers' adapted projections")
    ap.add_argument("--reps", type=int, default=1, help="runs of each policy per cell (median)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per cell, sent at once")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--vllm", choices=("extremes", "all", "none"), default="extremes")
    ap.add_argument("--seeds", type=int, default=8, help="simulator: workload seeds per cell")
    ap.add_argument("--noise", type=float, default=0.1, help="simulator: log-normal sd of each step's time")
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["alpha=0.9", "merged_cost_ratio=0.6", "alpha=0.9,merged_cost_ratio=0.6"],
        help="simulator: also run dlora with these scheduling keys changed (KEY=VALUE,...)",
    )
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    args.skews = args.skews or [0.25, 0.6, 0.95]
    if args.reps < 1 or args.num_prompts < 1 or args.output_len < 1:
        ap.error("--reps, --num-prompts and --output-len must be >= 1")
    if args.sim:
        from bench.where_merging_pays.sim import run_sim

        args.ranks = args.ranks or [8, 32, 64]
        write_half(Path(args.out), "sim", run_sim(args))
    else:
        args.ranks = args.ranks or [8, 64]
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        write_half(Path(args.out), "real", run_real(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
