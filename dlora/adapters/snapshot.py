"""Immutable copies of registered adapters, the only adapter files an engine ever reads.

vLLM re-reads an adapter's files whenever its host LoRA cache evicted the adapter and a request
names it again, and a file that changed or vanished since registration then fails inside a step,
which kills the engine and every request in it. So registration copies the files it validates
(the config and the safetensors weights, small) into `<state_dir>/adapters/<name>-<sha256 prefix>`
and engines are given that copy: what was validated is what is served, whatever happens to the
source afterwards.

A snapshot holds a manifest of its files' hashes (checked when a persisted registration is
restored) and remembers each file's size/mtime/inode when taken (checked on every lookup: a stat,
no read), so a snapshot someone damaged fails only its own adapter's requests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dlora.adapters.validate import CONFIG_FILE, WEIGHTS_FILE
from dlora.replica.adapter_source import MANIFEST_FILE, digest_of_hashes

SNAPSHOT_FILES = (CONFIG_FILE, WEIGHTS_FILE)  # all vLLM reads of a LoRA-only PEFT adapter
STAGING_PREFIX = ".staging-"
DIGEST_CHARS = 16  # of the sha256 hex in the directory name; the manifest keeps the whole digest
_CHUNK = 1 << 20


class SnapshotError(Exception):
    """A snapshot is missing, incomplete or no longer matches its manifest."""


@dataclass(frozen=True)
class FileStamp:
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class Snapshot:
    path: Path
    sha256: str
    stamps: tuple[tuple[str, FileStamp], ...]

    @classmethod
    def of(cls, path: Path, sha256: str) -> Snapshot:
        return cls(path, sha256, tuple((f, FileStamp.of(path / f)) for f in SNAPSHOT_FILES))

    def problem(self) -> str | None:
        """Why the snapshot cannot be served any more (None: its files are as taken)."""
        for name, stamp in self.stamps:
            try:
                now = FileStamp.of(self.path / name)
            except OSError as e:
                return f"{name} is unreadable ({e.strerror or e})"
            if now != stamp:
                return f"{name} changed after registration"
        return None


def snapshot_dir_name(name: str, sha256: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64].lstrip(".") or "adapter"
    return f"{safe}-{sha256[:DIGEST_CHARS]}"


def _copy_hashing(src: Path, dst: Path) -> str:
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while chunk := fin.read(_CHUNK):
            h.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return h.hexdigest()


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _digest(file_hashes: dict[str, str]) -> str:
    return digest_of_hashes(file_hashes)  # the content identity replicas on other nodes check


def read_files(path: Path) -> dict[str, bytes]:
    """The snapshot's adapter files as bytes, what a replica on another node is sent."""
    return {f: (path / f).read_bytes() for f in SNAPSHOT_FILES}


def stage(src: Path, root: Path) -> tuple[Path, str]:
    """Copy `src`'s adapter files (symlinks resolved) into a fresh staging directory under `root`;
    return it and the content digest. The caller validates the copy, then `commit`s or discards it.
    OSError: a file could not be read or written."""
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
    try:
        hashes = {f: _copy_hashing(Path(os.path.realpath(src / f)), staged / f) for f in SNAPSHOT_FILES}
        digest = _digest(hashes)
        (staged / MANIFEST_FILE).write_text(json.dumps({"sha256": digest, "files": hashes}, indent=2))
    except BaseException:
        discard(staged)
        raise
    return staged, digest


def commit(staged: Path, root: Path, name: str, digest: str) -> Snapshot:
    """Make a validated staging directory the snapshot `<name>-<digest prefix>` (read-only files).
    An intact snapshot with the same name and content is reused as it is."""
    final = root / snapshot_dir_name(name, digest)
    if final.exists():
        try:
            if verify(final) == digest:
                discard(staged)
                return Snapshot.of(final, digest)
        except SnapshotError:
            pass
        discard(final)  # damaged: replaced by the fresh copy
    for f in (*SNAPSHOT_FILES, MANIFEST_FILE):
        os.chmod(staged / f, 0o444)
    os.replace(staged, final)
    return Snapshot.of(final, digest)


def verify(path: Path) -> str:
    """Recompute every file's hash against the manifest; return the digest or raise SnapshotError."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        hashes = {f: _hash_file(path / f) for f in SNAPSHOT_FILES}
    except (OSError, ValueError) as e:
        raise SnapshotError(f"snapshot {str(path)!r} is missing or unreadable: {e}") from None
    if not isinstance(manifest, dict) or hashes != manifest.get("files") or _digest(hashes) != manifest.get("sha256"):
        raise SnapshotError(f"snapshot {str(path)!r} does not match its manifest (its files were changed)")
    return manifest["sha256"]


def is_snapshot_path(path: str | Path, root: Path) -> bool:
    p = Path(os.path.realpath(path))
    return p.parent == Path(os.path.realpath(root))


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, keep: set[str]) -> list[str]:
    """Remove snapshot and staging directories under `root` whose names are not in `keep`."""
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.is_symlink() and entry.name not in keep:
            discard(entry)
            removed.append(entry.name)
    return removed
