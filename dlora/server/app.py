"""The FastAPI application: OpenAI routes, admin routes, /health, /metrics."""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from dlora.server import errors, routes_admin, routes_openai
from dlora.server.state import ServerState

log = logging.getLogger(__name__)


async def _refresh_gauges(state: ServerState) -> None:
    m = state.metrics
    m.adapters_registered.set(len(state.adapters.registry))
    for st in await state.router.replica_stats():
        rid = str(st.replica_id)
        m.replica_healthy.labels(rid).set(1 if st.healthy else 0)
        m.replica_unfinished.labels(rid).set(st.num_unfinished)
        m.adapters_resident.labels(rid).set(len(st.resident_adapter_ids))
        m.batching.update(rid, st.batching if st.healthy else None)
        if st.healthy and st.batching is not None:
            m.replica_kv_usage.labels(rid).set(st.batching.kv_usage or 0.0)
            if st.batching.kv_capacity_tokens:
                m.replica_kv_capacity.labels(rid).set(st.batching.kv_capacity_tokens)
            m.replica_running.labels(rid).set(st.batching.num_running)
            m.replica_waiting.labels(rid).set(st.batching.num_waiting)
    routed = Counter(s.slot.replica_id for s in state.router.requests.values() if s.slot is not None)
    for slot in state.router.slots:
        m.replica_routed.labels(str(slot.replica_id)).set(routed.get(slot.replica_id, 0))
        m.cluster.restarts[str(slot.replica_id)] = slot.restarts
    m.cluster.counters = dict(state.router.counters)


def create_app(make_state: Callable[[], Awaitable[ServerState]]) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.dlora = await make_state()
        try:
            yield
        finally:
            await app.state.dlora.close()

    app = FastAPI(title="dlora", lifespan=lifespan)
    errors.install(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_admin.router)

    @app.get("/health")
    async def health(request: Request):
        state: ServerState = request.app.state.dlora
        healthy = sum(1 for s in state.router.slots if s.healthy)
        body = {"status": "ok" if healthy else "unavailable", "replicas_healthy": healthy,
                "replicas": len(state.router.slots)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        state: ServerState = request.app.state.dlora
        await _refresh_gauges(state)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        from importlib.metadata import version as v

        return {"version": v("dlora")}

    return app
