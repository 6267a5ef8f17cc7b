"""Chat-template rendering and tokenisation, off the event loop and bounded in time.

Both are CPU work on the request's own text: on the event loop a long prompt, or a chat template
that loops, would stall every other request and /health. They run in a small thread pool instead.
A request-supplied template (allowed only with server.trust_request_chat_template) is also stopped
inside its thread when its time is up, through a trace function that raises in the template's
own frames: a thread cannot be killed, and an abandoned one would spin for as long as the template
loops, holding a pool worker.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from dlora.server.errors import APIError

T = TypeVar("T")

_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dlora-template")
# A Rust tokenizer mutates its truncation/padding state while encoding: two threads encoding with
# the same tokenizer at once fail with "Already borrowed".
_ENCODE_LOCK = threading.Lock()


class TemplateTimeout(Exception):
    """Raised inside a rendering thread whose deadline passed."""


class _Deadline:
    """A `sys.settrace` function that ends the traced thread's Python code after a deadline."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds

    def __call__(self, frame, event, arg):
        if time.monotonic() > self.at:
            raise TemplateTimeout()
        return self  # also trace the frame's lines: a template's loops run inside one frame


def _bounded(fn: Callable[[], T], seconds: float) -> T:
    previous = sys.gettrace()
    sys.settrace(_Deadline(seconds))
    try:
        return fn()
    finally:
        sys.settrace(previous)


async def _off_loop(fn: Callable[[], T], timeout_s: float | None, what: str, param: str) -> T:
    future = asyncio.get_running_loop().run_in_executor(_POOL, fn)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except (TimeoutError, TemplateTimeout):
        # The thread's result, if it ever comes, is dropped with the future.
        raise APIError(400, f"{what} took longer than {timeout_s:g} s", param) from None


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    with _ENCODE_LOCK:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


async def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Completion prompts: unbounded in time (linear in the body, which max_body_bytes caps), but
    off the event loop."""
    return await _off_loop(lambda: [encode(tokenizer, t, True) for t in texts], None, "tokenization", "prompt")


def _render(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    template: str | None,
    timeout_s: float,
) -> list[int]:
    def render() -> str:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
            **({"chat_template": template} if template else {}),
        )

    try:
        # Only a request's own template is traced: the model's is the operator's, and tracing slows
        # rendering several times over.
        text = _bounded(render, timeout_s) if template else render()
    except TemplateTimeout:
        raise
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    except Exception as e:  # jinja errors from a template that rejects the conversation
        raise APIError(400, f"chat template failed: {type(e).__name__}: {e}", "messages") from None
    return encode(tokenizer, text, add_special_tokens=False)


async def chat_prompt(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    template: str | None,
    timeout_s: float,
) -> list[int]:
    """The conversation rendered by the chat template and tokenised, within `timeout_s` seconds."""
    kwargs = dict(kwargs)
    kwargs.pop("chat_template", None)
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
    return await _off_loop(
        lambda: _render(tokenizer, messages, add_generation_prompt, kwargs, template, timeout_s),
        timeout_s,
        "chat template rendering",
        "chat_template" if template else "messages",
    )
