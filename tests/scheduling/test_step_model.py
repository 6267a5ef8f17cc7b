"""The merge planner's step-time model: per weight state, t = fixed + per_prompt_token·P + per_seq·S."""

from __future__ import annotations

import pytest

from dlora.cost.line import StepLine
from dlora.scheduling.step_model import FIXED_SHARE, StepTimeModel, decode_prior
from dlora.scheduling.types import Mode

U, M = Mode.UNMERGED, Mode.MERGED
TRUE_U = StepLine(0.04, 0.002, 0.003)


def close(line: StepLine, want: StepLine, rel: float = 1e-3) -> None:
    assert (line.fixed_s, line.per_prefill_token_s, line.per_seq_s) == pytest.approx(
        (want.fixed_s, want.per_prefill_token_s, want.per_seq_s), rel=rel, abs=1e-9
    )


def feed(model: StepTimeModel, mode: Mode, line: StepLine, steps: list[tuple[int, int]]) -> None:
    for prefill, seqs in steps:
        model.observe(mode, prefill, seqs, line.seconds(prefill, seqs))


def test_varied_steps_recover_the_line_exactly():
    # Prefill chunks of two sizes and decode steps of three batch sizes pin all three coefficients.
    m = StepTimeModel(0.5)
    feed(m, U, TRUE_U, [(2048, 4), (1024, 12), (0, 16), (0, 32), (0, 8)] * 4)
    close(m.line(U), TRUE_U)


def test_one_decode_batch_size_splits_its_step_half_fixed():
    # 40 decode steps of 32 sequences at 0.2 s cannot say how much of 0.2 s is fixed: the prior
    # splits it FIXED_SHARE / rest, which the data (fixed + 32·per_seq = 0.2) leaves as it is.
    m = StepTimeModel(0.5)
    feed(m, U, StepLine(0.05, 0.0, 0.15 / 32), [(0, 32)] * 40)
    line = m.line(U)
    assert FIXED_SHARE == 0.5
    assert line.fixed_s == pytest.approx(0.1, rel=1e-3)
    assert line.per_seq_s == pytest.approx(0.1 / 32, rel=1e-3)
    assert line.seconds(0, 32) == pytest.approx(0.2, rel=1e-4)  # the data are still met


def test_the_merged_decode_shape_splits_the_unmerged_step():
    # Merged decode steps of 8 and 32 sequences show fixed 0.02 + 0.001 per sequence (0.052 at 32:
    # 0.02 / 0.052 of it fixed). Unmerged decode steps ran 32 sequences only, at 0.2 s: they are
    # split in the same proportion, 0.2 * 0.02 / 0.052 = 0.0769 fixed.
    m = StepTimeModel(0.5)
    feed(m, U, StepLine(0.0, 0.0, 0.2 / 32), [(0, 32)] * 20)
    feed(m, M, StepLine(0.02, 0.0, 0.001), [(0, 8), (0, 32)] * 40)
    line = m.line(U)
    assert line.fixed_s == pytest.approx(0.2 * 0.02 / 0.052, rel=1e-3)
    assert line.per_seq_s == pytest.approx(0.2 * 0.032 / 0.052 / 32, rel=1e-3)
    merged = m.line(M)
    assert (merged.fixed_s, merged.per_seq_s) == pytest.approx((0.02, 0.001), rel=2e-2)


def test_merged_is_priced_from_unmerged_until_measured_fixed_cost_included():
    m = StepTimeModel(0.5)
    assert m.line(U) is None and m.line(M) is None  # nothing measured: the planner waits
    feed(m, U, TRUE_U, [(2048, 4), (1024, 12)])
    # prefills alone say nothing of a step's fixed cost: still no line to price a slice with
    assert m.line(U) is None and m.line(M) is None
    feed(m, U, TRUE_U, [(0, 16), (0, 32), (0, 8)] + [(2048, 4), (1024, 12), (0, 16), (0, 32), (0, 8)] * 3)
    # no merged step yet: half the unmerged costs, the fixed one too (a merged step runs the same
    # base model: with no fixed cost, merging adapters one after another would look free)
    close(m.line(M), StepLine(0.02, 0.001, 0.0015))
    assert m.shape_known()  # the unmerged decode steps ran 8, 16 and 32 sequences
    merged_truth = StepLine(0.03, 0.0009, 0.0005)
    feed(m, M, merged_truth, [(2048, 4), (1024, 12), (0, 16), (0, 32), (0, 8)] * 20)
    close(m.line(M), merged_truth, rel=5e-2)  # measured: the prior (half a step's weight) hardly shows


def test_shape_known_needs_decode_steps_of_different_sizes():
    m = StepTimeModel(0.5)
    feed(m, U, TRUE_U, [(0, 32)] * 10)
    assert not m.shape_known()
    feed(m, U, TRUE_U, [(0, 16)])
    assert m.shape_known()


def test_decode_prior_goes_through_the_mean_step():
    assert decode_prior(None, None) == StepLine(0.0, 0.0, 0.0)
    assert decode_prior((32.0, 0.2), None) == StepLine(0.1, 0.0, 0.1 / 32)
    # shape (fixed 0.02, 0.001/seq) -> 0.052 at 32 seqs, scaled to 0.2
    p = decode_prior((32.0, 0.2), (0.02, 0.001))
    assert p.fixed_s == pytest.approx(0.2 * 0.02 / 0.052) and p.seconds(0, 32) == pytest.approx(0.2)


def test_long_prefill_steps_do_not_drown_decode_steps():
    # Relative errors: a 20 s prefill step and a 0.2 s decode step weigh alike, so the decode step's
    # time is met within 1% even with the prefill steps alone able to fit any fixed cost.
    m = StepTimeModel(0.5)
    truth = StepLine(0.047, 0.0066, 0.0047)
    feed(m, U, truth, [(4096, 4), (3072, 8), (3072, 16), (0, 32), (0, 30), (0, 28)] * 3)
    assert m.line(U).seconds(0, 32) == pytest.approx(truth.seconds(0, 32), rel=1e-2)
    assert m.line(U).seconds(4096, 4) == pytest.approx(truth.seconds(4096, 4), rel=1e-2)
