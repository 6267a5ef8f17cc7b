"""What vLLM reads from a request's output also covers the tokens a moved request generated before.

vLLM's presence and frequency penalties count the tokens a request generated (its output), and a
bad word of several tokens is blocked when the output ends in all of it but its last token. A
request dlora moved continues on another engine as `prompt + generated`, so there the tokens of its
earlier legs are prompt tokens: a penalised token could come back as if it had never been
generated, and a bad word begun before the move could be finished after it. The continuation
carries how many of its prompt's last tokens were generated
(`SamplingParams.extra_args[GENERATED_BEFORE_KEY]`, the count its grammar replays too); this vLLM
logits processor applies their share before vLLM applies its own penalties and bad words over the
tokens this leg generates, so that the two together equal vLLM's over the whole output.

vLLM applies its repetition penalty after this processor, to every token of the prompt and output
(the earlier legs' tokens included, so that penalty needs no correction). It scales a logit x to
x / r when x > 0 and x * r otherwise, which would also scale a delta added before it; for the
tokens it touches the corrected logit is therefore written as `rep⁻¹(rep(x) + delta)`, which that
penalty maps to exactly `rep(x) + delta`.

Runs in the model runner (worker) process: vLLM builds it from the class path in the engine's
`logits_processors` (set in `dlora/replica/engine.py`).
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from dlora.replica.engine_keys import GENERATED_BEFORE_KEY


def earlier_legs_tokens(params: SamplingParams) -> int:
    """How many of the prompt's last tokens this request generated on earlier legs."""
    return int((params.extra_args or {}).get(GENERATED_BEFORE_KEY, 0))


def penalise_earlier(
    replayed: int,
    presence: float,
    frequency: float,
    repetition: float,
    prompt_ids: list[int],
    output_ids: list[int],
    logits: torch.Tensor,
) -> torch.Tensor:
    """One request's logits row, shifted by the earlier legs' tokens' share of the penalties:
    `-frequency * count` for each such token, and `-presence` for those this leg has not generated
    (vLLM's own penalty charges presence for those it has)."""
    earlier = Counter(prompt_ids[-replayed:])
    ids = torch.tensor(list(earlier), dtype=torch.long, device=logits.device)
    counts = torch.tensor(list(earlier.values()), dtype=logits.dtype, device=logits.device)
    again = set(output_ids)
    not_again = torch.tensor([t not in again for t in earlier], dtype=logits.dtype, device=logits.device)
    delta = -frequency * counts - presence * not_again
    x = logits[ids]
    if repetition != 1.0:
        penalised = torch.where(x > 0, x / repetition, x * repetition) + delta
        logits[ids] = torch.where(penalised > 0, penalised * repetition, penalised / repetition)
    else:
        logits[ids] = x + delta
    return logits


def block_bad_words(
    replayed: int, words: list[list[int]], prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor
) -> torch.Tensor:
    """Block the last token of each bad word whose other tokens end the request's whole output
    (the earlier legs' tokens, then this leg's), as vLLM does over an unmoved request's output."""
    for word in words:
        prefix = len(word) - 1
        if prefix == 0 or prefix > replayed + len(output_ids):
            continue  # one token: vLLM blocks it always; longer than the output: never
        tail = output_ids[-prefix:] if len(output_ids) >= prefix else None
        if tail is None:  # the prefix starts before this leg
            tail = prompt_ids[len(prompt_ids) - (prefix - len(output_ids)) :] + output_ids
        if tail == word[:-1]:
            logits[word[-1]] = float("-inf")
    return logits


def correct_row(
    replayed: int,
    presence: float,
    frequency: float,
    repetition: float,
    words: list[list[int]],
    prompt_ids: list[int],
    output_ids: list[int],
    logits: torch.Tensor,
) -> torch.Tensor:
    """Both corrections on one request's logits row."""
    if presence or frequency:
        logits = penalise_earlier(replayed, presence, frequency, repetition, prompt_ids, output_ids, logits)
    if words:
        logits = block_bad_words(replayed, words, prompt_ids, output_ids, logits)
    return logits


class ContinuationLogits(AdapterLogitsProcessor):
    """vLLM's per-request logits processor wrapper around `correct_row`, for the continuations of
    moved requests that have a presence or frequency penalty or a bad word of several tokens."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    def new_req_logits_processor(self, params: SamplingParams):
        replayed = earlier_legs_tokens(params)
        words = [list(w) for w in (params.bad_words_token_ids or []) if len(w) > 1]
        if replayed <= 0 or (params.presence_penalty == 0 and params.frequency_penalty == 0 and not words):
            return None
        p, f, r = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        return partial(correct_row, replayed, p, f, r, words)
