"""A moved request's presence and frequency penalties and bad words, held to vLLM's own penalty and
bad-word code over the whole output: the leg that continues on `prompt + earlier tokens` (dlora's
correction, then vLLM's over what this leg generates) must give the logits an unmoved request would
get."""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.utils import apply_penalties
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.ops.bad_words import apply_bad_words

from dlora.engine_ext.continuation_logits import ContinuationLogits, block_bad_words, penalise_earlier
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
    corrected = penalise_earlier(len(EARLIER), presence, frequency, repetition, moved_prompt, NOW, logits.clone())
    got = vllm_penalties(corrected, moved_prompt, NOW, presence, frequency, repetition)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    uncorrected = vllm_penalties(logits, moved_prompt, NOW, presence, frequency, repetition)
    assert not torch.allclose(uncorrected, want, atol=1e-3)  # the case does need the correction


# Bad words (token ids) begun on the earlier legs and finished, or not, on this one.
BAD_WORDS = [[7, 2, 9, 6], [9, 6, 8, 11], [2, 9, 12], [6, 8, 5, 13], [5, 14], [3, 4, 5, 15], [30]]


@pytest.mark.parametrize("now", [[], [6], [6, 8], [6, 8, 5], NOW], ids=lambda now: f"{len(now)}-now")
def test_a_moved_leg_blocks_the_bad_words_the_unmoved_request_would(now):
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    want = logits.clone()
    apply_bad_words(want[None], {0: BAD_WORDS}, [EARLIER + now])
    moved_prompt = PROMPT + EARLIER
    got = block_bad_words(len(EARLIER), [w for w in BAD_WORDS if len(w) > 1], moved_prompt, now, logits.clone())
    apply_bad_words(got[None], {0: BAD_WORDS}, [now])
    assert torch.equal(got, want)


@pytest.mark.parametrize("now", [[], [6, 8]])
def test_the_bad_word_cases_need_the_correction(now):
    """Cases above where a word is blocked only because of the earlier legs' tokens."""
    whole, leg = torch.zeros(VOCAB), torch.zeros(VOCAB)
    apply_bad_words(whole[None], {0: BAD_WORDS}, [EARLIER + now])
    apply_bad_words(leg[None], {0: BAD_WORDS}, [now])
    assert not torch.equal(whole, leg)


def test_only_continuations_with_a_penalty_or_a_bad_word_of_several_tokens_get_the_processor():
    lp = ContinuationLogits.__new__(ContinuationLogits)  # its constructor only sets up batch state
    moved = {GENERATED_BEFORE_KEY: 3}

    def with_words(*words: list[int], **kwargs) -> SamplingParams:
        params = SamplingParams(**kwargs)
        params._bad_words_token_ids = list(words)  # what vLLM's input processing sets from `bad_words`
        return params

    assert lp.new_req_logits_processor(SamplingParams(frequency_penalty=1.0, extra_args=moved)) is not None
    assert lp.new_req_logits_processor(SamplingParams(presence_penalty=0.5, extra_args=moved)) is not None
    assert lp.new_req_logits_processor(with_words([4, 5], extra_args=moved)) is not None
    assert lp.new_req_logits_processor(with_words([4], extra_args=moved)) is None  # vLLM blocks it anywhere
    assert lp.new_req_logits_processor(SamplingParams(repetition_penalty=1.5, extra_args=moved)) is None
    assert lp.new_req_logits_processor(SamplingParams(frequency_penalty=1.0)) is None
    assert lp.new_req_logits_processor(with_words([4, 5])) is None
    assert not lp.is_argmax_invariant()
