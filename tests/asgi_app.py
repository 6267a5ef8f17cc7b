"""The real app over given replicas (toy ones, usually), in this process and without its lifespan:
for HTTP-layer tests where no engine is the subject."""

from __future__ import annotations

import contextlib

import httpx

from dlora.app.asgi import attach, create_app
from dlora.app.state import build_state


@contextlib.asynccontextmanager
async def app_over(cfg, replicas: list, timeout_s: float = 30, **state_kwargs):
    """(an httpx client of the app, its server state), closed on exit."""
    state = await build_state(cfg, replicas=replicas, **state_kwargs)

    async def make_state():
        return state

    app = create_app(make_state)
    attach(app, state)  # what the lifespan does; ASGITransport does not run it
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dlora", timeout=timeout_s)
    try:
        yield http, state
    finally:
        await state.close()
        await http.aclose()
