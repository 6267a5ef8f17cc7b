"""Uploaded and produced files (/v1/files), kept under the state directory.

Each file is two entries in one directory: `<id>.jsonl` (its bytes) and `<id>.json` (OpenAI's file
object, with its owner), written in that order, each atomically, so a file is listed only once its
bytes are whole. Ids are `file-` and 24 hex digits; anything else is "not found" before a path is
built from it, so no id reaches outside the directory. Another owner's file is "not found" too, so
a caller learns nothing of what others keep. A stored record that cannot be read or shown (damaged,
or a field of the wrong kind) is not found and not listed, and logged: one record never breaks the
listing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from dlora.batch.durable import read_json, write_atomic, write_json

log = logging.getLogger(__name__)

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
    expires_at: int | None = None  # None: kept until deleted (records stored before expiries had none)
    owner: str = ""  # dlora/server/owners.py; records stored before owners belong to ""

    def to_openai(self) -> dict:
        shown = {k: v for k, v in asdict(self).items() if k != "owner"}
        return shown | {"object": "file", "status": "processed", "status_details": None}

    @staticmethod
    def from_dict(data: dict) -> FileRecord:
        """The stored record; TypeError or ValueError when it is damaged."""
        record = FileRecord(**{k: data[k] for k in FileRecord.__dataclass_fields__ if k in data})
        whole = (record.bytes, record.created_at) + (() if record.expires_at is None else (record.expires_at,))
        texts = (record.id, record.filename, record.purpose, record.owner)
        if not all(type(n) is int for n in whole) or not all(isinstance(t, str) for t in texts):
            raise TypeError("sizes and times must be whole numbers, names strings")
        json.dumps(record.to_openai(), ensure_ascii=False).encode()  # what a response must carry
        return record


def clean_filename(name: str | None) -> str:
    """The name a client gave, as shown back: its last path part, without control characters."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())
    return base[:MAX_FILENAME] or "upload.jsonl"


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def create(
        self, content: bytes, filename: str, purpose: str, owner: str = "", keep_s: int | None = None
    ) -> FileRecord:
        """Store a file of `owner`'s, to expire `keep_s` seconds from now (None: kept until deleted)."""
        now = int(time.time())
        record = FileRecord(
            id=f"file-{uuid.uuid4().hex[:24]}",
            bytes=len(content),
            created_at=now,
            filename=clean_filename(filename),
            purpose=purpose,
            expires_at=None if keep_s is None else now + keep_s,
            owner=owner,
        )
        write_atomic(self._content(record.id), content)
        write_json(self._record(record.id), asdict(record))
        return record

    def get(self, file_id: str, owner: str | None = None) -> FileRecord:
        """The file, if `owner` may see it (None: any owner)."""
        data = read_json(self._record(file_id)) if FILE_ID.fullmatch(file_id) else None
        if data is None or not self._content(file_id).is_file():
            raise FileNotFound(file_id)
        try:
            record = FileRecord.from_dict(data)
            if record.id != file_id:  # deleting it by its id would remove another file
                raise ValueError("the record's id is not its name's")
        except (TypeError, KeyError, ValueError) as e:
            log.warning("file %s: its stored record is damaged (%s); not shown", file_id, type(e).__name__)
            raise FileNotFound(file_id) from None
        if owner is not None and record.owner != owner:
            raise FileNotFound(file_id)
        return record

    def content_path(self, file_id: str, owner: str | None = None) -> Path:
        self.get(file_id, owner)
        return self._content(file_id)

    def read(self, file_id: str) -> bytes:
        return self.content_path(file_id).read_bytes()

    def list(self, purpose: str | None = None, owner: str | None = None) -> list[FileRecord]:
        """Newest first; only `owner`'s (None: every owner's)."""
        found = []
        for entry in self.root.glob("file-*.json") if self.root.is_dir() else ():
            try:
                record = self.get(entry.stem, owner)
            except FileNotFound:
                continue
            if purpose is None or record.purpose == purpose:
                found.append(record)
        return sorted(found, key=lambda r: (-r.created_at, r.id))

    def delete(self, file_id: str, owner: str | None = None) -> FileRecord:
        """Remove the file (if `owner` may see it); what it was."""
        record = self.get(file_id, owner)
        for path in (self._record(file_id), self._content(file_id)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        return record

    def _record(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def _content(self, file_id: str) -> Path:
        return self.root / f"{file_id}.jsonl"
