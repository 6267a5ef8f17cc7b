"""Graceful drain: after SIGTERM/SIGINT the server refuses new work, lets what runs finish, then stops.

While draining, /health answers 503 (`"status": "draining"`) so a load balancer stops sending, and
new POST requests (inference and admin) get an OpenAI-shaped 503 with `Retry-After`. Requests in
flight, streams included, run on until they end or `server.drain_timeout_s` passes; then whatever
still runs is ended by the server: a stream gets one error event and `data: [DONE]` (so a client
can tell a cut-off from a finished stream), any other request a 503.

`DrainMiddleware` is a plain ASGI middleware, not a Starlette one, because it has to keep writing to
a response after the route that produced it was cancelled.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlora.server.errors import error_body
from dlora.waits import wait_event

_SSE = b"text/event-stream"


@dataclass
class Drain:
    timeout_s: float
    draining: bool = False
    deadline: float | None = None  # time.monotonic() at which running requests are ended
    inflight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)
    _expired: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def begin(self) -> None:
        self.draining = True
        self.deadline = time.monotonic() + self.timeout_s

    def expire(self) -> None:
        """End every request still running now (the deadline passed, or a second signal came)."""
        self._expired.set()

    @property
    def expired(self) -> bool:
        return self._expired.is_set()

    def retry_after_s(self) -> int:
        """Seconds until this server is gone (at least 1): a client retrying sooner finds it draining."""
        left = 0.0 if self.deadline is None else self.deadline - time.monotonic()
        return max(1, math.ceil(left))

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no request is in flight within `timeout_s`."""
        return await wait_event(self._idle, timeout_s)

    async def wait_expired(self) -> None:
        await self._expired.wait()

    def cut_off_message(self) -> str:
        return (
            f"the server is shutting down: the request did not finish within server.drain_timeout_s="
            f"{self.timeout_s:g}s and was ended"
        )


async def _send_json(send, status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


class _ResponseProgress:
    """How far the wrapped app got with its response, so the drain can end it properly."""

    def __init__(self, send):
        self._send = send
        self.started = self.finished = self.sse = False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.sse = any(k.lower() == b"content-type" and v.startswith(_SSE) for k, v in message.get("headers", ()))
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def cut_off(self, message: str) -> None:
        if self.finished:
            return
        if not self.started:
            await _send_json(self._send, 503, error_body(503, message))
        elif self.sse:
            events = f"data: {json.dumps(error_body(503, message))}\n\ndata: [DONE]\n\n".encode()
            await self._send({"type": "http.response.body", "body": events, "more_body": False})
        else:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        self.finished = True


class DrainMiddleware:
    def __init__(self, app, drain: Drain):
        self.app = app
        self.drain = drain

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["method"] == "POST":
            await self._refuse(send)
            return
        self.drain.enter()
        try:
            await self._run(scope, receive, send)
        finally:
            self.drain.leave()

    async def _refuse(self, send) -> None:
        body = error_body(
            503, "the server is shutting down and accepts no new requests; retry on another instance or after a restart"
        )
        # Connection: close, so a keep-alive client's next request goes to a fresh connection elsewhere.
        await _send_json(
            send, 503, body, [(b"retry-after", str(self.drain.retry_after_s()).encode()), (b"connection", b"close")]
        )

    async def _run(self, scope, receive, send) -> None:
        progress = _ResponseProgress(send)
        task = asyncio.ensure_future(self.app(scope, receive, progress.send))
        expired = asyncio.ensure_future(self.drain.wait_expired())
        try:
            await asyncio.wait({task, expired}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            expired.cancel()
        if task.done():
            task.result()  # the app's own exception, as if there were no middleware
            return
        # Cancelling the route aborts its engine requests (generation.run_jobs cleans up on cancel).
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await progress.cut_off(self.drain.cut_off_message())
