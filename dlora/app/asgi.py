"""The FastAPI application: the OpenAI routes (vLLM's serving classes), files and batches, admin
routes, /health, /metrics."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from vllm.utils.gc_utils import freeze_gc_heap

from dlora.adapters.registry_store import RegistryPersistError
from dlora.batch import routes as batch_routes
from dlora.batch.service import batch_service
from dlora.config import ServerConfig
from dlora.server import admission, errors, routes_admin, vllm_frontend
from dlora.server.drain import Drain, DrainMiddleware
from dlora.server.state import ServerState

log = logging.getLogger(__name__)


def _refresh_gauges(state: ServerState) -> None:
    # What the balancer's loop last read: a scrape never waits on a replica.
    starting = frozenset(state.elastic.starting) if state.elastic is not None else frozenset()
    state.metrics.update_cluster(state.router, len(state.adapters.registry), starting)
    if state.batches is not None:
        batches = batch_service(state)
        state.metrics.update_batches(batches.counts_by_status(), batches.gate.in_flight)


def attach(app: FastAPI, state: ServerState) -> None:
    """Give the app its server state: dlora's routes read `app.state.dlora`, vLLM's their serving
    objects (what the lifespan does at start; an app run without its lifespan needs it too)."""
    app.state.dlora = state
    vllm_frontend.start(app, state)


def create_app(make_state: Callable[[], Awaitable[ServerState]], drain: Drain | None = None) -> FastAPI:
    """`drain` is set off by the server's signal handler (serve_cmd); its middleware is outermost, so
    a draining server refuses new requests before any other check runs."""
    drain = drain or Drain(ServerConfig.drain_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        attach(app, await make_state())
        # As vLLM's server does: the start-up heap (torch, vLLM, the tokenizer: millions of objects)
        # is left out of garbage collection, whose full passes over it would otherwise stop the event
        # loop, every stream with it, for about half a second whenever many objects are made at once.
        freeze_gc_heap()
        try:
            yield
        finally:
            await app.state.dlora.close()

    app = FastAPI(title="dlora", lifespan=lifespan)
    errors.install(app)
    admission.install(app)
    app.state.drain = drain

    @app.exception_handler(RegistryPersistError)
    async def _not_persisted(_: Request, exc: RegistryPersistError):
        # The registry undid the change, so the adapter set is what it was before this call.
        return errors.error_response(500, f"{exc}; the change was not applied")

    app.include_router(routes_admin.router)
    app.include_router(batch_routes.router)
    vllm_frontend.install(app)

    @app.get("/health")
    async def health(request: Request):
        state: ServerState = request.app.state.dlora
        healthy = sum(1 for s in state.router.slots if s.healthy)
        status = "draining" if drain.draining else "ok" if healthy else "unavailable"
        body = {
            "status": status,
            "replicas_healthy": healthy,
            "replicas": len(state.router.slots),
            "replicas_given_up": [s.replica_id for s in state.router.slots if s.gave_up],
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        state: ServerState = request.app.state.dlora
        _refresh_gauges(state)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        from importlib.metadata import version as v

        return {"version": v("dlora")}

    app.add_middleware(DrainMiddleware, drain=drain)
    return app
