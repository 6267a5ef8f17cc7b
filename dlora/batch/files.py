"""Uploaded and produced files (/v1/files), kept under the state directory.

Each file is two entries in one directory: `<id>.jsonl` (its bytes) and `<id>.json` (OpenAI's file
object), written in that order, each atomically, so a file is listed only once its bytes are
whole. Ids are `file-` and 24 hex digits; anything else is "not found" before a path is built
from it, so no id reaches outside the directory.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from dlora.batch.durable import read_json, write_atomic, write_json

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
UPLOAD_PURPOSES = ("batch",)  # what a client may upload; the server writes `batch_output` files
MAX_FILENAME = 255


class FileNotFound(LookupError):
    pass


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_openai(self) -> dict:
        return asdict(self) | {"object": "file", "status": "processed", "expires_at": None, "status_details": None}


def clean_filename(name: str | None) -> str:
    """The name a client gave, as shown back: its last path part, without control characters."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())
    return base[:MAX_FILENAME] or "upload.jsonl"


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def create(self, content: bytes, filename: str, purpose: str) -> FileRecord:
        record = FileRecord(
            id=f"file-{uuid.uuid4().hex[:24]}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=clean_filename(filename),
            purpose=purpose,
        )
        write_atomic(self._content(record.id), content)
        write_json(self._record(record.id), asdict(record))
        return record

    def get(self, file_id: str) -> FileRecord:
        data = read_json(self._record(file_id)) if FILE_ID.fullmatch(file_id) else None
        if data is None or not self._content(file_id).is_file():
            raise FileNotFound(file_id)
        return FileRecord(**{k: data[k] for k in FileRecord.__dataclass_fields__})

    def content_path(self, file_id: str) -> Path:
        self.get(file_id)
        return self._content(file_id)

    def read(self, file_id: str) -> bytes:
        return self.content_path(file_id).read_bytes()

    def list(self, purpose: str | None = None) -> list[FileRecord]:
        """Newest first."""
        found = []
        for entry in self.root.glob("file-*.json") if self.root.is_dir() else ():
            try:
                record = self.get(entry.stem)
            except FileNotFound:
                continue
            if purpose is None or record.purpose == purpose:
                found.append(record)
        return sorted(found, key=lambda r: (-r.created_at, r.id))

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        for path in (self._record(file_id), self._content(file_id)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _record(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def _content(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"
