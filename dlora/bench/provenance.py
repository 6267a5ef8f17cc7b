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


def machine() -> dict:
    """CPU model, core count and Python version of this machine."""
    cpu = platform.processor()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


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
