"""An adapter version's content identity and the copy of its files any node of a cluster can read.

The digest is sha256 over the JSON of `{file name: sha256 of its bytes}` (keys sorted): the same
value whether it is computed from a snapshot directory on the API server's machine or from the
bytes a replica on another node received, so a replica can check what it got before vLLM reads it.

The files themselves go into Ray's object store, put by the API process, which then owns them for
as long as it holds the `AdapterSource` (the adapter version's registry record): when the version is
unloaded or replaced and its record dropped, Ray frees them. Without Ray there is no source, and
replicas read the adapter's path as given.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The file a snapshot directory keeps its digest and file hashes in (written by the API server's
# snapshots and by the node cache, read by a replica to see whether a path holds a digest).
MANIFEST_FILE = "dlora-snapshot.json"
FETCH_TIMEOUT_S = 300.0  # a transfer of a large adapter from another node, with room to spare
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class AdapterSource:
    """Where a replica on any node gets an adapter version's files: `files` is a Ray ObjectRef to
    a dict {file name: bytes}, whose content has `digest`."""

    digest: str
    files: Any  # ray.ObjectRef; Ray serialises it nested in this dataclass, and the actor may get it


def digest_of_hashes(file_hashes: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(file_hashes), sort_keys=True).encode()).hexdigest()


def content_digest(files: Mapping[str, bytes]) -> str:
    return digest_of_hashes({name: hashlib.sha256(data).hexdigest() for name, data in files.items()})


def is_digest(value: str) -> bool:
    return bool(_DIGEST.fullmatch(value))


def manifest_digest(directory: str) -> str | None:
    """The digest a snapshot directory's manifest names (a read of one small file, no hashing);
    None when it has none or it cannot be read."""
    try:
        with open(f"{directory}/{MANIFEST_FILE}") as f:
            digest = json.load(f).get("sha256")
    except (OSError, ValueError, AttributeError):
        return None
    return digest if isinstance(digest, str) else None


def publish(digest: str, files: Mapping[str, bytes]) -> AdapterSource | None:
    """The files in Ray's object store, owned by this process; None when this process is no Ray
    driver (in-process or toy replicas read the path)."""
    import ray

    if not ray.is_initialized():
        return None
    return AdapterSource(digest, ray.put(dict(files)))


def fetch(source: AdapterSource) -> dict[str, bytes]:
    """The source's files, from whichever node holds them (blocking: run it off the event loop)."""
    import ray

    return ray.get(source.files, timeout=FETCH_TIMEOUT_S)
