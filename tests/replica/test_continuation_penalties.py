"""A moved request's presence and frequency penalties, held to vLLM's own penalty code over the whole
output: the leg that continues on `prompt + earlier tokens` (dlora's correction, then vLLM's
penalties over what this leg generates) must give the logits an unmoved request would get."""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.sampling_params import SamplingParams

from dlora.engine_ext.continuation_penalties import ContinuationPenalties, correct_row
from dlora.replica.engine import GENERATED_BEFORE_KEY

VOCAB = 40
PROMPT = [1, 2, 3, 4]
EARLIER = [5, 6, 5, 7, 2, 9]  # generated on the legs before the move: 2 is in the prompt too
NOW = [6, 8, 5, 5]  # generated on this leg: 6 and 5 again, 8 new


def vllm_penalties(logits, prompt, output, presence, frequency, repetition) -> torch.Tensor:
    """vLLM's own penalties on one row (its padding value for token lists is the vocab size)."""

    def one(values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([values], dtype=dtype)

    row = logits.clone()[None]
    ids = [one(prompt, torch.long), one(output, torch.long)]
    return apply_penalties(row, *ids, one(presence), one(frequency), one(repetition))[0]


@pytest.mark.parametrize(
    "presence, frequency, repetition",
    [(0.5, 0.0, 1.0), (0.0, 1.5, 1.0), (1.0, -0.7, 1.0), (0.8, 1.2, 1.3), (-0.3, 0.4, 0.7), (2.0, 2.0, 2.0)],
)
def test_a_moved_leg_gets_the_logits_of_the_unmoved_request(presence, frequency, repetition):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(7)) * 6
    want = vllm_penalties(logits, PROMPT, EARLIER + NOW, presence, frequency, repetition)
    moved_prompt = PROMPT + EARLIER
    corrected = correct_row(len(EARLIER), presence, frequency, repetition, moved_prompt, NOW, logits.clone())
    got = vllm_penalties(corrected, moved_prompt, NOW, presence, frequency, repetition)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncorrected = vllm_penalties(logits, moved_prompt, NOW, presence, frequency, repetition)
    assert not torch.allclose(uncorrected, want, atol=1e-3)  # the case does need the correction


def test_only_continuations_with_a_presence_or_frequency_penalty_get_the_processor():
    lp = ContinuationPenalties.__new__(ContinuationPenalties)  # its constructor only sets up batch state
    moved = {GENERATED_BEFORE_KEY: 3}
    assert lp.new_req_logits_processor(SamplingParams(frequency_penalty=1.0, extra_args=moved)) is not None
    assert lp.new_req_logits_processor(SamplingParams(presence_penalty=0.5, extra_args=moved)) is not None
    assert lp.new_req_logits_processor(SamplingParams(repetition_penalty=1.5, extra_args=moved)) is None
    assert lp.new_req_logits_processor(SamplingParams(frequency_penalty=1.0)) is None
    assert not lp.is_argmax_invariant()
