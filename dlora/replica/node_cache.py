"""A node-local, content-addressed copy of the adapters a node's replicas serve, capped in bytes.

vLLM reads an adapter from a directory, and a replica on another node than the API server cannot
read the server's snapshot. So the replica writes the adapter's files, fetched from wherever they
are (the fetch is given: Ray's object store in a cluster), into `root/<digest>/` on its own node,
checks them against the digest and gives vLLM that directory. A directory is complete or absent:
files go into a temporary directory under `root`, which is renamed into place once verified.

Replicas on one node share the root. Two lock files per digest (fcntl, under `root/.locks/`):
`<digest>.fetch`, held exclusively, serialises its fetch, and each process holds a shared lock on
`<digest>.lock` while an adapter of that digest is loaded in its engine: vLLM re-reads the
directory when its host cache evicted the adapter, so eviction (least recently used first, by the
directory's mtime, which each use touches) removes only directories whose `.lock` it can take
exclusively, i.e. that no process on the node holds.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from dlora.replica.adapter_source import MANIFEST_FILE, content_digest, digest_of_hashes, is_digest
from dlora.replica.errors import AdapterUnavailable

log = logging.getLogger(__name__)

LOCKS_DIR = ".locks"
TEMP_PREFIX = ".incoming-"
_CHUNK = 1 << 20

Fetch = Callable[[], Mapping[str, bytes]]


class NodeAdapterCache:
    def __init__(self, root: Path, max_bytes: int, node: str):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.node = node  # named in errors: which node could not get the adapter
        self._held: dict[str, int] = {}  # digest -> fd of its lock file, shared-locked while in use
        self._verified: set[str] = set()  # digests whose directory this process has hashed

    def materialise(self, digest: str, fetch: Fetch, name: str = "") -> Path:
        """`root/<digest>/`, fetched and verified unless it is there already; held in use by this
        process until `release`. Raises AdapterUnavailable on a fetch failure or a wrong digest."""
        label = name or digest[:16]
        if not is_digest(digest):
            raise AdapterUnavailable(label, self.node, f"{digest!r} is not a sha256 digest")
        held = self.root / digest
        if digest in self._held and held.is_dir():  # held by this process: nobody removed it
            os.utime(held)
            return held
        try:
            self._lock_dirs()
            fd = os.open(self._lock_path(digest), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                # In use from here on (taken first, so no process evicts what this one just wrote);
                # waits only while another process removes the directory.
                fcntl.flock(fd, fcntl.LOCK_SH)
                path = self._fetched_once(digest, fetch, label)
            except BaseException:
                os.close(fd)
                raise
        except OSError as e:
            raise AdapterUnavailable(label, self.node, f"cannot write under {self.root}: {e}") from None
        self.release(digest)  # a stale fd of a directory removed under this process
        self._held[digest] = fd
        os.utime(path)
        self._evict()
        return path

    def _fetched_once(self, digest: str, fetch: Fetch, label: str) -> Path:
        """The digest's directory, fetched by at most one process of the node at a time."""
        fd = os.open(self.root / LOCKS_DIR / f"{digest}.fetch", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return self._present(digest) or self._fetch_into_place(digest, fetch, label)
        finally:
            os.close(fd)

    def release(self, digest: str) -> None:
        """This process no longer needs the digest's directory (its adapter left the engine)."""
        fd = self._held.pop(digest, None)
        if fd is not None:
            os.close(fd)  # drops its shared lock

    def in_use(self) -> set[str]:
        return set(self._held)

    def _lock_dirs(self) -> None:
        (self.root / LOCKS_DIR).mkdir(parents=True, exist_ok=True)

    def _lock_path(self, digest: str) -> Path:
        return self.root / LOCKS_DIR / f"{digest}.lock"

    def _present(self, digest: str) -> Path | None:
        """The digest's directory if it holds its digest's files (hashed once per process);
        a damaged one is removed, to be fetched again."""
        path = self.root / digest
        if not path.is_dir():
            return None
        if digest in self._verified or _directory_digest(path) == digest:
            self._verified.add(digest)
            return path
        log.warning("node cache %s: %s does not match its digest; fetching it again", self.node, path)
        shutil.rmtree(path, ignore_errors=True)
        return None

    def _fetch_into_place(self, digest: str, fetch: Fetch, label: str) -> Path:
        try:
            files = fetch()
        except Exception as e:
            raise AdapterUnavailable(label, self.node, f"fetching its files failed: {type(e).__name__}: {e}") from None
        got = content_digest(files)
        if got != digest:
            raise AdapterUnavailable(label, self.node, f"the files fetched have digest {got[:16]}, not {digest[:16]}")
        incoming = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=self.root))
        try:
            _write_files(incoming, files, digest)
            os.replace(incoming, self.root / digest)
        except ValueError as e:
            shutil.rmtree(incoming, ignore_errors=True)
            raise AdapterUnavailable(label, self.node, str(e)) from None
        except BaseException:
            shutil.rmtree(incoming, ignore_errors=True)
            raise
        self._verified.add(digest)
        return self.root / digest

    def _evict(self) -> None:
        """Remove the least recently used directories no process holds until the rest fit."""
        entries = [(p, _size(p)) for p in self.root.iterdir() if p.is_dir() and is_digest(p.name)]
        total = sum(size for _, size in entries)
        for path, size in sorted(entries, key=lambda e: _mtime(e[0])):
            if total <= self.max_bytes:
                return
            if path.name not in self._held and self._remove_unheld(path):
                total -= size
        if total > self.max_bytes:
            log.warning(
                "node cache %s on %s holds %d MiB of adapters in use, over its %d MiB (engine.node_cache_mib)",
                self.root,
                self.node,
                total >> 20,
                self.max_bytes >> 20,
            )

    def _remove_unheld(self, path: Path) -> bool:
        try:
            fd = os.open(self._lock_path(path.name), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another process (replica) on the node holds it
            os.close(fd)
            return False
        try:
            shutil.rmtree(path, ignore_errors=True)
            self._verified.discard(path.name)
            return True
        finally:
            os.close(fd)


def _write_files(directory: Path, files: Mapping[str, bytes], digest: str) -> None:
    hashes = {}
    for name, data in files.items():
        if Path(name).name != name or name in ("", ".", "..", MANIFEST_FILE):
            raise ValueError(f"refusing the file name {name!r}")
        with open(directory / name, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        hashes[name] = hashlib.sha256(data).hexdigest()
    (directory / MANIFEST_FILE).write_text(json.dumps({"sha256": digest, "files": hashes}, indent=2))


def _directory_digest(path: Path) -> str | None:
    hashes = {}
    try:
        for entry in path.iterdir():
            if entry.name != MANIFEST_FILE:
                hashes[entry.name] = _hash_file(entry)
    except OSError:
        return None
    return digest_of_hashes(hashes)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _size(path: Path) -> int:
    try:
        return sum(e.stat().st_size for e in path.iterdir())
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
