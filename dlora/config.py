"""Frozen configuration dataclasses, filled from YAML and overridden by CLI flags.

One tree: `DloraConfig` holds `ModelConfig`, `EngineConfig`, `ServerConfig`, `ClusterConfig`,
`SchedulingConfig` and the adapters registered at start. Relative paths in a YAML file are
resolved against the directory of that file, so `dlora serve --config X` works from anywhere.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from dlora import env

DEFAULT_MODEL = "auto:smollm2-135m-instruct"
DTYPES = ("bfloat16", "float16", "float32", "auto")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the bad value."""


def _check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


@dataclass(frozen=True)
class ModelConfig:
    # A directory in Hugging Face layout, or "auto:<name>" for a model dlora prepares itself.
    path: str = DEFAULT_MODEL
    # The name clients put in `model` for the base model; defaults to the directory name.
    served_name: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, "model.dtype", self.dtype, f"must be one of {DTYPES}")
        _check(self.max_model_len > 0, "model.max_model_len", self.max_model_len, "must be > 0")


@dataclass(frozen=True)
class EngineConfig:
    max_loras: int = 4  # adapters in one batch (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 16  # adapters kept in host memory, LRU beyond that
    kv_cache_space_gib: int = 1  # vLLM CPU reads whole GiB (VLLM_CPU_KVCACHE_SPACE)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    lora_backend: str = "vllm"
    enforce_eager: bool = True

    def __post_init__(self) -> None:
        _check(self.max_loras >= 1, "engine.max_loras", self.max_loras, "must be >= 1")
        _check(
            self.max_lora_rank in (1, 8, 16, 32, 64, 128, 256, 320, 512),
            "engine.max_lora_rank", self.max_lora_rank,
            "vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320 or 512",
        )
        _check(
            self.max_cpu_loras >= self.max_loras, "engine.max_cpu_loras", self.max_cpu_loras,
            f"must be >= engine.max_loras ({self.max_loras})",
        )
        _check(
            isinstance(self.kv_cache_space_gib, int) and self.kv_cache_space_gib > 0,
            "engine.kv_cache_space_gib", self.kv_cache_space_gib, "must be a whole number of GiB > 0",
        )
        _check(self.max_num_seqs >= 1, "engine.max_num_seqs", self.max_num_seqs, "must be >= 1")
        _check(
            self.lora_backend in ("vllm", "triton", "einsum"), "engine.lora_backend", self.lora_backend,
            "must be one of vllm, triton, einsum",
        )


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer token for the admin endpoints; None means they are open (DLORA_ADMIN_TOKEN overrides).
    admin_token: str | None = None
    # Adapter paths given to the admin API must resolve under one of these directories.
    adapter_roots: tuple[str, ...] = ()
    # Where the adapter registry is persisted so registrations survive a restart.
    state_dir: str = "~/.cache/dlora/state"
    log_level: str = "info"

    def __post_init__(self) -> None:
        _check(0 <= self.port < 65536, "server.port", self.port, "must be a TCP port (0-65535)")


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 1
    # Join an existing Ray cluster at this address; None starts a local one bound to 127.0.0.1.
    ray_address: str | None = None
    # CPU cores to pin replicas to, one per replica (CPU only); empty means 0, 1, ... in order.
    cpu_cores: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(self.num_replicas >= 1, "cluster.num_replicas", self.num_replicas, "must be >= 1")


@dataclass(frozen=True)
class SchedulingConfig:
    policy: str = "unmerged"


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    pinned: bool = False


@dataclass(frozen=True)
class DloraConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    adapters: tuple[AdapterSpec, ...] = ()

    @property
    def state_dir(self) -> Path:
        return Path(os.path.expanduser(self.server.state_dir))

    @property
    def admin_token(self) -> str | None:
        return env.DLORA_ADMIN_TOKEN.get() or self.server.admin_token


_SECTIONS = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "server": ServerConfig,
    "cluster": ClusterConfig,
    "scheduling": SchedulingConfig,
}


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(data).__name__}")
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{section}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{section}: {e}") from None


def _resolve(path: str, base: Path) -> str:
    if path.startswith("auto:"):
        return path
    p = Path(os.path.expanduser(path))
    return str(p if p.is_absolute() else (base / p).resolve())


def from_dict(data: dict[str, Any], base_dir: Path | None = None) -> DloraConfig:
    """Build a config from a parsed YAML mapping; relative paths resolve against `base_dir`."""
    data = dict(data or {})
    base = base_dir or Path.cwd()
    unknown = sorted(set(data) - set(_SECTIONS) - {"adapters"})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: {sorted([*_SECTIONS, 'adapters'])}")
    sections = {name: _build(cls, data.get(name) or {}, name) for name, cls in _SECTIONS.items()}
    model = sections["model"]
    if not model.path.startswith("auto:"):
        sections["model"] = dataclasses.replace(model, path=_resolve(model.path, base))
    server = sections["server"]
    sections["server"] = dataclasses.replace(
        server, adapter_roots=tuple(_resolve(r, base) for r in server.adapter_roots)
    )
    adapters = []
    for i, a in enumerate(data.get("adapters") or []):
        spec = _build(AdapterSpec, a, f"adapters[{i}]")
        adapters.append(dataclasses.replace(spec, path=_resolve(spec.path, base)))
    return DloraConfig(**sections, adapters=tuple(adapters))


def load(path: str | os.PathLike | None) -> DloraConfig:
    """Load a YAML config file (None gives the built-in defaults)."""
    if path is None:
        return DloraConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    return from_dict(data, p.resolve().parent)


def override(cfg: DloraConfig, dotted: dict[str, Any]) -> DloraConfig:
    """Apply overrides such as {"server.port": 9000}; None values are ignored."""
    for key, value in dotted.items():
        if value is None:
            continue
        section, _, name = key.partition(".")
        sub = getattr(cfg, section, None)
        if sub is None or not dataclasses.is_dataclass(sub) or name not in {f.name for f in fields(sub)}:
            raise ConfigError(f"unknown config key {key!r}")
        try:
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(sub, **{name: value})})
        except TypeError as e:
            raise ConfigError(f"{key}={value!r}: {e}") from None
    return cfg
