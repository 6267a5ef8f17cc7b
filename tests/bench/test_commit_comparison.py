"""The progress line a comparison prints after each run."""

from __future__ import annotations

from dlora.bench.commit_comparison import brief


def test_a_progress_line_rounds_numbers_and_counts_lists():
    m = {"tput": 10.74231, "completed": 32, "shared": {"ttft_p50_s": 1.0694, "turns": [{"turn": 1}] * 32}}
    assert brief(m) == "tput 10.7, completed 32, shared {ttft_p50_s 1.07, turns [32 items]}"
