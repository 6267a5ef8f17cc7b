"""OpenAI's Files and Batches API: /v1/files and /v1/batches (the batches run in dlora/batch/)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import APIRouter, Depends, Form, Query, Request, UploadFile
from pydantic import BaseModel, ConfigDict

from dlora.batch.files import UPLOAD_PURPOSES, FileNotFound
from dlora.batch.service import BatchService
from dlora.server.auth import require_api_key
from dlora.server.errors import APIError
from dlora.server.file_response import FileContent

# The API key (when set) guards these as it guards inference: batches run inference.
router = APIRouter(dependencies=[Depends(require_api_key)])


class BatchCreate(BaseModel):
    # Fields OpenAI added later (output_expires_after, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    # OpenAI's type; its limits (16 pairs, lengths, valid Unicode) are checked when the batch is made
    metadata: dict[str, str] | None = None


def _batches(request: Request) -> BatchService:
    return request.app.state.dlora.batches


@contextlib.contextmanager
def _file_404(file_id: str) -> Iterator[None]:
    """A file the store does not have is the client's 404."""
    try:
        yield
    except FileNotFound:
        raise APIError(404, f"No such file: {file_id!r}", "file_id") from None


@router.post("/v1/files")
async def upload_file(request: Request, file: UploadFile, purpose: str = Form(...)):
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"purpose {purpose!r} is not supported; use one of {', '.join(UPLOAD_PURPOSES)}", "purpose")
    content = await file.read()
    record = _batches(request).files.create(content, file.filename or "", purpose)
    return record.to_openai()


@router.get("/v1/files")
async def list_files(request: Request, purpose: str | None = None):
    return {"object": "list", "data": [r.to_openai() for r in _batches(request).files.list(purpose)]}


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str):
    with _file_404(file_id):
        return _batches(request).files.get(file_id).to_openai()


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str):
    with _file_404(file_id):
        path = _batches(request).files.content_path(file_id)
    return FileContent(path, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str):
    with _file_404(file_id):
        _batches(request).files.delete(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(request: Request, body: BatchCreate):
    record = _batches(request).create(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    return record.to_openai()


@router.get("/v1/batches")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)):
    records, has_more = _batches(request).page(after, limit)
    data = [r.to_openai() for r in records]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str):
    return _batches(request).get(batch_id).to_openai()


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str):
    return _batches(request).cancel(batch_id).to_openai()
