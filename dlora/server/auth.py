"""The optional API keys of the inference routes (vLLM's --api-key): `Authorization: Bearer <key>`, any
one of the configured keys."""

from __future__ import annotations

import hmac

from fastapi import Request

from dlora.server.errors import APIError


class Unauthorized(APIError):
    def __init__(self) -> None:
        super().__init__(401, "Unauthorized")


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


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of every inference route. The inference routes with a body are also
    checked by the admission middleware before their body is read, so a caller without the key
    learns nothing about what the server would make of its request (not even its size limits)."""
    if not authorized(request.headers.get("authorization", ""), request.app.state.dlora.cfg.api_key):
        raise Unauthorized()
