"""The detokenizer's stream when a prompt ends in the middle of a character (tiny model's
byte-level tokenizer, no engine).

A moved request's continuation has the prompt plus the tokens generated so far as its prompt; when
the move falls inside a multi-byte character, that prompt ends in half of it. The text the client
gets across the move must be what one unmoved stream gives."""

from __future__ import annotations

import random

import pytest
import tokenizers.decoders
from transformers import AutoTokenizer

from dlora.replica import decode_stream
from dlora.replica.decode_stream import PromptSafeDecodeStream


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model.base))


def streamed(tok, prompt: list[int], outputs: list[int]) -> str:
    stream = PromptSafeDecodeStream(ids=prompt, skip_special_tokens=True)
    return "".join(stream.step(tok._tokenizer, t) or "" for t in outputs)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_move_inside_a_character_gives_the_unmoved_text(tok):
    prompt = tok("x = '")["input_ids"]
    outputs = ids(tok, "中文 ok é")  # 中, 文 and é are each split over byte-level tokens
    # Oracle: the full decode, less the prompt's text.
    whole = tok.decode(prompt + outputs, skip_special_tokens=True)
    expected = whole[len(tok.decode(prompt, skip_special_tokens=True)) :]
    assert streamed(tok, prompt, outputs) == expected == "中文 ok é"
    for k in range(len(outputs) + 1):
        before, after = outputs[:k], outputs[k:]
        assert streamed(tok, prompt, before) + streamed(tok, prompt + before, after) == expected, k


def test_a_prompt_ending_in_half_a_character_never_echoes_the_prompt(tok):
    prompt = tok("x = '")["input_ids"] + ids(tok, "中")[:2]
    outputs = ids(tok, "中")[2:] + ids(tok, " ok")
    # tokenizers' own stream gives "x = '中 ok" here: the prompt's text again.
    assert streamed(tok, prompt, outputs) == "中 ok"


def test_moves_at_every_token_of_random_output_keep_the_text(tok):
    byte_tokens = [i for i in range(len(tok)) if tok.decode([i]).endswith(decode_stream.INCOMPLETE)]
    assert byte_tokens  # the case needs byte-level tokens that are half a character
    rng = random.Random(0)
    for _ in range(20):
        prompt = tok("def f():")["input_ids"]
        outputs = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(len(tok)) for _ in range(24)]
        undisturbed = streamed(tok, prompt, outputs)
        for k in range(len(outputs) + 1):
            moved = streamed(tok, prompt, outputs[:k]) + streamed(tok, prompt + outputs[:k], outputs[k:])
            assert moved == undisturbed, (outputs, k)


def test_a_prompt_whose_text_ends_in_the_replacement_character_echoes_only_that(tok):
    prompt = tok("a\ufffd")["input_ids"]  # U+FFFD itself, as three byte-level tokens
    assert streamed(tok, prompt, ids(tok, " ok")) == "\ufffd ok"


def test_install_replaces_the_stream_vllm_looks_up_once(monkeypatch):
    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", tokenizers.decoders.DecodeStream)
    monkeypatch.setattr(decode_stream, "_base", decode_stream._base)
    decode_stream.install()
    decode_stream.install()
    assert tokenizers.decoders.DecodeStream is PromptSafeDecodeStream
    assert decode_stream._base is not PromptSafeDecodeStream  # wrapped once, never itself
