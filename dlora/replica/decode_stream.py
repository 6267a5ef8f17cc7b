"""A decode stream whose prompt may end in the middle of a character.

Runs in a replica's process: vLLM's output processor (host side of AsyncLLM) detokenizes there,
with `tokenizers.decoders.DecodeStream(ids=prompt)`, which vLLM looks up on the module so that a
replacement is honoured.

tokenizers' stream decodes the prompt on its first step to learn which text is already out. When
that text ends in an incomplete UTF-8 sequence (a byte-level token that is half of a character),
it keeps no prefix at all, and its first output is the whole prompt's text followed by the new
token's. A moved request meets this whenever the move falls right after such a token: its
continuation's prompt ends with the token, and the client received the prompt's text again in
the middle of its answer. Here the stream is primed with the prompt up to its last complete
character and then fed the remaining prompt tokens, which produce no text; their bytes come out
with the first generated token that completes them, as they do in an unmoved run.
"""

from __future__ import annotations

import tokenizers.decoders

INCOMPLETE = "\ufffd"  # what decoding gives for a UTF-8 sequence cut short
# Whether a text ends in an unfinished character depends on its last few bytes only, so the check
# decodes this many tokens before the cut instead of the whole prompt.
TAIL_TOKENS = 8

_base = tokenizers.decoders.DecodeStream  # the stream being wrapped (see install)


class PromptSafeDecodeStream:
    """`tokenizers.decoders.DecodeStream`'s interface (constructor and `step`), primed safely."""

    def __init__(self, ids: list[int] | None = None, skip_special_tokens: bool = False):
        self._prompt = list(ids or ())
        self._skip_special_tokens = skip_special_tokens
        self._stream = None if self._prompt else _base(skip_special_tokens=skip_special_tokens)

    def step(self, tokenizer, token_id: int) -> str | None:
        if self._stream is None:  # the tokenizer comes with the first step, not the constructor
            self._stream = self._primed(tokenizer)
        return self._stream.step(tokenizer, token_id)

    def _primed(self, tokenizer):
        cut = complete_prefix_len(tokenizer, self._prompt, self._skip_special_tokens)
        stream = _base(ids=self._prompt[:cut] or None, skip_special_tokens=self._skip_special_tokens)
        for token_id in self._prompt[cut:]:
            stream.step(tokenizer, token_id)  # text still incomplete: nothing comes out
        return stream


def complete_prefix_len(tokenizer, ids: list[int], skip_special_tokens: bool) -> int:
    """The length of the longest prefix of `ids` whose text does not end in an unfinished
    character: the tokens after it are what an unmoved stream still holds back. (A prompt whose
    text really ends in U+FFFD has that character echoed once, not its whole text.)"""
    cut = len(ids)
    while cut > 0:
        tail = tokenizer.decode(ids[max(0, cut - TAIL_TOKENS) : cut], skip_special_tokens=skip_special_tokens)
        if not tail.endswith(INCOMPLETE):
            break
        cut -= 1
    return cut


def install() -> None:
    """Make vLLM's detokenizer use the safe stream in this process (idempotent). It wraps whatever
    stream the module holds then, so a backend's stream installed before it keeps working."""
    global _base
    if tokenizers.decoders.DecodeStream is not PromptSafeDecodeStream:
        _base = tokenizers.decoders.DecodeStream
        tokenizers.decoders.DecodeStream = PromptSafeDecodeStream  # type: ignore[misc, assignment]
