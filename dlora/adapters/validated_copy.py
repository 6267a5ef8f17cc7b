"""What engines are given to read of an adapter: a read-only snapshot of its files (`snapshot.py`),
taken first and validated itself, or, where no snapshot directory can be written, the source
itself after validation. Engines never read a directory a client can still change."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dlora.adapters import snapshot
from dlora.adapters.snapshot import Snapshot, SnapshotError
from dlora.adapters.validate import (
    AdapterInfo,
    AdapterValidationError,
    BaseModelShapes,
    check_files,
    inspect_adapter,
    unreadable_as_invalid,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidatedCopies:
    base: BaseModelShapes
    max_rank: int
    # Where snapshots are kept (`<state_dir>/adapters`); None: serve the sources as given.
    root: Path | None

    def enabled(self) -> bool:
        """Whether snapshots can be taken (a root that exists or can be made, and is writable)."""
        return self.root is not None and _writable(self.root)

    def take(self, name: str, path: str, roots: tuple[str, ...] | None) -> tuple[AdapterInfo, Snapshot | None]:
        """Validate the adapter at `path` and return what engines are to read: its snapshot (taken
        first and validated itself, so a file changed mid-way cannot slip through), an existing
        snapshot after verifying its hashes, or, with no writable state dir, the source itself."""
        src = Path(path)
        with unreadable_as_invalid(src):  # the client's path: one the OS cannot look up is the client's 400
            check_files(src, roots)
        root = self.root
        if root is not None and snapshot.is_snapshot_path(src, root):
            return self._verified(src)
        if root is None or not _writable(root):
            return inspect_adapter(src, self.base, self.max_rank, roots), None
        return self._copied(name, src, root)

    def _verified(self, src: Path) -> tuple[AdapterInfo, Snapshot]:
        """A snapshot taken before (a persisted registration), if its files still match their hashes."""
        try:
            digest = snapshot.verify(src)
        except SnapshotError as e:
            raise AdapterValidationError(
                "the adapter's stored copy is missing, unreadable or changed; register the adapter again from "
                "its source",
                str(e),
            ) from None
        info = inspect_adapter(src, self.base, self.max_rank)
        return info, Snapshot.of(Path(info.path), digest)

    def _copied(self, name: str, src: Path, root: Path) -> tuple[AdapterInfo, Snapshot]:
        """A new snapshot of `src`, validated as copied; nothing is kept of a copy that fails."""
        for f in snapshot.SNAPSHOT_FILES:
            if not (src / f).is_file():
                raise AdapterValidationError(f"{f} not found in the adapter directory", f"{str(src)!r}")
        try:
            staged, digest = snapshot.stage(src, root)  # the source is read once, into the copy
        except OSError as e:
            raise AdapterValidationError(
                f"cannot copy the adapter's files: {e.strerror or 'I/O error'}", str(e)
            ) from None
        try:
            info = inspect_adapter(staged, self.base, self.max_rank)
        except BaseException:
            snapshot.discard(staged)
            raise
        snap = snapshot.commit(staged, root, name, digest)
        return dataclasses.replace(info, path=str(snap.path)), snap

    def prune(self, in_use: Iterable[str]) -> None:
        """Drop the snapshots none of the paths `in_use` names (unloaded adapters, failed or
        interrupted copies): at start, before any engine could hold their paths."""
        if self.root is None:
            return
        keep = {Path(p).name for p in in_use if snapshot.is_snapshot_path(p, self.root)}
        removed = snapshot.prune(self.root, keep)
        if removed:
            log.info("removed %d unused adapter snapshot(s) from %s", len(removed), self.root)


def _writable(root: Path) -> bool:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("adapter snapshots disabled (%s): engines read adapters from their sources", e)
        return False
    if not os.access(root, os.W_OK | os.X_OK):
        log.warning("adapter snapshots disabled (%s is not writable): engines read adapters from their sources", root)
        return False
    return True
