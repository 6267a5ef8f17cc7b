"""A request's values checked in the API process, before any engine sees them.

A value the engine refuses would otherwise fail inside a replica actor and come back as a 500 (or,
streamed, as a 200 followed by an error chunk). The sampling values go through the very
`vllm.SamplingParams` the replica builds (`dlora.replica.engine.to_sampling_params`), so vLLM's own
rules apply and are not re-typed here; what vLLM checks elsewhere (its OpenAI protocol models and
`SamplingParams.verify`, which needs the engine's model config) is repeated below.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

from vllm.exceptions import VLLMValidationError

from dlora.config import ServerConfig
from dlora.replica.engine import to_sampling_params
from dlora.replica.messages import SamplingSpec
from dlora.server.errors import APIError
from dlora.server.protocol import INT64_MAX, INT64_MIN

# Lone UTF-16 surrogates are valid in JSON ("\ud800") but not in UTF-8: the tokenizer and the JSON
# encoder of the response both fail on them.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN_IDS = 8  # out-of-vocabulary ids quoted in a message (a list may be huge)
# The engine applies penalties as float32 tensors: a larger (finite) float64 becomes inf there, and
# inf times a zero logit is NaN. repetition_penalty is the one sampling float vLLM bounds only below.
FLOAT32_MAX = 3.4028234663852886e38

# apply_chat_template's own arguments: a request setting them through chat_template_kwargs would
# change what the call returns (token ids instead of text, tensors, a dict), not what the template sees.
# (`chat_template` there vLLM refuses too; the field for a request's own template is `chat_template`.)
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tokenize",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
    }
)


def _leaves(value: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every dict key and leaf value of a JSON value, with its path (iteratively: a body may nest
    as deep as the JSON parser allows, beyond Python's recursion limit)."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                yield path, k  # keys reach the template too
                stack.append((path + (str(k),), item))
        elif isinstance(v, list):
            stack.extend((path + (str(i),), item) for i, item in enumerate(v))
        else:
            yield path, v


def _param(path: tuple[str, ...]) -> str | None:
    return ".".join(path) or None


def check_values(body: Any) -> None:
    """Every string valid Unicode, every float finite, every integer within int64 (what the engine's
    MessagePack transport and torch carry), anywhere in a parsed JSON body."""
    for path, value in _leaves(body):
        param = _param(path)
        if isinstance(value, str):
            if _SURROGATE.search(value):
                # The value itself is not quoted: it cannot be encoded in the response either.
                raise APIError(
                    400, f"{param}: text contains a lone UTF-16 surrogate, which is not valid Unicode", param
                )
        elif isinstance(value, bool):
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise APIError(400, f"{param}: must be a finite number, got {value}", param)
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                raise APIError(400, f"{param}: must lie in [-2**63, 2**63 - 1]", param)


def check_priority(body: dict, header: str | None, server: ServerConfig) -> None:
    """A client's priority (the body's `priority`, or vLLM's X-Vllm-Priority header, which wins) only
    where the operator allows it. vLLM refuses a non-zero priority when its scheduling policy is not
    `priority`; dlora's engines always run that policy, so the operator decides."""
    priority = body.get("priority", 0)
    if header is not None:
        try:
            priority = int(header)
        except ValueError:
            pass  # vLLM ignores a header it cannot read
        else:
            if not INT64_MIN <= priority <= INT64_MAX:
                raise APIError(400, "X-Vllm-Priority: must lie in [-2**63, 2**63 - 1]", "priority")
    if priority not in (0, None) and not server.allow_client_priority:
        raise APIError(400, "Priority scheduling is not enabled.", "priority")


def check_template_kwargs(body: dict) -> None:
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, dict):
        return  # vLLM's request model refuses a non-object
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs: `{reserved[0]}` cannot be set by a request",
            f"chat_template_kwargs.{reserved[0]}",
        )


def check_body(body: Any, priority_header: str | None, server: ServerConfig) -> None:
    """dlora's rules for an inference request's parsed JSON body, before vLLM's serving reads it:
    values every layer below can carry, and what the operator allows clients to ask for. A body that
    is not an object is left to vLLM's request model to refuse."""
    check_values(body)
    if isinstance(body, dict):
        check_priority(body, priority_header, server)
        check_template_kwargs(body)


def check_seed(seed: int) -> None:
    """A seed the engines carry (int64). n > 1 gives sample i the seed `seed + i`, which can step
    past int64 when `seed` did not."""
    if not INT64_MIN <= seed <= INT64_MAX:
        raise APIError(400, "seed: seed + n - 1 must lie in [-2**63, 2**63 - 1]", "seed")


def check_sampling(spec: SamplingSpec, vocab_size: int) -> None:
    """One engine request's sampling values, by vLLM's rules; 400 naming the field otherwise."""
    if spec.seed is not None:
        check_seed(spec.seed)
    bad = [t for t in spec.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"token_id(s) {bad[:_SHOWN_IDS]}{' ...' if len(bad) > _SHOWN_IDS else ''} in "
            f"stop_token_ids contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
            "stop_token_ids",
        )
    try:
        to_sampling_params(spec)
    except VLLMValidationError as e:
        message = str(e.args[0]) if e.args else "invalid sampling parameters"
        raise APIError(400, message, e.parameter or _field_named_in(message)) from None
    except (ValueError, TypeError, OverflowError) as e:
        message = str(e) or "invalid sampling parameters"
        raise APIError(400, message, _field_named_in(message)) from None
    if spec.repetition_penalty > FLOAT32_MAX:
        raise APIError(
            400,
            f"repetition_penalty must be at most {FLOAT32_MAX:g}, got {spec.repetition_penalty:g}",
            "repetition_penalty",
        )


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingSpec))


def _field_named_in(message: str) -> str | None:
    """vLLM's messages start with the field's name ("min_tokens must be ...", "stop cannot ...")."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None
