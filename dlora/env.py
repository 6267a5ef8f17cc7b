"""Every environment variable dlora reads, in one typed place.

Modules call `env.NAME.get()`; nothing else in the package reads `os.environ` for its own
settings. (vLLM's own variables are *set* for replica processes by
`dlora.replica.ray_replica.replica_runtime_env`.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is invalid: {e}") from None


def _bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0/true/false/yes/no/on/off")


def _opt_str(raw: str) -> str | None:
    return raw


DLORA_CACHE_DIR = EnvVar(
    "DLORA_CACHE_DIR",
    str(Path.home() / ".cache" / "dlora"),
    str,
    "where converted models and generated test models are kept",
)
DLORA_ADMIN_TOKEN: EnvVar[str | None] = EnvVar(
    "DLORA_ADMIN_TOKEN",
    None,
    _opt_str,
    "bearer token for the admin API (overrides server.admin_token)",
)
DLORA_API_KEY: EnvVar[str | None] = EnvVar(
    "DLORA_API_KEY",
    None,
    _opt_str,
    "bearer token clients must send on the inference routes (overrides server.api_key)",
)
DLORA_RAY_TEMP_DIR: EnvVar[str | None] = EnvVar(
    "DLORA_RAY_TEMP_DIR",
    None,
    _opt_str,
    "Ray's temporary and log directory (default: Ray's own)",
)
DLORA_TEST_KEEP_LOGS = EnvVar(
    "DLORA_TEST_KEEP_LOGS",
    False,
    _bool,
    "tests print server logs even when they pass",
)

LORA_BACKENDS = ("vllm", "triton", "einsum")


def _lora_backend(raw: str) -> str:
    if raw not in LORA_BACKENDS:
        raise ValueError(f"expected one of {', '.join(LORA_BACKENDS)}")
    return raw


DLORA_LORA_BACKEND = EnvVar(
    "DLORA_LORA_BACKEND",
    "vllm",
    _lora_backend,
    "LoRA backend of a replica's engine; set from engine.lora_backend by the replica's runtime env",
)


def _amount(unit: str) -> Callable[[str], float]:
    """A parser of a non-negative number of `unit`s (GiB, MiB)."""

    def parse(raw: str) -> float:
        value = float(raw)
        if not value >= 0:
            raise ValueError(f"expected a number of {unit} >= 0")
        return value

    return parse


DLORA_MERGED_CACHE_MIB = EnvVar(
    "DLORA_MERGED_CACHE_MIB",
    1024.0,
    _amount("MiB"),
    "MiB of merged weights a replica's worker keeps for re-merging; set from engine.merged_cache_mib "
    "by the replica's runtime env",
)

DLORA_STEP_TRACE: EnvVar[str | None] = EnvVar(
    "DLORA_STEP_TRACE",
    None,
    _opt_str,
    "directory: each replica's scheduler appends one JSON line per engine step (mode, batch, times)",
)


DLORA_PRISTINE_DEVICE_GIB = EnvVar(
    "DLORA_PRISTINE_DEVICE_GIB",
    1.0,
    _amount("GiB"),
    "GPU memory (GiB) per replica for the copies of base weight rows an in-place merge overwrites; "
    "rows beyond it are kept in pinned host memory (dlora/engine_ext/pristine_rows.py)",
)

ALL = [
    DLORA_CACHE_DIR,
    DLORA_ADMIN_TOKEN,
    DLORA_API_KEY,
    DLORA_RAY_TEMP_DIR,
    DLORA_TEST_KEEP_LOGS,
    DLORA_LORA_BACKEND,
    DLORA_MERGED_CACHE_MIB,
    DLORA_STEP_TRACE,
    DLORA_PRISTINE_DEVICE_GIB,
]


def cache_dir() -> Path:
    return Path(os.path.expanduser(DLORA_CACHE_DIR.get()))
