"""Which directory this replica's engine reads an adapter version from.

The API server hands out its own snapshot path with each adapter. On the server's machine that
path holds the adapter (its manifest names the version's digest) and is used as it is: one small
read per version and process. On any other node it does not, and the version's files come from
its source (Ray's object store) into the node cache (`node_cache.py`). A version without a source
(no Ray: in-process replicas) is read from its path as given.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping

from dlora.replica.adapter_source import AdapterSource, manifest_digest
from dlora.replica.messages import AdapterRef
from dlora.replica.node_cache import NodeAdapterCache


class AdapterPaths:
    def __init__(self, cache: NodeAdapterCache, fetch: Callable[[AdapterSource], Mapping[str, bytes]]):
        self.cache = cache
        self._fetch = fetch
        self._local: dict[int, AdapterRef] = {}  # int_id -> the ref with this node's path
        self._pending: dict[int, asyncio.Future[AdapterRef]] = {}
        self._cached: dict[int, str] = {}  # int_id -> digest held in the node cache for it

    async def local(self, ref: AdapterRef) -> AdapterRef:
        """`ref` with a path on this node (AdapterUnavailable when its files cannot be got here)."""
        if ref.source is None:
            return ref
        hit = self._local.get(ref.int_id)
        if hit is not None:
            return hit
        pending = self._pending.get(ref.int_id)
        if pending is None:  # one resolution per version, however many requests wait for it
            pending = self._pending[ref.int_id] = asyncio.ensure_future(self._resolve(ref))
            pending.add_done_callback(lambda _: self._pending.pop(ref.int_id, None))
        return await asyncio.shield(pending)

    async def _resolve(self, ref: AdapterRef) -> AdapterRef:
        source = ref.source
        assert source is not None
        if await asyncio.to_thread(manifest_digest, ref.path) == source.digest:
            local = ref
        else:
            path = await asyncio.to_thread(self.cache.materialise, source.digest, lambda: self._fetch(source), ref.name)
            self._cached[ref.int_id] = source.digest
            local = dataclasses.replace(ref, path=str(path))
        self._local[ref.int_id] = local
        return local

    def forget(self, int_id: int) -> None:
        """The version left the engine: its node-cache directory may go once no other version uses it."""
        self._local.pop(int_id, None)
        digest = self._cached.pop(int_id, None)
        if digest is not None and digest not in self._cached.values():
            self.cache.release(digest)
