"""OpenAI wire format for completion and chat results, whole or as SSE chunks."""

from __future__ import annotations

import json
import math

from dlora.replica.messages import Delta, TokenLogprob
from dlora.server.generation import ChoiceResult

# vLLM's OpenAI server floors logprobs at -9999.0: -inf (a token the sampler masked out) and NaN are
# not JSON, and a strict encoder fails on them.
LOGPROB_FLOOR = -9999.0


def logprob(value: float) -> float:
    if math.isnan(value):
        return LOGPROB_FLOOR
    if value == math.inf:  # no real logprob; keep the response valid JSON all the same
        return 0.0
    return max(value, LOGPROB_FLOOR)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(lps: list[TokenLogprob] | None, text_offset_start: int) -> dict | None:
    if lps is None:
        return None
    offsets, pos = [], text_offset_start
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [logprob(lp.logprob) for lp in lps],
        "top_logprobs": [{t: logprob(v) for _, v, t in lp.top} | {lp.token: logprob(lp.logprob)} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict | None:
    if lps is None:
        return None

    def entry(token: str, value: float) -> dict:
        return {"token": token, "logprob": logprob(value), "bytes": list(token.encode("utf-8"))}

    return {
        "content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for _, v, t in lp.top]} for lp in lps]
    }


def completion_choice(r: ChoiceResult, prefix: str, prompt_ids: list[int] | None) -> dict:
    choice = {
        "index": r.index,
        "text": prefix + r.text,
        "logprobs": completion_logprobs(r.logprobs, len(prefix)),
        "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason,
    }
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = r.token_ids
    return choice


def chat_choice(r: ChoiceResult, return_token_ids: bool) -> dict:
    choice = {
        "index": r.index,
        "message": {"role": "assistant", "content": r.text},
        "logprobs": chat_logprobs(r.logprobs),
        "finish_reason": r.finish_reason,
        "stop_reason": r.stop_reason,
    }
    if return_token_ids:
        choice["token_ids"] = r.token_ids
    return choice


def envelope(rid: str, obj: str, created: int, model: str, choices: list[dict]) -> dict:
    """The object around a response's choices (a whole response or one SSE chunk)."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def _finish(choice: dict, delta: Delta, token_ids: bool) -> dict:
    """A streamed choice's ending fields, set only on the delta that finishes it."""
    choice["finish_reason"] = delta.finish_reason if delta.finished else None
    choice["stop_reason"] = delta.stop_reason if delta.finished else None
    if token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


def completion_chunk_choice(index: int, delta: Delta, prefix: str, token_ids: bool) -> dict:
    """One streamed `text_completion` choice; `prefix` is the echoed prompt on a choice's first chunk."""
    choice = {"index": index, "text": prefix + delta.text, "logprobs": completion_logprobs(delta.logprobs, 0)}
    return _finish(choice, delta, token_ids)


def chat_chunk_choice(index: int, delta: Delta, token_ids: bool) -> dict:
    """One streamed `chat.completion.chunk` choice."""
    choice = {"index": index, "delta": {"content": delta.text}, "logprobs": chat_logprobs(delta.logprobs)}
    return _finish(choice, delta, token_ids)


def chat_role_choice(index: int) -> dict:
    """The first chunk of a streamed chat choice: the role, as OpenAI sends it before any content."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
