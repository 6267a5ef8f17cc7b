"""Length profiles (documented means), the vLLM filter, the length scale, and prompt synthesis."""

from __future__ import annotations

import numpy as np
import pytest

from dlora.bench.lengths import PROFILES, accept_mask, sample_lengths, scale_lengths
from dlora.bench.prompts import WORDS, count_tokens, synth_prompt


@pytest.mark.parametrize("name", ["chat", "code", "uniform"])
def test_profile_means(name):
    # 20,000 log-normal draws with σ = 0.8: the sample mean's standard error is 0.7 %; 5 % tolerance.
    # (Rejecting lengths < 4 removes well under 1 % of these profiles' mass.)
    p = PROFILES[name]
    lin, lout = sample_lengths(name, 20_000, np.random.default_rng(21))
    assert lin.mean() == pytest.approx(p.mean_input, rel=0.05)
    assert lout.mean() == pytest.approx(p.mean_output, rel=0.05)


def test_summarization_profile_mean():
    lin, lout = sample_lengths("summarization", 20_000, np.random.default_rng(22))
    assert lin.mean() == pytest.approx(13186.8, rel=0.05)
    assert lout.mean() == pytest.approx(21.1, rel=0.06)  # a little mass below 4 is rejected


def test_sharegpt_like_matches_muxserve_after_vllm_filter():
    # μ = 4.69 / 5.46, σ = 1, then vLLM's ShareGPT filter -> means ≈ 161 / 338 (seed-digest §6.2).
    lin, lout = sample_lengths("sharegpt-like", 20_000, np.random.default_rng(23))
    assert lin.mean() == pytest.approx(161, rel=0.05)
    assert lout.mean() == pytest.approx(338, rel=0.05)
    assert lin.max() <= 1024 and (lin + lout).max() <= 2048 and min(lin.min(), lout.min()) >= 4


def test_accept_mask():
    lin = np.array([3, 4, 1025, 1000, 100])
    lout = np.array([10, 4, 10, 1049, 1948])
    assert accept_mask(lin, lout, vllm_filter=True).tolist() == [False, True, False, False, True]
    assert accept_mask(lin, lout, vllm_filter=False).tolist() == [False, True, True, True, True]


def test_scale_lengths_keeps_proportion_and_caps():
    lin, lout = scale_lengths(np.array([100, 600]), np.array([50, 400]), ratio=2.0, max_model_len=1000)
    assert lin.tolist()[0] == 200 and lout.tolist()[0] == 100
    # 1200 + 800 = 2000 > 1000: shrink by 1/2 -> 600 / 400, total exactly the cap
    assert lin[1] + lout[1] == 1000 and lout[1] == 400


def test_scale_lengths_can_keep_one_side():
    lin, lout = scale_lengths(np.array([900, 10]), np.array([300, 20]), max_model_len=1000, keep="output")
    assert lin.tolist() == [700, 10] and lout.tolist() == [300, 20]
    lin, lout = scale_lengths(np.array([900]), np.array([300]), max_model_len=1000, keep="input")
    assert lin.tolist() == [900] and lout.tolist() == [100]


def test_synth_prompt_has_requested_word_count():
    text = synth_prompt(37, np.random.default_rng(0))
    assert len(text.split()) == 37 and set(text.split()) <= set(WORDS)
    assert count_tokens(text) == pytest.approx(37 / 0.86, abs=1)


class _WordTokenizer:
    """Stands in for an HF tokenizer: one token per character pair, so text must be trimmed."""

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Enc([text[i : i + 2] for i in range(0, len(text), 2)])

    def decode(self, ids):
        return "".join(ids)


def test_synth_prompt_with_tokenizer_is_exact():
    tok = _WordTokenizer()
    text = synth_prompt(50, np.random.default_rng(1), tok)
    assert count_tokens(text, tok) == 50
