"""The optional API key of the inference routes (vLLM's --api-key): `Authorization: Bearer <key>`."""

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


def authorized(authorization: str, key: str | None) -> bool:
    """Whether an `Authorization` header value carries the key (any caller when no key is set)."""
    if key is None:
        return True
    token = bearer_token(authorization)
    # Constant time, so the comparison does not reveal how much of a guess was right.
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of every inference route. The inference routes with a body are also
    checked by the admission middleware before their body is read, so a caller without the key
    learns nothing about what the server would make of its request (not even its size limits)."""
    if not authorized(request.headers.get("authorization", ""), request.app.state.dlora.cfg.api_key):
        raise Unauthorized()
