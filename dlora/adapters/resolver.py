"""Find an adapter by name when a request names one nobody registered (vLLM's LoRA resolver idea).

A resolver maps a model name to a local directory holding a PEFT adapter, or says it has none.
What it returns is then registered exactly as an admin registration would be (same root, file,
shape and value checks, same snapshot), so a resolver only has to find files, never to judge them.

Resolvers are tried in order; the first that finds the name wins. Two ship: the filesystem one
(`<root>/<name>/adapter_config.json` under each of `server.adapter_roots`) and an S3-compatible
object store (`resolver_s3.py`). A deployment can plug in another source (a model registry) by
implementing `AdapterResolver`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Protocol

# A name is one or more path segments of safe characters ("tenant/adapter" is allowed), never an
# absolute path, "." or "..": a client chooses the name, so it must not be able to walk the disk.
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_SEGMENTS = 4


class AdapterSourceError(RuntimeError):
    """The adapter source could not be asked (network, credentials): the client may retry."""


class AdapterResolver(Protocol):
    """Where an adapter named `name` lives, as a local directory, or None when this source has none.
    May block (disk, network): it is called off the event loop. Raises AdapterValidationError when
    it found the name but will not fetch it, AdapterSourceError when the source cannot be asked."""

    # Whether what it returns must lie under server.adapter_roots (it does for files found there;
    # a downloading resolver returns dlora's own download directory).
    local_roots_apply: bool

    def resolve(self, name: str) -> str | None: ...


def is_resolvable_name(name: str) -> bool:
    """Whether a client-chosen name may be looked up at all."""
    parts = name.split("/")
    return 0 < len(parts) <= MAX_SEGMENTS and all(_SEGMENT.fullmatch(p) and p != ".." for p in parts)


class FilesystemResolver:
    """`<root>/<name>` with an `adapter_config.json`, in the first of `roots` that has one."""

    local_roots_apply = True

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = tuple(Path(r).expanduser() for r in roots)

    def resolve(self, name: str) -> str | None:
        if not is_resolvable_name(name):
            return None
        for root in self.roots:
            candidate = root / name
            if (candidate / "adapter_config.json").is_file():
                return str(candidate)
        return None
