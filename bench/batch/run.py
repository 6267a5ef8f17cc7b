"""An offline batch over 16 adapters: vLLM's `run-batch`, dlora with the lines sent as they come,
and dlora with the stage planner.

The batch: `--requests` ShareGPT conversations (first turns, lengths as vLLM's ShareGPT loader
filters them; output lengths capped at `--max-tokens`) as /v1/completions lines, adapters drawn by
Zipf(1.0) over 16 random PEFT adapters of the default model (SmolLM2-135M-Instruct, fp32), greedy,
EOS honoured (no ignore_eos). Two adapter kinds: rank 8 on q/k/v/o, and rank 64 on all seven
projections (where merging pays most on this CPU, bench/where_merging_pays). Systems:

- `vllm`: `python -m vllm.entrypoints.openai.run_batch --enable-lora`, one engine on both cores
  (its makespan: its wall time less the wall time of the same command on a one-line file, i.e.
  less its start-up);
- `unplanned`: `dlora batch run` as configs/default.yaml ships it (2 replicas, one per core) with
  `batch.planner: none`: every line sent at once, dispatch and dLoRA's switching decide;
- `planned`: the same with `batch.planner: stages` (the stage plan);
- `base`: the same lines sent to the base model instead of their adapters, unplanned. A merged
  step is a base-model step, and this run has full batches, no switches and no drains, so no plan
  of the adapter lines can finish sooner: unplanned / base bounds what any plan can gain. Only with
  `--ignore-eos`, so that every system generates the same number of tokens per line.

dlora's makespan is the time `dlora batch run` prints (first line sent to last line done; its
start-up is not in it; each minute the bench prints how many lines are done and the plan's ETA).
Reps alternate the systems. Also recorded: the planner's predicted time
against the measured time of the planned run.

    .venv/bin/python -m bench.batch.run --requests 2000              # the full batch, hours here
    .venv/bin/python -m bench.batch.run --requests 200 --kinds r64-all
    .venv/bin/python -m bench.batch.run --requests 120 --ignore-eos --systems unplanned planned base

Writes bench/batch/result.json and result.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dlora import env
from dlora.bench.memory import rss_gib
from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora.bench.servers import make_random_adapters
from dlora.bench.workload import WorkloadSpec, generate_workload
from dlora.sim.step_costs import ALL_PROJECTIONS, QKVO

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
KINDS = {"r8-qkvo": (8, QKVO), "r64-all": (64, ALL_PROJECTIONS)}
SYSTEMS = ("unplanned", "planned", "vllm", "base")
ADAPTERS = 16
MAX_MODEL_LEN = 2048
KV_GIB = 2
# lora_alpha / r of the random adapters: small enough that the model still answers and stops, so
# output lengths vary by prompt and adapter as a real batch's do
ADAPTER_SCALE = 0.25
MEMORY_EVERY_S = 10.0
PROGRESS_EVERY_S = 60.0
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOOK = re.compile(r"took ([0-9.]+) s \(predicted at start: ([0-9.]+) s\)(?:; (.*))?")
PLAN = re.compile(r"plan: (\w+), (\d+) segments, predicted ([0-9.]+) s, measured ([0-9.]+) s")
REPLAN = re.compile(
    r"planned again at ([0-9.]+) s on measured step costs: (\w+), (\d+) segments, predicted ([0-9.]+) s"
)
# `dlora batch run`'s progress bar as tqdm writes it to a file: "812/2000 [10:01<14:40, 1.35req/s, plan ETA 620 s]"
# (its unit, "req", tells it from vLLM's own bars in the same log)
BAR = re.compile(r"(\d+)/(\d+) \[([^\]]*req[^\]]*)\]")
ETA = re.compile(r"plan ETA (\d+) s")


def last_progress(log_tail: str) -> str | None:
    """The last state of the progress bar in the tail of a `dlora batch run` log, as
    "812/2000 lines, plan ETA 620 s", or None before the bar's first update."""
    found = BAR.findall(log_tail)
    if not found:
        return None
    done, total, rest = found[-1]
    eta = ETA.search(rest)
    return f"{done}/{total} lines" + (f", plan ETA {eta.group(1)} s" if eta else "")


def read_tail(path: Path, size: int = 4096) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode(errors="replace")


def batch_lines(requests, url: str = COMPLETIONS, ignore_eos: bool = False, model: str | None = None) -> str:
    out = []
    for i, r in enumerate(requests):
        body = {"model": model or r.adapter, "max_tokens": r.output_len, "temperature": 0}
        if ignore_eos:
            body["ignore_eos"] = True
        if url == CHAT:
            body["messages"] = [{"role": "user", "content": r.prompt}]
        else:
            body["prompt"] = r.prompt
        out.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}))
    return "\n".join(out) + "\n"


def dlora_config(
    base: Path,
    adapters: list[Path],
    rank: int,
    planner: str,
    state: Path,
    kv_gib: int = KV_GIB,
    merged_cache_mib: float | None = None,
) -> dict:
    cfg = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    cfg["model"] = {**cfg["model"], "path": str(base), "served_name": "base", "max_model_len": MAX_MODEL_LEN}
    cfg["engine"]["max_lora_rank"] = max(rank, cfg["engine"]["max_lora_rank"])
    cfg["engine"]["kv_cache_space_gib"] = kv_gib
    if merged_cache_mib is not None:
        cfg["engine"]["merged_cache_mib"] = merged_cache_mib
    cfg["server"] = {**cfg["server"], "state_dir": str(state), "adapter_roots": [str(adapters[0].parent)]}
    cfg["adapters"] = [{"name": f"a{i}", "path": str(p)} for i, p in enumerate(adapters)]
    cfg["batch"] = {"planner": planner}
    return cfg


def vllm_command(base: Path, adapters: list[Path], rank: int, inp: Path, out: Path) -> list[str]:
    engine = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["engine"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(inp), "-o", str(out)]
    cmd += ["--model", str(base), "--served-model-name", "base", "--dtype", "float32"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(engine["max_num_seqs"]), "--enforce-eager"]
    cmd += ["--enable-lora", "--max-loras", str(engine["max_loras"]), "--max-lora-rank", str(max(rank, 16))]
    return cmd + ["--lora-modules", *[f"a{i}={p}" for i, p in enumerate(adapters)]]


def run_dlora(cfg: dict, inp: Path, work: Path, tag: str) -> dict:
    cfg_path = work / f"{tag}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    out = work / f"{tag}.out.jsonl"
    cmd = [sys.executable, "-m", "dlora.cli", "batch", "run", str(inp), "-o", str(out)]
    cmd += ["--config", str(cfg_path)]
    t0 = time.monotonic()
    memory: list[tuple[float, list[float]]] = []  # (seconds since start, each engine process's RSS in GiB)
    with open(work / f"{tag}.log", "w") as log, open(work / f"{tag}.stdout", "w") as out_file:
        proc = subprocess.Popen(cmd, stdout=out_file, stderr=log, text=True)
        shown = t0
        while proc.poll() is None and time.monotonic() - t0 < 6 * 3600:
            memory.append((round(time.monotonic() - t0, 1), rss_gib(proc.pid)["engine_processes"]))
            if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a run takes up to an hour: say how far it is
                shown = time.monotonic()
                progress = last_progress(read_tail(work / f"{tag}.log"))
                print(f"  {tag}: {(shown - t0) / 60:.1f} min, {progress or 'starting'}", flush=True)
            time.sleep(MEMORY_EVERY_S)
        proc.wait()
    stdout = (work / f"{tag}.stdout").read_text()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tag}: dlora batch run failed, see {work / f'{tag}.log'}")
    m = TOOK.search(stdout)
    assert m is not None, stdout
    point = {"makespan_s": float(m.group(1)), "predicted_at_start_s": float(m.group(2)), "wall_s": wall}
    # Engines' resident memory over the run: a replica that grows until the host is short of
    # memory is killed by Ray's memory monitor.
    point["engine_rss_gib_max"] = max((max(e) for _, e in memory if e), default=None)
    point["engine_rss_gib"] = memory
    plan = PLAN.search(m.group(3) or "")
    if plan is not None:
        point |= {
            "plan_mode": plan.group(1),
            "segments": int(plan.group(2)),
            "plan_predicted_s": float(plan.group(3)),
            "plan_measured_s": float(plan.group(4)),
        }
    replan = REPLAN.search(m.group(3) or "")
    if replan is not None:
        point |= {
            "replan_at_s": float(replan.group(1)),
            "replan_mode": replan.group(2),
            "replan_segments": int(replan.group(3)),
            "replan_predicted_s": float(replan.group(4)),
        }
    point["failed_lines"] = sum(1 for x in out.read_text().splitlines() if json.loads(x).get("error"))
    return point


def run_vllm(cmd: list[str], work: Path, tag: str, kv_gib: int) -> float:
    env_vars = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    t0 = time.monotonic()
    with open(work / f"{tag}.log", "w") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env_vars, timeout=6 * 3600)
    if done.returncode != 0:
        raise RuntimeError(f"{tag}: vLLM run_batch failed, see {work / f'{tag}.log'}")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=256, help="cap on each request's ShareGPT output length")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "result.json")
    # Host memory: two rank-64 all-projection engines at the defaults pass Ray's memory threshold
    # on a 24 GiB host (see README.md); these shrink each engine.
    ap.add_argument("--kv-gib", type=int, default=KV_GIB, help="KV cache space per engine (whole GiB)")
    ap.add_argument("--merged-cache-mib", type=float, help="engine.merged_cache_mib (default: the config's)")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every line generates its ShareGPT output length (needed for the `base` system's bound)",
    )
    args = ap.parse_args()
    if "base" in args.systems and not args.ignore_eos:
        ap.error("--systems base needs --ignore-eos: with EOS honoured the base model's outputs differ in length")
    memory = {"kv_gib": args.kv_gib, "merged_cache_mib": args.merged_cache_mib}
    from dlora.models.smollm2 import prepare_smollm2

    base = prepare_smollm2()
    work = Path(env.cache_dir()) / "bench-run" / "batch"
    work.mkdir(parents=True, exist_ok=True)
    names = tuple(f"a{i}" for i in range(ADAPTERS))
    spec = WorkloadSpec(
        num_prompts=args.requests,
        adapters=names,
        distribution="zipf",
        alpha=1.0,
        dataset="sharegpt",
        max_model_len=MAX_MODEL_LEN,
        tokenizer=str(base),
        seed=args.seed,
    )
    requests = generate_workload(spec)
    for r in requests:
        r.output_len = min(r.output_len, args.max_tokens)
    # vLLM's run-batch takes chat lines only (0.32: no /v1/completions), so with it every system
    # gets chat lines (the prompt as the user's message), and they compare on the same requests.
    url = CHAT if "vllm" in args.systems else COMPLETIONS
    inp = work / "input.jsonl"
    inp.write_text(batch_lines(requests, url, args.ignore_eos))
    inp_base = work / "input-base.jsonl"  # the `base` system's lines: the same, to the base model
    if "base" in args.systems:
        inp_base.write_text(batch_lines(requests, url, args.ignore_eos, model="base"))
    (work / "one.jsonl").write_text(batch_lines(requests[:1], url))
    per_adapter = {a: sum(r.adapter == a for r in requests) for a in names}
    print(f"{len(requests)} requests, per adapter {list(per_adapter.values())}", flush=True)
    t_start = time.monotonic()
    points: list[dict] = []
    for kind in args.kinds:
        rank, modules = KINDS[kind]
        adapters = make_random_adapters(
            base,
            env.cache_dir() / "bench-adapters" / "smollm2-batch",
            ADAPTERS,
            rank,
            scales=[ADAPTER_SCALE] * ADAPTERS,
            target_modules=modules,
        )
        for rep in range(args.reps):
            order = args.systems[rep % len(args.systems) :] + args.systems[: rep % len(args.systems)]
            for system in order:
                tag = f"{kind}-{system}-{rep}"
                if system == "vllm":
                    startup = run_vllm(
                        vllm_command(base, adapters, rank, work / "one.jsonl", work / "o1"),
                        work,
                        tag + "-one",
                        args.kv_gib,
                    )
                    wall = run_vllm(
                        vllm_command(base, adapters, rank, inp, work / f"{tag}.out.jsonl"), work, tag, args.kv_gib
                    )
                    point = {"makespan_s": wall - startup, "wall_s": wall, "startup_s": startup}
                else:
                    planner = "stages" if system == "planned" else "none"
                    point = run_dlora(
                        dlora_config(base, adapters, rank, planner, work / f"state-{tag}", **memory),
                        inp_base if system == "base" else inp,
                        work,
                        tag,
                    )
                points.append({"kind": kind, "system": system, "rep": rep, **point})
                (work / "points.json").write_text(json.dumps(points))
                elapsed = (time.monotonic() - t_start) / 60
                failed = point.get("failed_lines", 0)
                print(
                    f"[{elapsed:5.1f} min] {kind} {system} rep {rep}: makespan {point['makespan_s']:.1f} s, "
                    f"{failed} lines failed",
                    flush=True,
                )
    result = {
        **provenance("bench.batch.run"),
        "workload": {
            "requests": len(requests),
            "adapters": ADAPTERS,
            "distribution": "zipf 1.0",
            "per_adapter": per_adapter,
            "dataset": "sharegpt (vLLM's length filter)",
            "endpoint": url,
            "max_tokens_cap": args.max_tokens,
            "prompt_tokens_total": sum(r.prompt_len for r in requests),
            "max_tokens_total": sum(r.output_len for r in requests),
            "greedy": True,
            "ignore_eos": args.ignore_eos,
            "adapter_scale": ADAPTER_SCALE,
        },
        "dlora_config_last": dlora_config(base, adapters, rank, "stages", work / "state", **memory),
        "vllm_command_last": shlex.join(vllm_command(base, adapters, rank, inp, work / "out.jsonl")),
        "points": points,
        "summary": summarize(points),
        "wall_seconds": time.monotonic() - t_start,
    }
    write_result(result, args.out, plot)
    return 0


def summarize(points: list[dict]) -> dict:
    out: dict = {}
    for kind in sorted({p["kind"] for p in points}):
        med = {
            s: statistics.median(p["makespan_s"] for p in points if p["kind"] == kind and p["system"] == s)
            for s in SYSTEMS
            if any(p["kind"] == kind and p["system"] == s for p in points)
        }
        out[kind] = {f"makespan_s_{s}": v for s, v in med.items()}
        if "planned" in med and "vllm" in med:
            out[kind]["makespan_vs_vllm"] = med["vllm"] / med["planned"]
        if "planned" in med and "unplanned" in med:
            out[kind]["makespan_vs_unplanned"] = med["unplanned"] / med["planned"]
        if "base" in med and "unplanned" in med:
            # the most any plan could gain over unplanned (see `base` in the module docstring)
            out[kind]["plan_gain_bound"] = med["unplanned"] / med["base"]
        for key, predicted in (
            ("plan_prediction_error", "plan_predicted_s"),
            ("replan_prediction_error", "replan_predicted_s"),
        ):
            errors = [
                (p[predicted] - p["plan_measured_s"]) / p["plan_measured_s"]
                for p in points
                if p["kind"] == kind and predicted in p and "plan_measured_s" in p
            ]
            if errors:
                out[kind][key] = statistics.median(errors)
        out[kind]["failed_lines"] = {
            s: sum(p.get("failed_lines", 0) for p in points if p["kind"] == kind and p["system"] == s) for s in med
        }
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    kinds = sorted(result["summary"])
    systems = [s for s in SYSTEMS if any(f"makespan_s_{s}" in result["summary"][k] for k in kinds)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(systems)
    for j, system in enumerate(systems):
        xs, ys = [], []
        for i, kind in enumerate(kinds):
            v = result["summary"][kind].get(f"makespan_s_{system}")
            if v is not None:
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(v)
        bars = ax.bar(xs, ys, width, label=system)
        ax.bar_label(bars, fmt="%.0f s")
    ax.set_xlim(-0.6, len(kinds) - 0.4)
    ax.set_xticks(range(len(kinds)), kinds)
    ax.set_ylabel("makespan (s)")
    w = result["workload"]
    ax.set_title(f"{w['requests']} ShareGPT requests over {w['adapters']} adapters (Zipf 1.0)")
    ax.legend()
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
