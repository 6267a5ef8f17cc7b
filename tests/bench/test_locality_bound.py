"""The perfect-locality estimate: a fitted prefill cost, and each turn's TTFT less the history it
would have found cached on the replica that ran its previous turn."""

from __future__ import annotations

import pytest

from dlora.bench.locality_bound import locality_bound, prefill_fit, with_perfect_locality


def turn(conv: str, k: int, prompt: int, cached: int | None, ttft: float, status: str = "completed") -> dict:
    return {
        "conversation_id": conv,
        "turn": k,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_s": ttft if status == "completed" else None,
        "status": status,
    }


def on_the_line(conv: str, k: int, prompt: int, cached: int | None) -> dict:
    """A turn whose TTFT is 0.2 s plus 1 ms per computed prompt token."""
    return turn(conv, k, prompt, cached, 0.2 + 0.001 * (prompt - (cached or 0)))


def test_the_fit_recovers_the_seconds_per_computed_token():
    turns = [on_the_line("c", 1, 300, None), on_the_line("c", 2, 450, 256), on_the_line("d", 1, 700, 640)]
    intercept, slope = prefill_fit(turns + [turn("d", 2, 800, None, 0.0, status="failed")])
    assert intercept == pytest.approx(0.2) and slope == pytest.approx(0.001)


def test_a_fit_needs_two_lengths():
    with pytest.raises(ValueError):
        prefill_fit([on_the_line("c", 1, 300, 0), on_the_line("d", 1, 300, 0)])


def test_a_later_turn_finds_its_previous_turns_full_blocks():
    turns = [
        turn("c", 1, 300, None, 0.5),  # turn 1: nothing before it, unchanged
        turn("c", 2, 450, None, 0.7),  # missed: 300 // 128 full blocks = 256 tokens more found
        turn("c", 3, 600, 384, 0.3),  # found all of turn 2's 3 full blocks already: unchanged
        turn("d", 2, 200, 0, 0.4),  # its turn 1 never completed or was not recorded: unchanged
        turn("e", 2, 129, 0, 0.4),  # all but the last token of its prompt was turn 1's
        turn("e", 1, 256, None, 0.9),
    ]
    assert with_perfect_locality(turns, 0.001, 128) == pytest.approx([0.5, 0.7 - 0.256, 0.3, 0.4, 0.4 - 0.128, 0.9])


def test_the_bound_is_each_runs_p50_measured_and_with_perfect_locality():
    run = [on_the_line(f"c{i}", 1, 300, None) for i in range(3)]  # 0.5 s each
    run += [on_the_line("c0", 2, 400, 256)]  # found turn 1's blocks: 0.344 s
    run += [on_the_line(f"c{i}", 2, 400, 0) for i in (1, 2)]  # missed them: 0.6 s, 0.344 s had they not
    bound = locality_bound([run, run, run], 128)
    assert bound["intercept_s"] == pytest.approx(0.2) and bound["s_per_computed_token"] == pytest.approx(0.001)
    assert bound["ttft_p50_s"] == pytest.approx(0.5)  # of 0.344, 0.5 x3, 0.6 x2
    assert bound["ttft_p50_perfect_locality_s"] == pytest.approx((0.344 + 0.5) / 2)  # of 0.344 x3, 0.5 x3
