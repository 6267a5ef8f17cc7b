"""/v1/models: the base model, then every registered adapter (its parent the base model)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from dlora.server.auth import require_api_key

# An inference route: the API key (when set) guards it.
router = APIRouter(dependencies=[Depends(require_api_key)])


@router.get("/v1/models")
async def models(request: Request):
    state = request.app.state.dlora
    base = state.base_model_name

    def card(model_id: str, parent: str | None, root: str) -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "dlora",
            "root": root,
            "parent": parent,
            "max_model_len": state.max_model_len,
        }

    data = [card(base, None, state.model_path)]
    data += [card(r.name, base, r.path) for r in state.adapters.registry.all()]
    return {"object": "list", "data": data}
