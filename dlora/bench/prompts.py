"""Prompt text of a requested length in tokens, and token counts of existing text.

Without a tokenizer a prompt is a random sequence of common lower-case English words. Each of
them is a single token after a space in byte-level BPE (GPT-2, Llama 3, SmolLM2) and SentencePiece
(Llama 2) vocabularies, so n words ≈ n tokens (checked exactly on SmolLM2's tokenizer); the server
adds its BOS and, on /v1/chat/completions, the chat template's tokens. With a tokenizer the text is
trimmed or extended until it encodes to exactly n tokens (up to decode/re-encode merges).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be or has had "
    "not but first one their its new after who they have her she two been other when there all during "
    "into school time may years more most only over city some world would where later up such used many "
    "can state about national out known university united then made"
).split()

_PIECE = re.compile(r"[\u3000-\u9fff\uac00-\ud7af]|\w+|[^\w\s]")
# ShareGPT text measured with SmolLM2's tokenizer: 0.86 word/punctuation pieces per token
# (p10-p90 over conversations 0.76-1.00), steadier than 4.0 characters per token (3.2-5.3).
PIECES_PER_TOKEN = 0.86


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory or repo id (transformers AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def count_tokens(text: str, tokenizer: Any | None = None) -> int:
    """Tokens in `text`: exact with a tokenizer, else estimated from word/punctuation pieces."""
    if tokenizer is not None:
        return len(tokenizer(text, add_special_tokens=False).input_ids)
    return max(1, round(len(_PIECE.findall(text)) / PIECES_PER_TOKEN))


def count_tokens_many(texts: list[str], tokenizer: Any | None = None, batch: int = 512) -> list[int]:
    """`count_tokens` of each text; batched through the tokenizer (much faster for fast tokenizers)."""
    if tokenizer is None:
        return [count_tokens(t) for t in texts]
    counts: list[int] = []
    for i in range(0, len(texts), batch):
        counts += [len(ids) for ids in tokenizer(texts[i : i + batch], add_special_tokens=False).input_ids]
    return counts


def synth_prompt(num_tokens: int, rng: np.random.Generator, tokenizer: Any | None = None) -> str:
    """Random text of about `num_tokens` tokens (exactly, when a tokenizer is given)."""
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=num_tokens)]
    text = " ".join(words)
    if tokenizer is None:
        return text
    for _ in range(4):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) == num_tokens:
            break
        if len(ids) > num_tokens:
            text = tokenizer.decode(ids[:num_tokens])
        else:
            extra = rng.integers(0, len(WORDS), size=num_tokens - len(ids))
            text = text + " " + " ".join(WORDS[i] for i in extra)
    return text
