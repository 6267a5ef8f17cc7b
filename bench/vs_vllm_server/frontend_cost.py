"""Does serving /v1/completions with vLLM's own serving classes cost speed against the hand-written
layer it replaced?

The last commit with the hand-written layer (3681876, checked out as a git worktree) and this
checkout run side by side, one dlora server each with the same config (as run.py's default-config
run: one replica on core 0, einsum LoRA backend, `dlora` policy) and the same interpreter and
packages; the streamed mixed-adapter workload of run.py goes to them alternately, `--reps` times
each. Target: median output throughput of this checkout / the old commit >= 0.97. Writes
bench/vs_vllm_server/frontend_cost.json (+ .png).

    .venv/bin/python -m bench.vs_vllm_server.frontend_cost            # 64 requests x 4 adapters, 6 reps
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import httpx
import yaml

from dlora import env
from dlora.bench.plot import plot_server_comparison
from dlora.bench.provenance import git_commit, provenance
from dlora.bench.results import write_result
from dlora.bench.server_comparison import (
    METRICS,
    alternate_runs,
    dlora_config,
    mixed_adapter_workload,
    run_once,
    workload_args,
    workload_record,
)
from dlora.bench.servers import make_random_adapters, serving
from dlora.bench.shipped import REPO_ROOT
from dlora.bench.source_tree import check_imported, ensure_worktree, serve_from, tree_sources
from dlora.bench.stats import medians
from dlora.models.smollm2 import prepare_smollm2

HERE = Path(__file__).resolve().parent
OLD_COMMIT = "3681876"  # the last commit with the hand-written /v1/completions and /v1/chat/completions
TARGET = 0.97
# Command names of the processes that run dlora's replica code (Ray's dashboard and runtime-env
# agents start with an environment of Ray's own and run none of it).
REPLICA_PROCESSES = ("ray::Replica", "VLLM::")


def responses_status(url: str) -> int:
    """POST /v1/responses' status: 404 where the server predates vLLM's serving classes."""
    body = {"model": "a0", "input": "hi", "max_output_tokens": 1}
    return httpx.post(f"{url}/v1/responses", json=body, timeout=120).status_code


def check_source(name: str, source: Path, proc, log: Path) -> dict:
    """Where the server's dlora came from: the API process's import, and the PYTHONPATH of the
    processes that run dlora's replica code (Ray's replica actors, vLLM's engine cores)."""
    imported = check_imported(name, source, log)
    tree = tree_sources(proc.pid)
    replicas = {path: [c for c in comms if c.startswith(REPLICA_PROCESSES)] for path, comms in tree.items()}
    if set(p for p, comms in replicas.items() if comms) != {str(source)}:
        raise RuntimeError(f"{name}'s replica processes by PYTHONPATH: {tree}; want all under {source}")
    return {"source": str(source), "dlora_imported_from": imported, "python_processes_by_pythonpath": tree}


def ratios(runs: dict[str, list[dict]], key: str) -> list[float]:
    """head / old of `key` per rep (each rep runs both, one after the other)."""
    return [h[key] / o[key] for h, o in zip(runs["head"], runs["old"])]


def summarize(runs: dict[str, list[dict]], median: dict[str, dict]) -> dict:
    tp = median["head"]["output_throughput"] / median["old"]["output_throughput"]
    return {
        "throughput_ratio_head_over_old": tp,
        "median_of_rep_throughput_ratios": statistics.median(ratios(runs, "output_throughput")),
        "rep_throughput_ratios": ratios(runs, "output_throughput"),
        "ttft_ratio_old_over_head": median["old"]["median_ttft_ms"] / median["head"]["median_ttft_ms"],
        "tpot_ratio_old_over_head": median["old"]["median_tpot_ms"] / median["head"]["median_tpot_ms"],
        "target": f"throughput_ratio_head_over_old >= {TARGET}",
        "target_met": tp >= TARGET,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap, reps=6)
    ap.add_argument("--old-commit", default=OLD_COMMIT)
    ap.add_argument("--old-tree", default=f"/tmp/dlora-{OLD_COMMIT}", help="its git worktree (made when absent)")
    ap.add_argument("--out", default=str(HERE / "frontend_cost.json"))
    args = ap.parse_args()

    old_tree = Path(args.old_tree)
    old_commit = ensure_worktree(REPO_ROOT, args.old_commit, old_tree)
    sources = {"old": old_tree, "head": REPO_ROOT}
    base = prepare_smollm2()
    adapters = make_random_adapters(base, env.cache_dir() / "bench-adapters" / "smollm2", args.num_adapters, args.rank)
    work = Path(env.cache_dir()) / "bench-frontend-cost"
    work.mkdir(parents=True, exist_ok=True)
    ports = {"old": 8314, "head": 8315}
    configs = {n: dlora_config(args, base, adapters, ports[n], work / f"state-{n}") for n in sources}
    procs = {}
    for name, source in sources.items():
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(configs[name]))
        procs[name] = serve_from(source, path, work / f"{name}.log")
    urls = {n: f"http://127.0.0.1:{ports[n]}" for n in sources}
    with serving(procs, urls, work):
        served = {}
        for name, proc in procs.items():
            served[name] = check_source(name, sources[name], proc, work / f"{name}.log")
            served[name]["responses_status"] = responses_status(urls[name])
            print(f"{name}: dlora from {served[name]['dlora_imported_from']}", flush=True)
        requests = mixed_adapter_workload(args)
        runs = alternate_runs(urls, requests, args.reps, run_once, warmup=args.num_adapters * 2)

    median = medians(runs, METRICS)
    result = {
        **provenance("bench.vs_vllm_server.frontend_cost"),
        "question": "does vLLM's serving frontend cost output throughput against the hand-written layer it replaced?",
        "commits": {"old": old_commit, "head": git_commit()},
        "served": served,
        "dlora_config": configs["head"],
        "workload": workload_record(args),
        "reps": args.reps,
        "runs": runs,
        "median": median,
        "summary": summarize(runs, median),
    }
    ratio = result["summary"]["throughput_ratio_head_over_old"]
    title = f"dlora at HEAD / {args.old_commit} (hand-written frontend): throughput ratio {ratio:.3f}"
    write_result(result, args.out, lambda r, p: plot_server_comparison(r, p, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
