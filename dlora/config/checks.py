"""How the config tree refuses a bad value: a ConfigError that names the key and the value."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dlora.kinds import kind_error


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the bad value."""


def check(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: {why}")


def as_config_error(run: Callable[[], Any]) -> None:
    """Run a check written outside the config tree (it raises ValueError naming the key) so that its
    failure is a ConfigError like every other bad value."""
    try:
        run()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_kinds(obj: Any, section: str) -> None:
    """First in every section's __post_init__: a value of the wrong kind (YAML, override or
    constructor) is named before a range check meets it (dlora/kinds.py)."""
    why = kind_error(obj, section)
    if why:
        raise ConfigError(why)
