"""Batches and their finished lines, kept under the state directory so a restart resumes them.

Per batch, a directory `<id>/` with `batch.json` (OpenAI's batch object as last saved) and
`results.jsonl`, a journal with one entry per finished line (its line number and its output
line), appended in groups, each flushed to disk (dlora/batch/journal.py). On restart the journal
says which lines are done; a torn last entry (a crash mid-write) is ignored and that line runs again.
Deleting a batch removes its directory; its output and error files are files of their own.
A stored record that cannot be shown (metadata OpenAI would not take, written by an older server;
a damaged file) is shown without its metadata, or not at all, and logged: one record never breaks
the listing of every batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dlora.batch.durable import read_json, write_json
from dlora.batch.metadata import metadata_problem

log = logging.getLogger(__name__)

BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("failed", "completed", "expired", "cancelled")


class BatchNotFound(LookupError):
    pass


@dataclass
class RequestCounts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    errors: list[dict] = field(default_factory=list)  # why the batch failed as a whole
    # when it entered each status: in_progress_at, finalizing_at, completed_at, failed_at, ...
    times: dict[str, int] = field(default_factory=dict)
    owner: str = ""  # dlora/server/owners.py; records stored before owners belong to ""

    @staticmethod
    def new(
        endpoint: str, input_file_id: str, window: str, window_s: int, metadata: dict | None, owner: str = ""
    ) -> BatchRecord:
        now = int(time.time())
        return BatchRecord(
            id=f"batch_{uuid.uuid4().hex}",
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=window,
            created_at=now,
            expires_at=now + window_s,
            metadata=metadata,
            owner=owner,
        )

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

    @property
    def ended_at(self) -> int | None:
        """When an ended batch ended (its creation, if a damaged record lost that); None while active."""
        if self.status not in ENDED:
            return None
        stamp = self.times.get(f"{self.status}_at")
        return stamp if isinstance(stamp, int) else self.created_at

    def to_openai(self) -> dict:
        stamps = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **{f"{s}_at": self.times.get(f"{s}_at") for s in stamps},
            "request_counts": asdict(self.request_counts),
            "metadata": self.metadata,
        }

    @staticmethod
    def from_dict(data: dict) -> BatchRecord:
        data = dict(data)
        data["request_counts"] = RequestCounts(**data.get("request_counts", {}))
        return BatchRecord(**data)


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, record: BatchRecord) -> None:
        self.write(record.id, asdict(record))

    def write(self, batch_id: str, data: dict) -> None:
        """Store a record as `asdict` gave it (blocking: a flush to disk)."""
        write_json(self.root / batch_id / "batch.json", data)

    def get(self, batch_id: str) -> BatchRecord:
        data = read_json(self.root / batch_id / "batch.json") if BATCH_ID.fullmatch(batch_id) else None
        if data is None:
            raise BatchNotFound(batch_id)
        if data.get("id") != batch_id:  # deleting it by its id would remove another batch's directory
            raise ValueError("the record's id is not its directory's")
        return BatchRecord.from_dict(data)

    def all(self) -> list[BatchRecord]:
        """Newest first; a directory whose record is damaged is skipped."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            try:
                record = self.get(entry.name)
            except BatchNotFound:
                continue
            except (TypeError, KeyError, ValueError) as e:
                log.warning("batch %s: its stored record is damaged (%s); not listed", entry.name, type(e).__name__)
                continue
            if showable(record):
                found.append(record)
        return sorted(found, key=lambda r: (-r.created_at, r.id))

    def delete(self, batch_id: str) -> None:
        """Remove the batch's record and journal."""
        if not BATCH_ID.fullmatch(batch_id):
            raise BatchNotFound(batch_id)
        try:
            shutil.rmtree(self.root / batch_id)
        except FileNotFoundError:
            pass

    def append_result(self, batch_id: str, line: int, output: dict) -> None:
        self.append_results(batch_id, [(line, output)])

    def append_results(self, batch_id: str, entries: list[tuple[int, dict]]) -> None:
        """Journal finished lines: one write, one fsync."""
        text = "".join(json.dumps({"line": line, "output": output}) + "\n" for line, output in entries)
        with open(self.root / batch_id / "results.jsonl", "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def results(self, batch_id: str) -> dict[int, dict]:
        """Finished lines by line number, from the journal."""
        done: dict[int, dict] = {}
        path = self.root / batch_id / "results.jsonl"
        if not path.is_file():
            return done
        for raw in path.read_text().split("\n"):
            try:
                entry = json.loads(raw)
                done[int(entry["line"])] = entry["output"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn entry: that line runs again
        return done


def showable(record: BatchRecord) -> bool:
    """Whether the record can be shown, once metadata OpenAI would not take is dropped (logged)."""
    problem = metadata_problem(record.metadata)
    if problem is not None:
        log.warning("batch %r: its stored metadata is not valid (%s); shown without it", record.id, problem)
        record.metadata = None
    try:
        if not (isinstance(record.owner, str) and isinstance(record.times, dict)):  # filtered by; read by to_openai
            raise TypeError("owner must be a string, times a mapping")
        json.dumps(record.to_openai(), ensure_ascii=False).encode()
        if not (isinstance(record.created_at, int) and isinstance(record.expires_at, int)):
            raise TypeError("created_at and expires_at must be whole seconds")
    except (TypeError, ValueError) as e:
        log.warning("batch %r: its stored record cannot be shown (%s); not listed", record.id, type(e).__name__)
        return False
    return True


class RecordSaver:
    """Stores records in a worker thread: a flush to disk on the event loop would hold every stream
    for as long as the disk takes (after a large output file, a good part of a second). One save at a
    time, in the order asked, each of the record as it was when asked, so an older state never lands
    last."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self._lock = asyncio.Lock()
        self._soon: set[asyncio.Task] = set()  # saves asked for by synchronous callers, under way

    async def save(self, record: BatchRecord) -> None:
        data = asdict(record)
        async with self._lock:
            await asyncio.to_thread(self.store.write, record.id, data)

    def save_soon(self, record: BatchRecord) -> None:
        """`save` from a synchronous caller (the counts a running batch writes now and then)."""
        task = asyncio.create_task(self.save(record))
        self._soon.add(task)
        task.add_done_callback(self._soon.discard)
