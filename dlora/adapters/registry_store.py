"""The registry's JSON file in server.state_dir: read it, write it atomically, set a bad one aside.

Nothing here may stop the server: a corrupt file is moved aside (kept for the operator) and a state
directory that cannot be written turns persistence off with a warning, so the server still starts
with the adapters of its config.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


class RegistryPersistError(OSError):
    """Writing the registry file failed; the change that needed it was not applied. The message
    (answered to the admin call) names the OS's reason, not the file: `persist_error` logs that."""


def persist_error(path: Path, e: OSError) -> RegistryPersistError:
    log.error("cannot save the adapter registry to %s: %s", path, e)
    return RegistryPersistError(f"cannot save the adapter registry: {e.strerror or type(e).__name__}")


class CorruptRegistryFile(ValueError):
    """The registry file is not what this version writes (bad JSON, wrong shape, bad entries)."""


def read(path: Path) -> dict | None:
    """The file's JSON object; None when there is no file or it cannot be read (logged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the adapter registry %s (%s); starting without its adapters", path, e)
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CorruptRegistryFile(f"not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("adapters", []), list):
        raise CorruptRegistryFile('expected an object {"next_id": int, "adapters": [...]}')
    return data


def set_aside(path: Path, reason: str) -> None:
    """Rename a corrupt file so the next save does not overwrite what the operator may want back."""
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.replace(path, aside)
    except OSError as e:
        log.warning(
            "the adapter registry %s is corrupt (%s) and cannot be moved aside (%s); "
            "starting with the config's adapters",
            path,
            reason,
            e,
        )
        return
    log.warning(
        "the adapter registry %s is corrupt (%s): moved it to %s; starting with the config's adapters "
        "and the valid entries it held",
        path,
        reason,
        aside,
    )


def writable_problem(directory: Path) -> str | None:
    """Why files cannot be written in `directory` (created if missing), or None when they can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".adapters.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return str(e)
    return None


def write(path: Path, data: dict) -> None:
    """Write-then-rename, so a crash or a full disk mid-write never leaves a truncated registry."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".adapters.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            _discard(tmp)
        raise persist_error(path, e) from e


def _discard(name: str) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass
