"""docs/configuration.md and docs/metrics.md against the code they document.

The configuration reference must list every field of the config dataclasses (dlora/config/, and
the batching policy's `BatchingConfig` that the `scheduling:` section extends) with its type and
default, and nothing else; the metrics reference must list every metric dlora/server/metrics.py
exports, and nothing else. A key or metric added without docs fails here.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest
import yaml

from dlora.config import DloraConfig
from dlora.scheduling import BatchingConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
REQUIRED = "required"  # default cell of a field without a default


# ---- docs/configuration.md ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocRow:
    key: str  # dotted: "model.path", "adapters[].name", or a top-level key such as "adapters"
    type: str
    default: str
    meaning: str


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def doc_rows(text: str) -> list[DocRow]:
    """Rows of every table whose header is `key | type | default | meaning`."""
    rows, in_table = [], False
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        cells = _cells(line)
        if [c.lower() for c in cells] == ["key", "type", "default", "meaning"]:
            in_table = True
        elif in_table and not set("".join(cells)) <= set("-: "):
            assert len(cells) == 4, f"configuration.md row without 4 cells: {line}"
            rows.append(DocRow(cells[0].strip("`"), *cells[1:]))
    return rows


def _section_classes() -> dict[str, type]:
    """Section name -> dataclass: each dataclass field of DloraConfig, and `name[]` for a list of them."""
    hints = typing.get_type_hints(DloraConfig)
    out = {}
    for f in dataclasses.fields(DloraConfig):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out[f.name] = hint
        elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            out[f"{f.name}[]"] = typing.get_args(hint)[0]
    return out


def code_fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Dotted key -> (the dataclass, its field) for every config key a YAML file may set."""
    out: dict[str, tuple[type, dataclasses.Field]] = {}
    sections = _section_classes()
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            out[f"{section}.{f.name}"] = (cls, f)
    for f in dataclasses.fields(DloraConfig):
        if f.name not in sections:  # a top-level list such as `adapters`
            out[f.name] = (DloraConfig, f)
    return out


_NAMES = {int: "int", float: "float", str: "str", bool: "bool", type(None): "null"}


def type_name(hint: typing.Any) -> str:
    """How configuration.md writes a field's type: `int`, `float or null`, `list of str`, `list of mapping`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(type_name(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {type_name(typing.get_args(hint)[0])}"
    if dataclasses.is_dataclass(hint):
        return "mapping"
    return _NAMES[hint]


def documented_default(cell: str) -> typing.Any:
    """The YAML value in the cell's first backticks (`null`, `[]`, `0.05`, `auto:x`), or REQUIRED."""
    if cell == REQUIRED:
        return REQUIRED
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"default cell {cell!r} must start with a YAML value in backticks (or say {REQUIRED!r})"
    value = yaml.safe_load(m.group(1))
    return tuple(value) if isinstance(value, list) else value


def code_default(f: dataclasses.Field) -> typing.Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return REQUIRED


@pytest.fixture(scope="module")
def rows() -> dict[str, DocRow]:
    found = doc_rows((DOCS / "configuration.md").read_text())
    keys = [r.key for r in found]
    assert len(keys) == len(set(keys)), f"keys documented twice: {sorted(k for k in keys if keys.count(k) > 1)}"
    return {r.key: r for r in found}


def test_every_config_key_is_documented_and_nothing_else(rows):
    assert set(rows) == set(code_fields()), (
        f"missing from docs/configuration.md: {sorted(set(code_fields()) - set(rows))}; "
        f"documented but not in dlora/config/: {sorted(set(rows) - set(code_fields()))}"
    )


def test_scheduling_section_covers_the_batching_config(rows):
    for f in dataclasses.fields(BatchingConfig):
        assert f"scheduling.{f.name}" in rows


def test_documented_types_match_the_dataclasses(rows):
    for key, (cls, f) in code_fields().items():
        hint = typing.get_type_hints(cls)[f.name]
        assert rows[key].type.strip("`") == type_name(hint), f"{key}: documented type {rows[key].type!r}"


def test_documented_defaults_match_the_dataclasses(rows):
    for key, (_, f) in code_fields().items():
        if f.default_factory is not dataclasses.MISSING:
            continue  # a factory's value is not a literal; the key is still documented (test above)
        assert documented_default(rows[key].default) == code_default(f), (
            f"{key}: documented default {rows[key].default!r}, dataclass default {code_default(f)!r}"
        )


def test_every_row_says_what_the_key_means(rows):
    assert all(r.meaning for r in rows.values())


# ---- docs/metrics.md -------------------------------------------------------------------------------


def exported_metric_families() -> set[str]:
    """Family names (counters without `_total`) of everything /metrics can render."""
    from dlora.server.metrics import Metrics

    return {family.name for family in Metrics().registry.collect()}


def documented_metrics() -> set[str]:
    names = set()
    for line in (DOCS / "metrics.md").read_text().splitlines():
        m = re.match(r"\|\s*`(dlora_\w+)`", line)
        if m:
            names.add(m.group(1).removesuffix("_total"))
    return names


def test_every_metric_is_documented_and_nothing_else():
    exported, documented = exported_metric_families(), documented_metrics()
    assert documented == exported, (
        f"missing from docs/metrics.md: {sorted(exported - documented)}; "
        f"documented but not exported: {sorted(documented - exported)}"
    )


# ---- docs/autoscaling.md ---------------------------------------------------------------------------


def test_the_autoscale_settings_table_lists_every_autoscale_field_with_its_default():
    from dlora.config import AutoscaleConfig

    text = (DOCS / "autoscaling.md").read_text()
    table = text.replace("| setting |", "| key |", 1)  # the settings table, read like the reference's
    rows = {r.key: r for r in doc_rows(table)}
    fields = {f.name: f for f in dataclasses.fields(AutoscaleConfig)}
    assert set(rows) == set(fields)
    hints = typing.get_type_hints(AutoscaleConfig)
    for name, f in fields.items():
        assert rows[name].type == type_name(hints[name]), name
        assert documented_default(rows[name].default) == f.default, name
