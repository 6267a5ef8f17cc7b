"""A config from a YAML file or a parsed mapping: each section built and checked, unknown keys
named, and relative paths resolved against the directory of the file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from dlora.config.adapters import AdapterSpec
from dlora.config.batch import BatchConfig
from dlora.config.checks import ConfigError
from dlora.config.cluster import ClusterConfig
from dlora.config.engine import EngineConfig
from dlora.config.model import ModelConfig
from dlora.config.scheduling import SchedulingConfig
from dlora.config.server import ServerConfig
from dlora.config.slo import SloTargetsConfig
from dlora.config.tree import DloraConfig

_SECTIONS = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "server": ServerConfig,
    "cluster": ClusterConfig,
    "scheduling": SchedulingConfig,
    "slo": SloTargetsConfig,
    "batch": BatchConfig,
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


def _resolve_generation_config(value: str, base: Path) -> str:
    return value if value in ("auto", "vllm") else _resolve(value, base)


def _resolve_chat_template(value: str | None, base: Path) -> str | None:
    """A template file named relative to the config file; a template written inline (it holds `{`,
    `}` or a newline, vLLM's test) or a name that is no file there (one of vLLM's built-in
    templates, or a mistake check_before_start names) is kept as written."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    p = Path(os.path.expanduser(value))
    if p.is_absolute():
        return str(p)
    candidate = base / p
    return str(candidate.resolve()) if candidate.is_file() else value


def from_dict(data: dict[str, Any], base_dir: Path | None = None) -> DloraConfig:
    """Build a config from a parsed YAML mapping; relative paths resolve against `base_dir`."""
    data = dict(data or {})
    base = base_dir or Path.cwd()
    unknown = sorted(set(data) - set(_SECTIONS) - {"adapters"})
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {unknown}; known: {sorted([*_SECTIONS, 'adapters'])}")
    sections = {name: _build(cls, data.get(name) or {}, name) for name, cls in _SECTIONS.items()}
    model = sections["model"]
    sections["model"] = dataclasses.replace(
        model,
        path=_resolve(model.path, base),
        generation_config=_resolve_generation_config(model.generation_config, base),
    )
    server = sections["server"]
    sections["server"] = dataclasses.replace(
        server,
        adapter_roots=tuple(_resolve(r, base) for r in server.adapter_roots),
        chat_template=_resolve_chat_template(server.chat_template, base),
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
