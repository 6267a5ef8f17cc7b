"""OpenAI's Files and Batches API: /v1/files and /v1/batches, over the batch service.

Every route acts for the caller's owner (dlora/server/owners.py): each API key sees only its own
files and batches, the admin token all of them."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Form, Query, Request, UploadFile
from pydantic import BaseModel, ConfigDict

from dlora.batch.files import UPLOAD_PURPOSES, FileNotFound
from dlora.batch.service import BatchService, batch_service
from dlora.server.errors import APIError
from dlora.server.file_response import FileContent
from dlora.server.owners import request_owner

# Every route takes the caller's owner: the API key (when set) guards these as it guards inference.
router = APIRouter()
Owner = Depends(request_owner)

# OpenAI's `expires_after` of an upload: seconds from the file's creation, an hour to 30 days.
EXPIRES_ANCHOR, EXPIRES_SECONDS = "expires_after[anchor]", "expires_after[seconds]"
MIN_KEEP_S, MAX_KEEP_S = 3600, 30 * 86400


class BatchCreate(BaseModel):
    # Fields OpenAI added later (output_expires_after, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    # OpenAI's type; its limits (16 pairs, lengths, valid Unicode) are checked when the batch is made
    metadata: dict[str, str] | None = None


def _batches(request: Request) -> BatchService:
    return batch_service(request.app.state.dlora)


@contextlib.contextmanager
def _file_404(file_id: str) -> Iterator[None]:
    """A file the store does not have is the client's 404."""
    try:
        yield
    except FileNotFound:
        raise APIError(404, f"No such file: {file_id!r}", "file_id") from None


def keep_seconds(anchor: str | None, seconds: str | None) -> int | None:
    """How long an upload asks to be kept (OpenAI's `expires_after`); None: the server's retention."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise APIError(400, f"{EXPIRES_ANCHOR} must be 'created_at'", EXPIRES_ANCHOR)
    keep = int(seconds) if seconds is not None and re.fullmatch(r"[0-9]{1,8}", seconds) else None
    if keep is None or not MIN_KEEP_S <= keep <= MAX_KEEP_S:
        why = (
            f"{EXPIRES_SECONDS} must be a whole number of seconds from {MIN_KEEP_S} (an hour) to {MAX_KEEP_S} (30 days)"
        )
        raise APIError(400, why, EXPIRES_SECONDS)
    return keep


@router.post("/v1/files")
async def upload_file(
    request: Request,
    file: UploadFile,
    purpose: str = Form(...),
    anchor: str | None = Form(None, alias=EXPIRES_ANCHOR),
    seconds: str | None = Form(None, alias=EXPIRES_SECONDS),
    owner: str | None = Owner,
):
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"purpose {purpose!r} is not supported; use one of {', '.join(UPLOAD_PURPOSES)}", "purpose")
    keep_s = keep_seconds(anchor, seconds)
    content = await file.read()
    record = await _batches(request).upload(content, file.filename or "", purpose, owner, keep_s)
    return record.to_openai()


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None, owner: str | None = Owner):
    # Reads every file's record: off the event loop (an owner may hold hundreds).
    files = await asyncio.to_thread(_batches(request).files.list, purpose, owner)
    return {"object": "list", "data": [r.to_openai() for r in files]}


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str, owner: str | None = Owner):
    with _file_404(file_id):
        return _batches(request).files.get(file_id, owner).to_openai()


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str, owner: str | None = Owner):
    with _file_404(file_id):
        path = _batches(request).files.content_path(file_id, owner)
    return FileContent(path, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str, owner: str | None = Owner):
    _batches(request).delete_file(file_id, owner)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(request: Request, body: BatchCreate, owner: str | None = Owner):
    batches = _batches(request)
    record = await batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata, owner)
    return record.to_openai()


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    owner: str | None = Owner,
):
    records, has_more = _batches(request).page(after, limit, owner)
    data = [r.to_openai() for r in records]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str, owner: str | None = Owner):
    return _batches(request).get(batch_id, owner).to_openai()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str, owner: str | None = Owner):
    return (await _batches(request).cancel(batch_id, owner)).to_openai()


@router.delete("/v1/batches/{batch_id}")
async def delete_batch(request: Request, batch_id: str, owner: str | None = Owner):
    _batches(request).delete(batch_id, owner)
    return {"id": batch_id, "object": "batch", "deleted": True}
