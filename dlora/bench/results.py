"""A benchmark's result files: the JSON (with its provenance, `provenance.py`) next to its PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_result(
    result: dict,
    out: str | Path,
    plot: Callable[[dict, Path], object] | None = None,
    *,
    indent: int = 2,
    print_summary: bool = True,
) -> Path:
    """`result` as JSON at `out` (its folder made), `plot`'s PNG beside it, then its summary printed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=indent) + "\n")
    if plot is not None:
        plot(result, out.with_suffix(".png"))
    if print_summary:
        print(json.dumps(result.get("summary", {}), indent=2))
    return out
