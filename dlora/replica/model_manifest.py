"""The model directory as the API server sees it, checked by each replica at start on its own node.

`model.path` names a directory on every node. A node where it is missing, or holds another model
or another revision, would fail inside vLLM with a confusing error or, worse, serve other weights.
So the server lists the directory (its files' names and sizes and the sha256 of config.json) and
every replica compares its node's directory with that list before it builds an engine, refusing to
start with one line that names the node and the path. A hub id (no directory on the server) is
resolved by each node itself and not checked.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from dlora.replica.errors import ReplicaFailure

CONFIG = "config.json"
_SHOWN = 3  # file names a refusal lists


class ModelMismatch(ReplicaFailure):
    """A replica's node lacks the server's model directory, or holds another one there."""


@dataclass(frozen=True)
class ModelManifest:
    files: tuple[tuple[str, int], ...]  # the directory's own files (not hidden, links followed): name, size
    config_sha256: str  # "" without a config.json


def manifest_of(path: str) -> ModelManifest | None:
    """The directory's manifest; None when `path` is no directory here (a hub id)."""
    d = Path(path)
    if not d.is_dir():
        return None
    files = tuple(sorted((e.name, e.stat().st_size) for e in d.iterdir() if e.is_file() and not e.name.startswith(".")))
    config = d / CONFIG
    return ModelManifest(files, hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else "")


def mismatch(path: str, expected: ModelManifest | None) -> str | None:
    """How this node's `path` differs from the server's manifest; None when it matches (or nothing
    was expected). Files only on this node are fine."""
    if expected is None:
        return None
    try:
        got = manifest_of(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if got is None:
        return "it is missing"
    have = dict(got.files)
    missing = [name for name, _ in expected.files if name not in have]
    if missing:
        return f"{len(missing)} file(s) of the server's are missing: {', '.join(missing[:_SHOWN])}"
    resized = [name for name, size in expected.files if have[name] != size]
    if resized:
        return f"{len(resized)} file(s) differ in size from the server's: {', '.join(resized[:_SHOWN])}"
    if got.config_sha256 != expected.config_sha256:
        return f"its {CONFIG} differs from the server's"
    return None


def check(path: str, expected: ModelManifest | None, node: str) -> None:
    """Raise ModelMismatch, one line naming the node and the path, unless the directory matches."""
    problem = mismatch(path, expected)
    if problem is not None:
        raise ModelMismatch(f"node {node}: model directory {path}: {problem}; this replica does not start")
