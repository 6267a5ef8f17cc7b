"""What each owner keeps stored, and whether one more upload or batch is within its quota
(`batch.max_files_per_owner`, `batch.max_stored_mib_per_owner`, `batch.max_batches_per_owner`).

The totals are kept in memory, counted once from the stores at start and followed as files and
batches come and go, so checking a quota reads no directory. Output and error files count against
the batch's owner, but are always written: a batch's results are never lost to a quota.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from dlora.batch.files import FileRecord
from dlora.batch.store import BatchRecord
from dlora.config import BatchConfig

FREE_FILES = "delete files you no longer need (DELETE /v1/files/{file_id}) or wait for them to expire"
FREE_BATCHES = (
    "delete ended batches you no longer need (DELETE /v1/batches/{batch_id}) or wait for them to be removed "
    "(batch.retention_days after they end)"
)


@dataclass
class Held:
    files: int = 0
    bytes: int = 0
    batches: int = 0


class Usage:
    def __init__(self) -> None:
        self._held: dict[str, Held] = defaultdict(Held)

    @staticmethod
    def of(files: Iterable[FileRecord], batches: Iterable[BatchRecord]) -> Usage:
        usage = Usage()
        for f in files:
            usage.add_file(f.owner, f.bytes)
        for b in batches:
            usage.add_batch(b.owner)
        return usage

    def held(self, owner: str) -> Held:
        return self._held.get(owner) or Held()

    def add_file(self, owner: str, size: int, sign: int = 1) -> None:
        held = self._held[owner]
        held.files += sign
        held.bytes += sign * size

    def remove_file(self, owner: str, size: int) -> None:
        self.add_file(owner, size, -1)

    def add_batch(self, owner: str, sign: int = 1) -> None:
        self._held[owner].batches += sign

    def remove_batch(self, owner: str) -> None:
        self.add_batch(owner, -1)


def upload_refusal(held: Held, size: int, cfg: BatchConfig) -> str | None:
    """Why an upload of `size` bytes would pass the owner's file quotas; None: it is within them."""
    if held.files + 1 > cfg.max_files_per_owner:
        return f"you keep {held.files} files, the most batch.max_files_per_owner allows: {FREE_FILES}"
    if held.bytes + size > cfg.max_stored_bytes_per_owner:
        return (
            f"this file of {size} bytes would take your stored files ({held.bytes} bytes) past "
            f"batch.max_stored_mib_per_owner ({cfg.max_stored_mib_per_owner:g} MiB): {FREE_FILES}"
        )
    return None


def batch_refusal(held: Held, cfg: BatchConfig) -> str | None:
    """Why one more batch would pass the owner's batch quota; None: it is within it."""
    if held.batches + 1 > cfg.max_batches_per_owner:
        return f"you keep {held.batches} batches, the most batch.max_batches_per_owner allows: {FREE_BATCHES}"
    return None
