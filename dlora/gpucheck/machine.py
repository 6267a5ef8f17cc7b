"""What a report ran on: the GPU, its driver, the software, the commit."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def gpu_count() -> int:
    """CUDA devices torch can use (0 without a GPU, a CUDA build, or a new enough driver)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install is "no GPU" here; the report says which
        return 0


def git_commit(repo: Path = REPO) -> str | None:
    out = _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    if out is None:
        return None
    dirty = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    return out + ("-dirty" if dirty else "")


def driver_version() -> str | None:
    out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return out.splitlines()[0].strip() if out else None


def machine_info() -> dict:
    import torch

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "driver": driver_version(),
        "gpus": [],
    }
    for package in ("vllm", "triton", "transformers", "peft"):
        info[package] = _version(package)
    for i in range(gpu_count()):
        p = torch.cuda.get_device_properties(i)
        info["gpus"].append(
            {
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
                "smem_per_block_optin": getattr(p, "shared_memory_per_block_optin", None),
            }
        )
    return info


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
