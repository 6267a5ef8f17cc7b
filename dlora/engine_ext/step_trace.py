"""An opt-in per-step trace of a replica's batching (`DLORA_STEP_TRACE=<dir>`).

Runs inside vLLM's EngineCore process.

Why: whether merging paid off is decided step by step inside the engine, and /metrics only shows
totals. With the variable set, each replica's scheduler appends one JSON line per engine step to
`<dir>/steps-<pid>.jsonl`: wall time, weights before and after, requests unfinished / allowed /
scheduled per adapter, tokens, step and switch seconds, and the policy's thresholds and starving
adapters. Unset (the default) it costs nothing.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import IO


def adapter_counts(adapters: Iterable[str | None]) -> dict[str, int]:
    """Requests per adapter ("" = the base model), for a compact JSON line."""
    return dict(Counter("" if a is None else a for a in adapters))


class StepTrace:
    def __init__(self, directory: str | Path):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"steps-{os.getpid()}.jsonl"
        self._file: IO[str] = open(self.path, "a", buffering=1)  # one line per step, flushed

    def write(self, **fields) -> None:
        self._file.write(json.dumps(fields, separators=(",", ":")) + "\n")

    def write_step(self, at_schedule: dict, step_s: float, switch_s: float, tokens: int, before, weights, snap) -> None:
        """One step's line: `at_schedule` holds the request counts taken while it was scheduled
        (unfinished, allowed, scheduled), `snap` the policy's snapshot after it."""
        self.write(
            t=time.time(),
            step_s=round(step_s, 6),
            switch_s=round(switch_s, 6),
            before=before,
            weights=weights,
            unfinished=at_schedule["unfinished"],
            allowed=at_schedule["allowed"],
            scheduled=at_schedule["scheduled"],
            tokens=tokens,
            alpha=snap.alpha,
            beta=snap.beta,
            starving=sorted("" if a is None else a for a in snap.starving),
            planner=snap.planner,
        )

    def close(self) -> None:
        self._file.close()


def open_trace(directory: str | None) -> StepTrace | None:
    return StepTrace(directory) if directory else None
