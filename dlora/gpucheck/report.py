"""The gpu-check report: one JSON file, its schema, and the summary printed at the end."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = "dlora.gpu_check/1"
TOP_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "date": str,
    "git_commit": (str, type(None)),
    "command": str,
    "machine": dict,
    "checks": list,
    "ok": bool,
}
CHECK_KEYS: dict[str, type | tuple[type, ...]] = {"name": str, "ok": bool, "seconds": (int, float), "details": dict}


@dataclass
class Check:
    name: str
    ok: bool
    seconds: float
    details: dict = field(default_factory=dict)


@dataclass
class Report:
    date: str
    git_commit: str | None
    command: str
    machine: dict
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "date": self.date,
            "git_commit": self.git_commit,
            "command": self.command,
            "machine": self.machine,
            "checks": [asdict(c) for c in self.checks],
            "ok": self.ok,
        }


def validate(data: dict) -> list[str]:
    """What is wrong with a report's JSON (empty if nothing)."""
    errors = [f"{k}: missing or not {_names(t)}" for k, t in TOP_KEYS.items() if not isinstance(data.get(k), t)]
    if data.get("schema") not in (None, SCHEMA) and isinstance(data.get("schema"), str):
        errors.append(f"schema: {data['schema']!r} is not {SCHEMA!r}")
    for i, check in enumerate(data.get("checks") or []):
        if not isinstance(check, dict):
            errors.append(f"checks[{i}]: not an object")
            continue
        errors += [
            f"checks[{i}].{k}: missing or not {_names(t)}"
            for k, t in CHECK_KEYS.items()
            if not isinstance(check.get(k), t)
        ]
    if isinstance(data.get("checks"), list) and isinstance(data.get("ok"), bool):
        all_ok = bool(data["checks"]) and all(isinstance(c, dict) and c.get("ok") is True for c in data["checks"])
        if data["ok"] != all_ok:
            errors.append("ok: must be true exactly when there are checks and all passed")
    return errors


def write(report: Report, path: str | os.PathLike) -> Path:
    """Write atomically (a crash never leaves half a report where the last one was)."""
    data = report.to_json()
    errors = validate(data)
    if errors:
        raise ValueError(f"invalid gpu-check report: {'; '.join(errors)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def summary(report: Report) -> str:
    """One line per check, then the verdict."""
    gpus = ", ".join(g["name"] for g in report.machine.get("gpus", [])) or "no GPU"
    lines = [f"gpu-check on {gpus} (driver {report.machine.get('driver')}), commit {report.git_commit}"]
    for c in report.checks:
        lines.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.name}  ({c.seconds:.1f} s){_headline(c)}")
    lines.append("ALL PASSED" if report.ok else "FAILED")
    return "\n".join(lines)


def _headline(c: Check) -> str:
    text = c.details.get("headline") or c.details.get("error")
    return f": {text}" if text else ""


def _names(t) -> str:
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join("null" if x is type(None) else x.__name__ for x in types)
