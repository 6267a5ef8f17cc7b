"""Build a directory all-or-nothing, so a crash or a racing process never leaves half a model.

A builder writes into a private temporary sibling of the target, a marker file is written last,
and the temporary directory is renamed onto the target. `rename` of a directory is atomic on one
filesystem and fails if the target already holds files, so when two processes race the first
rename wins and the loser discards its copy. Readers only trust a directory carrying the marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = ".dlora-complete"


def is_complete(target: Path) -> bool:
    """True when `target` was fully built (its marker exists)."""
    return (target / MARKER).is_file()


def read_marker(target: Path) -> dict[str, Any]:
    """The metadata the builder stored in the marker (what was built, with which inputs)."""
    return json.loads((target / MARKER).read_text())


def build_atomically(target: Path, build: Callable[[Path], object], marker: dict[str, Any]) -> Path:
    """Run `build(tmp_dir)` and publish the result at `target` unless it is already complete.

    `target` must not exist, or be an empty directory, or be already complete.
    """
    target = Path(target)
    if is_complete(target):
        return target
    _check_target_free(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        _make_readable(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_target_free(target: Path) -> None:
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(
            f"{target} exists and is not a complete dlora build (no {MARKER}); remove it or choose another directory"
        )


def _make_readable(tmp: Path) -> None:
    """mkdtemp creates the directory 0700; other users (e.g. a container user) must read models."""
    tmp.chmod(0o755)


def _publish(tmp: Path, target: Path) -> None:
    """Rename `tmp` onto `target`; losing a race to an identical build is fine."""
    with contextlib.suppress(OSError):
        target.rmdir()  # succeeds only for an empty placeholder directory
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):
            raise
