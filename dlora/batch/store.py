"""Batches and their finished lines, kept under the state directory so a restart resumes them.

Per batch, a directory `<id>/` with `batch.json` (OpenAI's batch object as last saved) and
`results.jsonl`, a journal with one entry per finished line (its line number and its output
line), appended and flushed as each line finishes. On restart the journal says which lines are
done; a torn last entry (a crash mid-write) is ignored and that line runs again.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dlora.batch.durable import read_json, write_json

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

    @staticmethod
    def new(endpoint: str, input_file_id: str, window: str, window_s: int, metadata: dict | None) -> BatchRecord:
        now = int(time.time())
        return BatchRecord(
            id=f"batch_{uuid.uuid4().hex}",
            endpoint=endpoint,
            input_file_id=input_file_id,
            completion_window=window,
            created_at=now,
            expires_at=now + window_s,
            metadata=metadata,
        )

    def enter(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())

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
        write_json(self.root / record.id / "batch.json", asdict(record))

    def get(self, batch_id: str) -> BatchRecord:
        data = read_json(self.root / batch_id / "batch.json") if BATCH_ID.fullmatch(batch_id) else None
        if data is None:
            raise BatchNotFound(batch_id)
        return BatchRecord.from_dict(data)

    def all(self) -> list[BatchRecord]:
        """Newest first; a directory whose record is damaged is skipped."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            try:
                found.append(self.get(entry.name))
            except (BatchNotFound, TypeError, KeyError):
                continue
        return sorted(found, key=lambda r: (-r.created_at, r.id))

    def append_result(self, batch_id: str, line: int, output: dict) -> None:
        path = self.root / batch_id / "results.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"line": line, "output": output}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def results(self, batch_id: str) -> dict[int, dict]:
        """Finished lines by line number, from the journal."""
        done: dict[int, dict] = {}
        path = self.root / batch_id / "results.jsonl"
        if not path.is_file():
            return done
        for raw in path.read_text().splitlines():
            try:
                entry = json.loads(raw)
                done[int(entry["line"])] = entry["output"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn entry: that line runs again
        return done
