"""Batch planning counts a bounded sample of prompts and estimates the rest, so a batch's prompts
are tokenized once (when they run), not twice."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from dlora.batch.prompt_sizes import PromptSizes


def test_only_the_sample_is_tokenized_and_the_rest_estimated_by_length():
    calls: list[str] = []

    def tokenize(text: str) -> int:
        calls.append(text)
        return len(text) // 2  # two characters a token

    sizes = PromptSizes(tokenize, sample=3)
    counted = [sizes.count(t) for t in ("ab", "abcd", "abcdef")]
    assert counted == [1, 2, 3]
    assert sizes.count("x" * 100) == 50 and sizes.count("x" * 7) == 4
    assert len(calls) == 3


def test_empty_texts_do_not_end_the_sample():
    sizes = PromptSizes(lambda text: len(text), sample=1)
    assert sizes.count("") == 0
    assert sizes.count("") == 0  # no characters measured yet: still counted
    assert sizes.count("abc") == 3
    assert sizes.count("abcdef") == 6  # estimated at the measured 1 token a character


def test_estimates_of_a_real_tokenizer_stay_close_over_a_batch(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model.base)
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven tenants ask their adapters questions".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 200))) for _ in range(600)]

    def exact(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    sizes = PromptSizes(exact)
    estimated = sum(sizes.count(t) for t in texts)
    assert sizes.counted == 256
    assert abs(estimated - sum(exact(t) for t in texts)) <= 0.05 * estimated
