"""The node-local adapter cache: content-addressed directories, verified, shared by a node's
replicas (one fetch per digest), capped in bytes without removing what a replica has loaded; and
the choice between the server's snapshot path and the cache (adapter_paths.py)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from dlora.replica.adapter_paths import AdapterPaths
from dlora.replica.adapter_source import MANIFEST_FILE, AdapterSource, content_digest, manifest_digest
from dlora.replica.errors import AdapterUnavailable
from dlora.replica.messages import AdapterRef
from dlora.replica.node_cache import NodeAdapterCache


def _files(tag: str, size: int = 1000) -> dict[str, bytes]:
    return {"adapter_config.json": json.dumps({"tag": tag}).encode(), "adapter_model.safetensors": tag.encode() * size}


class Fetches:
    def __init__(self, files: dict[str, bytes]):
        self.files, self.calls = files, 0

    def __call__(self) -> dict[str, bytes]:
        self.calls += 1
        return self.files


def test_materialise_writes_verified_files_once(tmp_path):
    files = _files("a")
    digest = content_digest(files)
    fetch = Fetches(files)
    cache = NodeAdapterCache(tmp_path, 1 << 20, "node-1")
    path = cache.materialise(digest, fetch, "a")
    assert path == tmp_path / digest
    assert {p.name: p.read_bytes() for p in path.iterdir() if p.name != MANIFEST_FILE} == files
    assert manifest_digest(str(path)) == digest
    assert cache.materialise(digest, fetch, "a") == path
    # another process on the node (a fresh cache object) finds it verified, fetching nothing
    assert NodeAdapterCache(tmp_path, 1 << 20, "node-1").materialise(digest, fetch, "a") == path
    assert fetch.calls == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".incoming-")]


def test_a_damaged_directory_is_fetched_again(tmp_path):
    files = _files("a")
    digest = content_digest(files)
    fetch = Fetches(files)
    path = NodeAdapterCache(tmp_path, 1 << 20, "n").materialise(digest, fetch, "a")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(b"changed")
    assert NodeAdapterCache(tmp_path, 1 << 20, "n").materialise(digest, fetch, "a") == path
    assert weights.read_bytes() == files["adapter_model.safetensors"]
    assert fetch.calls == 2


def test_wrong_bytes_or_a_failed_fetch_name_the_adapter_and_node(tmp_path):
    cache = NodeAdapterCache(tmp_path, 1 << 20, "10.0.0.7 (node abc)")
    digest = content_digest(_files("a"))
    with pytest.raises(AdapterUnavailable) as e:
        cache.materialise(digest, Fetches(_files("b")), "style-a")
    assert e.value.name == "style-a" and e.value.node == "10.0.0.7 (node abc)"
    assert "adapter 'style-a' is unavailable on node 10.0.0.7 (node abc): the files fetched have digest" in str(e.value)

    def broken():
        raise ConnectionError("object lost")

    with pytest.raises(AdapterUnavailable, match="fetching its files failed: ConnectionError: object lost"):
        cache.materialise(digest, broken, "style-a")
    assert not (tmp_path / digest).exists() and cache.in_use() == set()


def test_file_names_cannot_leave_the_directory(tmp_path):
    files = {"../escape": b"x"}
    with pytest.raises(AdapterUnavailable, match="refusing the file name"):
        NodeAdapterCache(tmp_path, 1 << 20, "n").materialise(content_digest(files), Fetches(files), "a")
    assert not (tmp_path.parent / "escape").exists()


def _age(path: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_eviction_by_bytes_least_recently_used_first_never_what_is_held(tmp_path):
    a, b, c = _files("a", 400), _files("b", 400), _files("c", 400)  # ~670 bytes each with the manifest
    da, db, dc = (content_digest(f) for f in (a, b, c))
    other = NodeAdapterCache(tmp_path, 1 << 20, "n")  # another replica on the node
    other.materialise(da, Fetches(a), "a")  # held by it
    mine = NodeAdapterCache(tmp_path, 1500, "n")  # two of a, b, c with their manifests fit
    mine.materialise(db, Fetches(b), "b")
    mine.release(db)
    _age(tmp_path / da, 100)  # a is the oldest but held elsewhere; b is the next oldest
    _age(tmp_path / db, 50)
    mine.materialise(dc, Fetches(c), "c")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == sorted([da, dc])
    other.release(da)
    mine.materialise(dc, Fetches(c), "c")  # held by this process: a touch, no eviction pass
    mine.release(dc)
    _age(tmp_path / dc, 10)
    d = _files("d", 100)
    mine.materialise(content_digest(d), Fetches(d), "d")
    assert not (tmp_path / da).exists()  # a, now free and the oldest, goes; c then fits beside d
    assert (tmp_path / dc).exists()


def _materialise_in_child(root: str, tag: str, log: str) -> None:
    files = _files(tag, 50_000)

    def fetch():
        with open(log, "a") as f:
            f.write("fetch\n")
        time.sleep(0.3)  # long enough for the other process to wait on the lock
        return files

    NodeAdapterCache(Path(root), 1 << 30, "n").materialise(content_digest(files), fetch, tag)


def test_two_processes_on_one_node_fetch_a_digest_once(tmp_path):
    log = tmp_path / "fetches"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_materialise_in_child, args=(str(tmp_path / "c"), "x", str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "fetch\n"


def _ref(path: str, files: dict[str, bytes], int_id: int = 1) -> AdapterRef:
    digest = content_digest(files)
    return AdapterRef("a", int_id, path, digest=digest, source=AdapterSource(digest, files))


def test_adapter_paths_use_the_servers_snapshot_where_it_is_and_the_cache_elsewhere(tmp_path):
    files = _files("a")
    fetched: list[str] = []

    def fetch(source: AdapterSource):
        fetched.append(source.digest)
        return source.files

    snapshot = NodeAdapterCache(tmp_path / "server", 1 << 20, "head").materialise(
        content_digest(files), Fetches(files), "a"
    )
    cache = NodeAdapterCache(tmp_path / "node", 1 << 20, "n2")
    paths = AdapterPaths(cache, fetch)

    async def run():
        here = await paths.local(_ref(str(snapshot), files, 1))
        elsewhere = await asyncio.gather(*(paths.local(_ref("/nowhere/a", files, 2)) for _ in range(3)))
        return here, elsewhere

    here, elsewhere = asyncio.run(run())
    assert here.path == str(snapshot)  # the same digest at the given path: read in place
    assert {r.path for r in elsewhere} == {str(tmp_path / "node" / content_digest(files))}
    assert fetched == [content_digest(files)]  # three requests, one fetch
    assert cache.in_use() == {content_digest(files)}
    paths.forget(2)
    assert cache.in_use() == set()
    no_source = AdapterRef("b", 3, "/given")
    assert asyncio.run(paths.local(no_source)) is no_source
