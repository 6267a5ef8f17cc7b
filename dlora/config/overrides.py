"""A config with some of its keys replaced, as the CLI's flags give them ({"server.port": 9000})."""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from typing import Any

from dlora.config.checks import ConfigError
from dlora.config.tree import DloraConfig


def override(cfg: DloraConfig, dotted: dict[str, Any]) -> DloraConfig:
    """Apply overrides such as {"server.port": 9000}; None values are ignored. A section's new values
    are applied together, so a check that relates two of its keys (engine.max_cpu_loras >=
    engine.max_loras, server.enable_auto_tool_choice with server.tool_call_parser) sees both."""
    changes: dict[str, dict[str, Any]] = {}
    for key, value in dotted.items():
        if value is None:
            continue
        section, _, name = key.partition(".")
        sub = getattr(cfg, section, None)
        # A section is a dataclass instance; `adapters` (a tuple) and unknown names are not.
        if not dataclasses.is_dataclass(sub) or isinstance(sub, type) or name not in {f.name for f in fields(sub)}:
            raise ConfigError(f"unknown config key {key!r}")
        changes.setdefault(section, {})[name] = value
    for section, values in changes.items():
        try:
            replaced: dict[str, Any] = {section: dataclasses.replace(getattr(cfg, section), **values)}
            cfg = dataclasses.replace(cfg, **replaced)
        except TypeError as e:
            raise ConfigError(f"{section}: {e}") from None
    return cfg
