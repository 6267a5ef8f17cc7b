"""How far perfect prefix locality could lower a multi-turn run's TTFT, estimated from the run itself.

Each turn's record (`conversation_runner.TurnRecord` as a dict) says how many prompt tokens its
server found cached (`usage.prompt_tokens_details`, on with `--enable-prompt-tokens-details`). A
least-squares line through TTFT against the prompt tokens each turn computed (prompt less cached)
gives the seconds one computed prompt token adds to TTFT. With perfect locality, turn k >= 2 runs
where turn k-1 ran and finds every full KV block of turn k-1's prompt cached (its reply's blocks
too, in vLLM, but the reply re-encoded need not match, so they are not counted); turn 1 finds what
it found. Each turn's TTFT less the slope times the tokens it would then not compute is its TTFT
with perfect locality, the waits behind other requests unchanged: those would shrink too, as less
prefill work keeps the replicas less busy, so this is what locality saves directly, not a ceiling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dlora.bench.stats import percentile


def cached_tokens(turn: dict[str, Any]) -> int:
    """Prompt tokens the turn's replica found cached (a server that reports none found none)."""
    return int(turn.get("cached_tokens") or 0)


def computed_tokens(turn: dict[str, Any]) -> int:
    """Prompt tokens the turn's replica computed."""
    return int(turn["prompt_tokens"]) - cached_tokens(turn)


def completed(turns: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for t in turns if t["status"] == "completed" and t["ttft_s"] is not None and t["prompt_tokens"]]


def prefill_fit(turns: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """(seconds, seconds per computed prompt token): TTFT's least-squares line in computed tokens."""
    done = completed(turns)
    if len(done) < 2 or len({computed_tokens(t) for t in done}) < 2:
        raise ValueError("a fit needs at least two turns with different computed prompt lengths")
    slope, intercept = np.polyfit([computed_tokens(t) for t in done], [t["ttft_s"] for t in done], 1)
    return float(intercept), float(slope)


def with_perfect_locality(turns: Sequence[dict[str, Any]], slope_s: float, block_tokens: int) -> list[float]:
    """Each completed turn's TTFT had it found its previous turn's full prompt blocks cached."""
    prompts = {(t["conversation_id"], t["turn"]): t["prompt_tokens"] for t in turns if t["prompt_tokens"]}
    out = []
    for t in completed(turns):
        previous = prompts.get((t["conversation_id"], t["turn"] - 1), 0)
        held = min(previous // block_tokens * block_tokens, t["prompt_tokens"] - 1)
        more = max(0, held - cached_tokens(t))
        out.append(t["ttft_s"] - slope_s * more)
    return out


def locality_bound(runs: Sequence[Sequence[dict[str, Any]]], block_tokens: int) -> dict[str, float]:
    """Over each run's turns (one system's reps): the fitted line, and the median over runs of
    TTFT p50 as measured and with perfect locality."""
    intercept, slope = prefill_fit([t for turns in runs for t in turns])
    measured = [_p50([t["ttft_s"] for t in completed(turns)]) for turns in runs]
    local = [_p50(with_perfect_locality(turns, slope, block_tokens)) for turns in runs]
    return {
        "intercept_s": intercept,
        "s_per_computed_token": slope,
        "ttft_p50_s": float(np.median(measured)),
        "ttft_p50_perfect_locality_s": float(np.median(local)),
    }


def _p50(values: Sequence[float]) -> float:
    p50 = percentile(values, 50)
    if p50 is None:
        raise ValueError("a run without a completed turn")
    return p50
