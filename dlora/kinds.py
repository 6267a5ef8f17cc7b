"""Whether a config value has the kind its frozen-dataclass field is annotated with.

Every config dataclass (dlora.config's sections, and dlora.scheduling's BatchingConfig that
dlora.config builds on) calls `kind_error` first in its `__post_init__`, so a value of the wrong
kind is named with its key before a range check such as `value >= 0` fails with Python's own
TypeError text, whether it came from YAML, a CLI override or a direct constructor. A leaf module
(no dlora imports) because dlora.scheduling cannot import dlora.config.
"""

from __future__ import annotations

import functools
import numbers
import types
import typing
from dataclasses import fields
from typing import Any

_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def is_int(value: Any) -> bool:
    """A whole number (numpy's too, for configs built in code), not a bool: YAML's `true` must
    not pass as 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A whole or real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _fits(value: Any, kind: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return is_int(value)
    if kind is float:
        return is_number(value)
    return isinstance(value, str)


@functools.cache
def _field_kinds(cls: type) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """field name -> (the plain kinds it accepts, whether None is allowed), for the fields with a
    plain kind; tuples and nested dataclasses are checked by their own code."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        kinds = tuple(k for k in options if k in _KINDS)
        if kinds:
            out[f.name] = (kinds, type(None) in options)
    return out


def kind_error(obj: Any, section: str) -> str | None:
    """The message for the first field of dataclass `obj` whose value has the wrong kind, e.g.
    "scheduling.switch_cost_s='abc': must be a number", or None if every field fits."""
    # mypy checks a class against functools.cache's Hashable through the instance __hash__;
    # classes are hashable.
    for name, (kinds, nullable) in _field_kinds(type(obj)).items():  # type: ignore[arg-type]
        value = getattr(obj, name)
        if (value is None and nullable) or any(_fits(value, k) for k in kinds):
            continue
        why = " or ".join(_KINDS[k] for k in kinds)
        return f"{section}.{name}={value!r}: must be {why}" + (" (or null)" if nullable else "")
    return None
