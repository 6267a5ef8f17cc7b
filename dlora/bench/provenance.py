"""What every committed benchmark result records about how it was made: when, from which commit, on
which machine, by which exact command, so a number can be traced and re-run."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

# Flag in /proc/cpuinfo -> the name a result records. CPU step costs (einsum LoRA, bf16 matmuls)
# differ by these more than by clock, so two results are comparable only on the same set.
CPU_EXTENSIONS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "amx_tile": "AMX",
    "amx_bf16": "AMX-BF16",
}


def parse_cpuinfo(text: str) -> tuple[str | None, set[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo text; (None, empty) where absent."""
    model: str | None = None
    flags: set[str] | None = None
    for ln in text.splitlines():
        key, sep, value = ln.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return model, flags or set()


def cpu_extensions(flags: set[str]) -> list[str]:
    """The vector/matrix extensions among `flags` that change CPU kernel speed, by name, sorted."""
    return sorted(name for flag, name in CPU_EXTENSIONS.items() if flag in flags)


def machine() -> dict:
    """CPU model and its vector/matrix extensions, core count and Python version of this machine.

    Never raises: without /proc/cpuinfo (not Linux) the model is platform.processor() and the
    extensions are an empty list, i.e. unknown."""
    model: str | None = None
    flags: set[str] = set()
    try:
        model, flags = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        pass
    cpu = model or platform.processor()
    # "cpu" stays beside "cpu_model": results committed earlier carry only "cpu", so both can be compared.
    return {
        "cpu": cpu,
        "cpu_model": cpu,
        "cpu_extensions": cpu_extensions(flags),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def git_commit(repo: Path | None = None) -> str:
    """The checked-out commit, with "+dirty" when the work tree has uncommitted changes."""
    cwd = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def provenance(module: str, argv: list[str] | None = None) -> dict:
    """date (UTC), git_commit, machine and the exact command of `python -m module argv...`."""
    args = sys.argv[1:] if argv is None else argv
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": machine(),
        "command": shlex.join([".venv/bin/python", "-m", module, *args]),
    }
