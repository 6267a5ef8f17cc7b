"""Who may call what, as vLLM's --api-key has it: with `server.api_key` set, every path under /v1
needs one of its keys (`Authorization: Bearer <key>`); the admin routes need `server.admin_token`
when one is set, else the API key; /v1/files and /v1/batches take the admin token as well as the
keys (each key sees its own objects, the admin all: dlora/server/owners.py). Paths outside /v1
(/health, /metrics, /version, /tokenize, /detokenize) stay open, as in vLLM.

A pure ASGI middleware checks this before anything else reads the request (its body included), so a
caller without the credential learns nothing about what the server would make of its request: not
its size limits, not whether its body parses. At start it warns when the admin routes are open to
anyone who can reach a non-loopback address."""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable

from fastapi import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dlora.server.errors import APIError, error_body

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/v1"  # vLLM's AuthenticationMiddleware guards every path under it
OWNED_PREFIXES = ("/v1/files", "/v1/batches")  # objects with an owner: the admin token reaches them too
UNAUTHORIZED = "Unauthorized"  # vLLM's message
ADMIN_UNAUTHORIZED = "missing or invalid admin token (Authorization: Bearer <token>)"


class Unauthorized(APIError):
    def __init__(self, message: str = UNAUTHORIZED) -> None:
        super().__init__(401, message)


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def authorized(authorization: str, keys: tuple[str, ...] | str | None) -> bool:
    """Whether an `Authorization` header value carries one of the keys (any caller when none is set)."""
    accepted = (keys,) if isinstance(keys, str) else keys or ()
    if not accepted:
        return True
    token = bearer_token(authorization)
    if token is None:
        return False
    given = token.encode()
    # Each key in constant time, and every key (no stop at the first match), so the time taken
    # reveals neither how much of a guess was right nor which key it matched.
    matches = [hmac.compare_digest(given, key.encode()) for key in accepted]
    return any(matches)


def admin_keys(cfg) -> tuple[str, ...]:
    """The credentials the admin routes take: the admin token when one is set, else the API keys
    (as vLLM's --api-key guards its own adapter routes); none: open."""
    return (cfg.admin_token,) if cfg.admin_token else cfg.api_key


def is_owned_path(path: str) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in OWNED_PREFIXES)


def owned_keys(cfg) -> tuple[str, ...]:
    """The credentials /v1/files and /v1/batches take: the API keys and the admin token; none
    while no API key is set (open, as inference is)."""
    if not cfg.api_key:
        return ()
    return cfg.api_key + ((cfg.admin_token,) if cfg.admin_token else ())


def required(path: str, cfg, is_admin_path: Callable[[str], bool]) -> tuple[tuple[str, ...], str]:
    """The keys a request to `path` must carry (empty: none) and the 401's message without one."""
    if not path.startswith(GUARDED_PREFIX):
        return (), UNAUTHORIZED
    if is_admin_path(path):
        return admin_keys(cfg), ADMIN_UNAUTHORIZED if cfg.admin_token else UNAUTHORIZED
    if is_owned_path(path):
        return owned_keys(cfg), UNAUTHORIZED
    return cfg.api_key, UNAUTHORIZED


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def admin_exposure(cfg) -> str | None:
    """The start-up warning when anyone who reaches the server may load, unload and drain, else None."""
    if admin_keys(cfg) or is_loopback(cfg.server.host):
        return None
    return (
        f"the admin routes (adapter loading and unloading, replica drains) are open to anyone who can reach "
        f"{cfg.server.host}:{cfg.server.port}: set server.admin_token (or server.api_key), or bind to 127.0.0.1"
    )


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of the inference routes: the middleware's check again at the
    route, so the guard holds whatever mounts it."""
    if not authorized(request.headers.get("authorization", ""), request.app.state.dlora.cfg.api_key):
        raise Unauthorized()


class AuthMiddleware:
    """Refuses a request without the credential its path needs (401, OpenAI's error shape) before
    its body is read; OPTIONS (CORS preflight) passes, as in vLLM."""

    def __init__(self, app: ASGIApp, is_admin_path: Callable[[str], bool]) -> None:
        self.app = app
        self.is_admin_path = is_admin_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, _warn_once_started(scope, send))
            return
        state = getattr(scope["app"].state, "dlora", None) if scope["type"] == "http" else None
        if state is None or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        keys, message = required(path, state.cfg, self.is_admin_path)
        if authorized(_authorization(scope), keys):
            await self.app(scope, receive, send)
            return
        state.metrics.admission_refused.labels("unauthorized").inc()
        await JSONResponse(error_body(401, message), status_code=401)(scope, _no_body, send)


def _warn_once_started(scope: Scope, send: Send) -> Send:
    """`send` for the lifespan: once the server has started (its state is attached), the warning."""

    async def sent(message: Message) -> None:
        if message["type"] == "lifespan.startup.complete":
            state = getattr(scope["app"].state, "dlora", None)
            warning = admin_exposure(state.cfg) if state is not None else None
            if warning is not None:
                log.warning(warning)
        await send(message)

    return sent


def _authorization(scope: Scope) -> str:
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            return value.decode("latin-1")
    return ""


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
