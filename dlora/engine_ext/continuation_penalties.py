"""Presence and frequency penalties count a moved request's tokens from every leg, not only its last.

vLLM counts the tokens a request generated (its output) for the presence and frequency penalties.
A request dlora moved continues on another engine as `prompt + generated`, so there the tokens of
its earlier legs are prompt tokens and would stop counting: a penalised token could come back as
if it had never been generated. The continuation carries how many of its prompt's last tokens were
generated (`SamplingParams.extra_args[GENERATED_BEFORE_KEY]`, the count its grammar replays too); this
vLLM logits processor adds their share before vLLM applies its own penalties over the tokens this
leg generates, so the two together equal vLLM's penalties over the whole output.

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

from dlora.replica.engine import GENERATED_BEFORE_KEY


def earlier_legs_tokens(params: SamplingParams) -> int:
    """How many of the prompt's last tokens this request generated on earlier legs."""
    return int((params.extra_args or {}).get(GENERATED_BEFORE_KEY, 0))


def correct_row(
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


class ContinuationPenalties(AdapterLogitsProcessor):
    """vLLM's per-request logits processor wrapper around `correct_row`, for the continuations of
    moved requests that have a presence or frequency penalty."""

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely

    def new_req_logits_processor(self, params: SamplingParams):
        replayed = earlier_legs_tokens(params)
        if replayed <= 0 or (params.presence_penalty == 0 and params.frequency_penalty == 0):
            return None
        return partial(
            correct_row, replayed, params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        )
