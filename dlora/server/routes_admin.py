"""Admin API: load, unload and list adapters (vLLM-compatible bodies, plus each adapter's SLO); list
replicas and drain one (with `cluster.autoscale`). Guarded by the admin token, else the API key
(dlora/server/auth.py). A refusal names the field and the reason, never a server path or an
engine's error text: those go to the server log under the request id the refusal quotes."""

from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from dlora.adapters.lifecycle import (
    AdapterBusyError,
    AdapterExistsError,
    AdapterForbiddenError,
    AdapterNotFoundError,
    AdapterValidationError,
)
from dlora.replica.messages import BatchingState
from dlora.server.auth import ADMIN_UNAUTHORIZED, UNAUTHORIZED, Unauthorized, admin_keys, authorized
from dlora.server.errors import APIError
from dlora.server.protocol import LoadAdapterRequest, UnloadAdapterRequest
from dlora.server.validation import check_values
from dlora.slo.config import parse_adapter_slo
from dlora.slo.listing import listing_json, slo_json

log = logging.getLogger(__name__)

# Linux's PATH_MAX: a longer lora_path cannot name a file, and would be refused by the OS mid-check.
MAX_LORA_PATH_CHARS = 4096


def require_admin(request: Request) -> None:
    """The middleware's check again at the route, so the guard holds whatever mounts it."""
    cfg = request.app.state.dlora.cfg
    if not authorized(request.headers.get("authorization", ""), admin_keys(cfg)):
        raise Unauthorized(ADMIN_UNAUTHORIZED if cfg.admin_token else UNAUTHORIZED)


router = APIRouter(dependencies=[Depends(require_admin)])


def is_admin_path(path: str) -> bool:
    """Whether `path` is one of this router's routes (the credential check runs before routing)."""
    return any(route.path_regex.match(path) for route in router.routes)  # type: ignore[attr-defined]


def check_load_body(body: LoadAdapterRequest) -> None:
    """Values the file system and the SLO arithmetic can take, each refused naming its field (an
    SLO's problems all as `slo`, its message naming the key, as parse_adapter_slo's): valid Unicode,
    finite numbers within int64 (dlora.server.validation), and a lora_path the OS can look up."""
    check_values({"lora_path": body.lora_path})
    try:
        check_values({"slo": body.slo})
    except APIError as e:
        raise APIError(400, e.message, "slo") from None
    if "\x00" in body.lora_path:
        raise APIError(400, "lora_path: must not contain a NUL character", "lora_path")
    if len(body.lora_path) > MAX_LORA_PATH_CHARS:
        raise APIError(400, f"lora_path: longer than {MAX_LORA_PATH_CHARS} characters", "lora_path")


def refused(name: str, e: AdapterValidationError) -> APIError:
    """The 400 for an adapter that failed validation. What only the server may see (paths, an
    engine's or a library's error text) is logged under a request id that the answer quotes."""
    if e.detail is None:
        return APIError(400, f"invalid adapter {name!r}: {e}", "lora_path")
    request_id = uuid.uuid4().hex
    log.warning("load request %s: adapter %s refused: %s (%s)", request_id, name, e, e.detail)
    return APIError(
        400, f"invalid adapter {name!r}: {e} (request id {request_id}; the server log has the details)", "lora_path"
    )


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadAdapterRequest, request: Request):
    state = request.app.state.dlora
    check_load_body(body)
    try:
        slo = parse_adapter_slo(body.slo)
    except ValueError as e:
        raise APIError(400, str(e), "slo") from None
    try:
        await state.adapters.register(
            body.lora_name, body.lora_path, pinned=body.pinned, inplace=body.load_inplace, slo=slo
        )
    except AdapterExistsError:
        raise APIError(
            409,
            f"adapter {body.lora_name!r} is already registered; unload it first, or send load_inplace: true to "
            "replace its weights",
            "lora_name",
        ) from None
    except AdapterForbiddenError as e:
        raise APIError(403, str(e), "lora_path") from e
    except AdapterValidationError as e:
        raise refused(body.lora_name, e) from None
    state.metrics.adapters_registered.set(len(state.adapters.registry))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request):
    state = request.app.state.dlora
    try:
        await state.adapters.unregister(body.lora_name)
    except AdapterNotFoundError:
        raise APIError(404, f"adapter {body.lora_name!r} is not registered", "lora_name") from None
    except AdapterBusyError as e:
        raise APIError(409, str(e), "lora_name") from e
    state.metrics.adapters_registered.set(len(state.adapters.registry))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def residency(stats) -> dict[int, list[dict]]:
    """Adapter id -> where it is loaded: `{"replica": id, "state": "device"}` when it holds one of
    that engine's LoRA slots, `"host"` when it is only in its host LoRA cache; healthy replicas only."""
    out: dict[int, list[dict]] = {}
    for st in stats:
        if not st.healthy:
            continue
        device = set(st.device_adapter_ids)
        for aid in st.resident_adapter_ids:
            out.setdefault(aid, []).append({"replica": st.replica_id, "state": "device" if aid in device else "host"})
    return out


@router.get("/v1/adapters")
async def list_adapters(request: Request):
    state = request.app.state.dlora
    # As the balancer's monitor loop last read it (at most cluster.monitor_interval_s old): a read
    # of this list must not take the replicas' measurements from the loop that feeds them to dispatch.
    placed = residency(state.router.reported_stats())
    data = []
    for r in state.adapters.registry.all():
        replicas = placed.get(r.int_id, [])
        on = [p["replica"] for p in replicas]
        data.append(
            {
                "name": r.name,
                "path": r.path,
                "rank": r.rank,
                "alpha": r.alpha,
                "target_modules": list(r.target_modules),
                "pinned": r.pinned,
                "version": r.version,
                "source": r.source,
                "state": "resident" if on else "registered",
                "resident_on": on,
                "replicas": replicas,
                "in_flight": state.router.inflight_by_adapter.get(r.name, 0),
                "size_bytes": r.size_bytes,
                "slo": slo_json(r.slo, state.router.slo.cfg),
            }
        )
    return {"object": "list", "data": data, **listing_json(state.router.slo)}


@router.get("/v1/replicas")
async def list_replicas(request: Request):
    """Each replica: its state (as `dlora_replicas{state}` counts it), whether its rebuilds were given
    up, the requests the router has on it now (queued there or running) and its engine's weights
    (as the balancer last read them)."""
    state = request.app.state.dlora
    starting = set(state.elastic.starting) if state.elastic is not None else set()
    routed = state.router.routed_counts()
    engines = {st.replica_id: st.batching for st in state.router.reported_stats() if st.healthy}
    data = [
        {
            "id": s.replica_id,
            "state": s.state(s.replica_id in starting),
            "given_up": s.gave_up,
            "requests": routed.get(s.replica_id, 0),
            "weights": weights_json(engines.get(s.replica_id)),
        }
        for s in state.router.slots
    ]
    known = {s.replica_id for s in state.router.slots}
    data += [
        {"id": rid, "state": "starting", "given_up": False, "requests": 0, "weights": None}
        for rid in sorted(starting - known)
    ]
    return {"object": "list", "data": data}


def weights_json(batching: BatchingState | None) -> dict | None:
    """A replica's weights as `dlora_weight_state` shows them, with the adapter merged and the
    restores so far; None until the replica's engine state has been read (or while it is down)."""
    if batching is None:
        return None
    return {"state": batching.weights, "adapter": batching.merged_adapter, "restores": batching.weight_restores}


@router.post("/v1/replicas/{replica_id}/drain", status_code=202)
async def drain_replica(replica_id: int, request: Request):
    """Take a replica out of service without losing a request: dispatch skips it, its queued
    requests move at once and its running ones by co-migration, and it stops once empty (as the
    autoscaler's scale-in does; the autoscaler starts another if the load needs it). Answers at
    once; `GET /v1/replicas` shows the drain until the replica is gone."""
    state = request.app.state.dlora
    if state.elastic is None:
        raise APIError(
            409, "draining a replica needs cluster.autoscale (a fixed cluster keeps its replica count)", "replica_id"
        )
    try:
        state.elastic.drain(replica_id)
    except LookupError as e:
        raise APIError(404, str(e), "replica_id") from None
    except ValueError as e:
        raise APIError(409, str(e), "replica_id") from None
    return {"id": replica_id, "state": "draining"}
