"""Prompt sizes for planning a batch, without tokenizing every prompt before it runs.

The plan needs each line's prompt size only roughly (a step's prefill cost), and vLLM tokenizes
every prompt again when the line runs; counting them all up front would tokenize a batch twice,
which for a 50,000-line batch costs about as much as its prefill on a small model. So the first
`sample` texts are counted exactly and the rest estimated from their length, at the tokens per
character those samples measured. Deterministic: the same lines give the same sizes.
"""

from __future__ import annotations

from collections.abc import Callable

SAMPLE_TEXTS = 256  # counted exactly: enough to measure a corpus's tokens per character within a few %


class PromptSizes:
    """`count(text)`: a text's token count, exact for the first `sample` texts, estimated after."""

    def __init__(self, tokenize: Callable[[str], int], sample: int = SAMPLE_TEXTS) -> None:
        self.tokenize = tokenize
        self.sample = sample
        self.counted = 0  # texts tokenized
        self.tokens = 0  # their tokens
        self.chars = 0  # and their characters

    def count(self, text: str) -> int:
        if self.counted < self.sample or self.chars == 0:
            tokens = self.tokenize(text)
            self.counted += 1
            self.tokens += tokens
            self.chars += len(text)
            return tokens
        return round(len(text) * self.tokens / self.chars)
