"""Linear fits of traced engine steps (`DLORA_STEP_TRACE` lines) per server and prompt length:

    step_s = fixed + per_seq x sequences + per_prefill_token x (tokens - sequences)

(a decoding sequence schedules one token, so tokens - sequences counts the prompt tokens of the
step, less one per prefilling sequence). The `unmerged` server's fit minus the `merged` server's
is what the LoRA term costs on this CPU, to check the simulator's rescaled step costs against.
Steps that switched weights are left out (their time is the switch's).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def trace_steps(directory: Path) -> list[dict]:
    lines = []
    for path in sorted(directory.glob("steps-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                lines.append(json.loads(line))
    return lines


def fit_steps(steps: list[dict]) -> dict | None:
    """Least squares of step seconds on (1, sequences, prompt tokens); None with too few steps."""
    rows = [s for s in steps if not s.get("switch_s") and sum(s["scheduled"].values()) > 0]
    if len(rows) < 8:
        return None
    seqs = np.array([sum(s["scheduled"].values()) for s in rows], dtype=float)
    prompt = np.array([s["tokens"] for s in rows], dtype=float) - seqs
    x = np.column_stack([np.ones_like(seqs), seqs, prompt])
    y = np.array([s["step_s"] for s in rows], dtype=float)
    if not prompt.any():  # decode steps only: the prompt coefficient is not identified
        x = x[:, :2]
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    fixed, per_seq = float(coef[0]), float(coef[1])
    per_prompt = float(coef[2]) if len(coef) > 2 else None
    return {"fixed_s": fixed, "per_seq_s": per_seq, "per_prefill_token_s": per_prompt, "steps": len(rows)}


def fit_traces(root: Path, points: list[dict], servers: tuple[str, ...]) -> dict:
    """Per server and prompt length, the fit of the steps traced while that server ran those cells
    (`points` carry each run's wall-clock window)."""
    out: dict[str, dict] = {}
    for server in servers:
        steps = trace_steps(root / server)
        for prompt_len in sorted({p["prompt_len"] for p in points}):
            windows = [p["wall"] for p in points if p["system"] == server and p["prompt_len"] == prompt_len]
            mine = [s for s in steps if any(t0 <= s["t"] <= t1 for t0, t1 in windows)]
            out.setdefault(server, {})[str(prompt_len)] = fit_steps(mine)
    return out
