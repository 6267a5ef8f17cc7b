"""Whose files and batches a caller may see: as OpenAI keeps organisations apart.

Each API key (`server.api_key`) is an owner of its own; its files and batches are invisible to
every other key. The owner is stored as a digest of the key, never the key itself, so the state
directory gives no credential away. With no API key configured, every caller is the one owner "".
The admin token (`server.admin_token`) sees and touches every owner's objects (owner None).
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from dlora.server.auth import Unauthorized, bearer_token

NO_KEY_OWNER = ""  # every caller's owner while no API key is configured; records stored before owners
OWNER_HEX_DIGITS = 16  # 64 bits of the key's digest: no two keys of one server meet by chance


def owner_id(key: str) -> str:
    """The owner an API key stands for, as stored on disk."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:OWNER_HEX_DIGITS]


def owner_of(authorization: str, api_keys: tuple[str, ...], admin_token: str | None) -> str | None:
    """The owner an `Authorization` header value speaks for; None: the admin, every owner.
    Raises Unauthorized when API keys are configured and it carries none of them nor the admin token."""
    token = bearer_token(authorization)
    given = (token or "").encode()
    # Every credential in constant time, with no stop at the first match: the time taken reveals
    # neither how much of a guess was right nor which key it matched.
    is_admin = bool(admin_token) and hmac.compare_digest(given, (admin_token or "").encode())
    matches = [hmac.compare_digest(given, key.encode()) for key in api_keys]
    if token is not None and is_admin:
        return None
    if not api_keys:
        return NO_KEY_OWNER
    if token is None or not any(matches):
        raise Unauthorized()
    return owner_id(api_keys[matches.index(True)])


async def request_owner(request: Request) -> str | None:
    """FastAPI dependency of /v1/files and /v1/batches: the caller's owner (None: the admin), the
    middleware's check again at the route, so the guard holds whatever mounts it."""
    cfg = request.app.state.dlora.cfg
    return owner_of(request.headers.get("authorization", ""), cfg.api_key, cfg.admin_token)
