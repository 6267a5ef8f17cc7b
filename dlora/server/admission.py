"""Admission control: what the server refuses before any work starts, and how.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware buffers and breaks streaming) in front of
every route, behind the credential check (dlora/server/auth.py: a request without the key its path
needs is a 401 before any of this). In order:
  * a body over `server.max_body_bytes` (a file upload: `batch.max_file_mib`) -> 413 (the declared
    Content-Length, else bytes counted as they arrive, for chunked bodies; nothing more is read);
  * an inference request whose JSON breaks dlora's rules (a value the engines cannot carry: a lone
    surrogate, a non-finite float, an integer beyond int64; a client priority, in the body or vLLM's
    X-Vllm-Priority header, the operator does not allow; a reserved chat-template argument) -> 400
    naming the field (dlora.server.validation.check_body);
  * an inference request asking for more than `server.max_choices_per_request` completions
    (prompts x n: each is one engine request) -> 400 naming `n` (or `prompt` when n is 1);
  * an inference request whose completions would push the cluster's in-flight completions past
    `server.max_pending_requests` -> 429 with `Retry-After`: the whole request is refused up front,
    so a request never runs half of its choices.
An admitted inference request gets an id of the server's making (`with_request_id`). The completions
of an admitted request count as in flight (`ServerState.admitted`) until its response has been sent
(a stream included). Batch lines count theirs at the batch gate (dlora/batch/gate.py), in the room
online leaves; online admission counts online completions only, so batch work never causes a 429.
Why here and not in the routes: the fan-out is known from the raw JSON, so a request of 48,000
completions is refused before it is validated, tokenised or turned into jobs.
Refusals are OpenAI-shaped JSON (dlora/server/errors.py) and counted in /metrics.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dlora.cluster.errors import ClusterError
from dlora.server import routes_admin
from dlora.server.auth import AuthMiddleware
from dlora.server.errors import APIError, error_body, error_response
from dlora.server.validation import check_body

INFERENCE_PATHS = {"/v1/completions": "prompt", "/v1/chat/completions": None, "/v1/responses": None}
RESPONSE_ID_PREFIX = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-", "/v1/responses": "resp_"}
PRIORITY_HEADER = b"x-vllm-priority"  # vLLM's: overrides the body's `priority`
UPLOAD_PATH = "/v1/files"  # batch input files: their own size limit (batch.max_file_mib)
UPLOAD_OVERHEAD_BYTES = 64 * 1024  # a multipart body's headers and boundaries around the file
RETRY_AFTER_S = 1  # in-flight completions end within seconds on a busy server: come back soon


@dataclass
class Fanout:
    """How many completions (engine requests) one inference request asks for."""

    prompts: int = 1
    n: int = 1

    @property
    def choices(self) -> int:
        return self.prompts * self.n

    def too_wide(self, limit: int) -> tuple[str, str] | None:
        """The 400's message and param when this asks for more than `limit` completions, else None."""
        if self.choices <= limit:
            return None
        message = (
            f"this request asks for {self.choices} completions ({self.prompts} prompt(s) x n={self.n}); the "
            f"server allows at most {limit} per request (server.max_choices_per_request)"
        )
        return message, "n" if self.n > 1 else "prompt"


def parsed(body: bytes) -> object:
    """The body's JSON, or None when it is not JSON (the route refuses it with the precise reason)."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def fanout_of_data(path: str, data: object) -> Fanout:
    """The same for a parsed body of an inference path (a batch line's)."""
    if not isinstance(data, dict):
        return Fanout()
    n = data.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    return Fanout(prompts=_prompts(data.get("prompt")) if INFERENCE_PATHS[path] else 1, n=n)


def _prompts(prompt) -> int:
    """A string or one list of token ids is one prompt; a list of strings or of id lists is many."""
    if not isinstance(prompt, list) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def overloaded(limit: int, choices: int) -> str:
    """The 429's message when `choices` more completions would pass `server.max_pending_requests`."""
    return (
        f"the server is at its limit of {limit} completions in flight (server.max_pending_requests) and this "
        f"request asks for {choices}; retry later"
    )


@dataclass
class InFlight:
    """Online completions admitted and not yet answered, across every request (one per server, on
    its state: the batch gate reads it too)."""

    count: int = 0

    def take(self, n: int, limit: int) -> bool:
        if self.count + n > limit:
            return False
        self.count += n
        return True

    def release(self, n: int) -> None:
        self.count -= n


class BodyTooLarge(Exception):
    pass


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = getattr(scope["app"].state, "dlora", None) if scope["type"] == "http" else None
        if state is None:  # not HTTP, or the server is still starting
            await self.app(scope, receive, send)
            return
        limits = state.cfg.server
        max_bytes, limit_key = limits.max_body_bytes, "server.max_body_bytes"
        if scope["path"] == UPLOAD_PATH:
            max_bytes, limit_key = state.cfg.batch.max_file_bytes + UPLOAD_OVERHEAD_BYTES, "batch.max_file_mib"
        try:
            body, receive = await _read_body(scope, receive, max_bytes)
        except BodyTooLarge:
            await self._refuse(
                state,
                scope,
                send,
                "body_too_large",
                413,
                f"request body is larger than the server's limit of {max_bytes} bytes ({limit_key})",
            )
            return
        if scope["path"] not in INFERENCE_PATHS or body is None:
            await self.app(scope, receive, send)
            return
        data = parsed(body)
        try:
            check_body(data, _header(scope, PRIORITY_HEADER) or None, limits)
        except APIError as e:
            await self._refuse(state, scope, send, "invalid", e.status, e.message, e.param)
            return
        fanout = fanout_of_data(scope["path"], data)
        too_wide = fanout.too_wide(limits.max_choices_per_request)
        if too_wide is not None:
            await self._refuse(state, scope, send, "fanout", 400, *too_wide)
            return
        in_flight: InFlight = state.admitted
        if not in_flight.take(fanout.choices, limits.max_pending_requests):
            await self._refuse(
                state,
                scope,
                send,
                "overloaded",
                429,
                overloaded(limits.max_pending_requests, fanout.choices),
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            return
        _set_in_flight(state, in_flight.count)
        scope, send = with_request_id(scope, send)
        try:
            await self.app(scope, receive, send)
        finally:
            in_flight.release(fanout.choices)
            _set_in_flight(state, in_flight.count)

    @staticmethod
    async def _refuse(
        state,
        scope: Scope,
        send: Send,
        reason: str,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        state.metrics.admission_refused.labels(reason).inc()
        response = JSONResponse(error_body(status, message, param), status_code=status, headers=headers)
        await response(scope, _no_body, send)


def with_request_id(scope: Scope, send: Send) -> tuple[Scope, Send]:
    """The request with an id of the server's making, which vLLM's serving puts in the response's
    `id` (`cmpl-<id>`, `chatcmpl-<id>`), and a `send` that also gives that id in an X-Request-Id
    header, errors included. A client's own X-Request-Id is replaced: engine requests are keyed by
    it, and one client must not name another's."""
    base = uuid.uuid4().hex
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"x-request-id"]
    scope = dict(scope, headers=[*headers, (b"x-request-id", base.encode())])
    shown = (RESPONSE_ID_PREFIX[scope["path"]] + base).encode()

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = dict(message, headers=[*message.get("headers", ()), (b"x-request-id", shown)])
        await send(message)

    return scope, send_with_id


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


def _set_in_flight(state, count: int) -> None:
    state.metrics.admitted_choices.set(count)


async def _read_body(scope: Scope, receive: Receive, limit: int) -> tuple[bytes | None, Receive]:
    """The whole body (None for a request without one) and a `receive` that hands it to the app
    again, then passes on what the client sends next (a disconnect). Raises BodyTooLarge as soon
    as the declared or received size passes `limit`."""
    declared = _content_length(scope)
    if declared is not None and declared > limit:
        raise BodyTooLarge
    if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and not declared:
        return None, receive
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away mid-body
            return None, _replay([message], receive)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = b"".join(chunks)
    return body, _replay([{"type": "http.request", "body": body, "more_body": False}], receive)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


def _content_length(scope: Scope) -> int | None:
    try:
        return int(_header(scope, b"content-length"))
    except ValueError:
        return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def install(app) -> None:
    """Put the credential check, then admission control, in front of every route (outside the
    routes' exception handlers; the middleware added last is the outer one), and answer the
    cluster's typed failures (no replica, deadline passed, resubmission limit) with their status
    when a route lets one through."""
    app.add_middleware(AdmissionMiddleware)
    app.add_middleware(AuthMiddleware, is_admin_path=routes_admin.is_admin_path)

    async def cluster_error(_, exc: ClusterError):
        return error_response(exc.http_status, str(exc))

    app.add_exception_handler(ClusterError, cluster_error)
