"""The optional API key of the inference routes (vLLM's --api-key): `Authorization: Bearer <key>`."""

from __future__ import annotations

import hmac

from fastapi import Request

from dlora.server.errors import APIError


class Unauthorized(APIError):
    def __init__(self) -> None:
        super().__init__(401, "Unauthorized")


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: runs before the body's fields are validated, so a caller without the key
    learns nothing about what the server would make of its request (a body that is not JSON at all
    is refused first, by FastAPI)."""
    key = request.app.state.dlora.cfg.api_key
    if key is None:
        return
    token = bearer_token(request)
    # Constant time, so the comparison does not reveal how much of a guess was right.
    if token is None or not hmac.compare_digest(token.encode(), key.encode()):
        raise Unauthorized()
