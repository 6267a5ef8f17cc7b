"""Server processes of the benchmark scripts (bench/<name>/run.py), and random adapters for them to
serve: start, wait until healthy, stop."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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
    """SIGTERM, which uvicorn (dlora's server and vLLM's) handles like Ctrl-C, then SIGKILL to the
    process group after a minute. Why not SIGINT: a child inherits an ignored SIGINT (pytest-xdist's
    workers ignore it), and then only the SIGKILL a minute later stops it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def serving(
    procs: Mapping[str, subprocess.Popen],
    urls: Mapping[str, str],
    work: Path,
    timeout: float = 400,
    logs: Mapping[str, Path] | None = None,
) -> Iterator[None]:
    """Servers already started, healthy inside the block (waited for in order) and stopped after
    it, also when one fails to come up. Each logs to `logs[name]`, by default `work/<name>.log`."""
    try:
        for name, proc in procs.items():
            wait_healthy(urls[name], proc, logs[name] if logs else work / f"{name}.log", timeout)
        yield
    finally:
        for proc in procs.values():
            stop(proc)


@contextmanager
def dlora_server(cfg: dict, work: Path, name: str, timeout: float = 400) -> Iterator[str]:
    """A dlora server on `cfg` (its config and log in `work`), healthy inside the block; yields its URL."""
    url = f"http://127.0.0.1:{cfg['server']['port']}"
    with serving({name: start_dlora(cfg, work, name)}, {name: url}, work, timeout):
        yield url
