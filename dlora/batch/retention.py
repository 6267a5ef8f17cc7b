"""Which stored files and batches are due for removal (`batch.retention_days`, a file's own
`expires_at`), decided apart from any disk or clock so that it can be checked on its own.

A file goes at its `expires_at` (None: kept until deleted), unless it is the input of a batch still
running: that batch reads it again when the server restarts. An ended batch (completed, failed,
expired, cancelled) goes `retention_s` after it ended; its output and error files are files with
their own expiry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dlora.batch.files import FileRecord
from dlora.batch.store import ACTIVE, BatchRecord


@dataclass(frozen=True)
class Due:
    files: list[str]
    batches: list[str]


def expired(record: FileRecord, now: float) -> bool:
    return record.expires_at is not None and record.expires_at <= now


def removable(record: BatchRecord, now: float, retention_s: int | None) -> bool:
    ended_at = record.ended_at
    return retention_s is not None and ended_at is not None and ended_at + retention_s <= now


def due(files: Iterable[FileRecord], batches: Iterable[BatchRecord], now: float, retention_s: int | None) -> Due:
    """The ids of the files and batches to remove at `now`."""
    batches = list(batches)
    in_use = {b.input_file_id for b in batches if b.status in ACTIVE}
    file_ids = [f.id for f in files if expired(f, now) and f.id not in in_use]
    return Due(file_ids, [b.id for b in batches if removable(b, now, retention_s)])
