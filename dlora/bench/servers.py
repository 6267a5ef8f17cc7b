"""Shared pieces of the benchmark scripts (bench/<name>/run.py): random adapters for a base model,
server processes, /metrics samples and result files."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from dlora.models.projections import QKVO


def make_random_adapters(
    base: Path,
    out: Path,
    n: int,
    rank: int,
    scales: list[float] | None = None,
    target_modules: tuple[str, ...] = QKVO,
) -> list[Path]:
    """n random rank-r PEFT adapters on `target_modules` for the base model (deterministic, cached).

    `scales[i]` is adapter i's lora_alpha / r (default 2 for all: strong enough to garble the
    model, which then rarely emits EOS; smaller scales keep it answering and stopping).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    scales = scales or [2.0] * n
    # q/k/v/o adapters keep their directory names; other module sets get their own
    modules = "" if tuple(target_modules) == QKVO else "-" + "-".join(m.removesuffix("_proj") for m in target_modules)
    paths = [
        out / (f"r{rank}{modules}-{i}" if sc == 2.0 else f"r{rank}{modules}-s{sc:g}-{i}") for i, sc in enumerate(scales)
    ]
    for i, p in enumerate(paths):
        if (p / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(100 + i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        # lora_alpha may be fractional (scales below 1 / rank); peft annotates it int but uses it as a float
        cfg = LoraConfig(
            r=rank,
            lora_alpha=scales[i] * rank,  # type: ignore[arg-type]
            target_modules=list(target_modules),
            init_lora_weights=False,
        )
        get_peft_model(model, cfg).save_pretrained(str(p))
    return paths


REPO_ROOT = Path(__file__).resolve().parents[2]


def shipped_config(section: str) -> dict:
    """A section of configs/default.yaml: what users get."""
    return yaml.safe_load((REPO_ROOT / "configs" / "default.yaml").read_text()).get(section) or {}


def metric_total(text: str, name: str) -> float:
    """A Prometheus sample from /metrics text, summed over its label sets (0 when absent)."""
    return sum(metric_by_label(text, name, None).values())


def metric_by_label(text: str, name: str, label: str | None) -> dict[str, float]:
    """A Prometheus sample from /metrics text, summed per value of one label (None: one "" key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        key = ""
        if label is not None:
            m = re.search(rf'[{{,]{label}="([^"]*)"', line)
            key = m.group(1) if m else ""
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def start(cmd: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    print(f"$ {shlex.join(cmd)}", flush=True)
    return subprocess.Popen(
        cmd,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(extra_env or {})},
    )


def start_dlora(cfg: dict, workdir: Path, name: str) -> subprocess.Popen:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start([sys.executable, "-m", "dlora.cli", "serve", "--config", str(path)], workdir / f"{name}.log")


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout}s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def alternate_runs(urls: dict[str, str], requests, reps: int, run_once, warmup: int) -> dict[str, list[dict]]:
    """Warm every server, then run the workload on each `reps` times, alternating the order so
    every server sees the same background load on average."""
    names = list(urls)
    for name in names:  # first-shape oneDNN primitive builds, adapter loads
        run_once(urls[name], requests[:warmup])
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            m = run_once(urls[name], requests)
            m["loadavg_1m"] = os.getloadavg()[0]
            runs[name].append(m)
            print(
                f"rep {rep} {name:6s}: {m['output_throughput']:.1f} tok/s, TTFT p50 {m['median_ttft_ms']:.0f} ms,"
                f" TPOT p50 {m['median_tpot_ms']:.1f} ms (load {m['loadavg_1m']:.1f})",
                flush=True,
            )
    return runs


def write_result(result: dict, out: str | Path, plot) -> None:
    """JSON next to its PNG; prints the summary."""
    import json

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result.get("summary", {}), indent=2))
