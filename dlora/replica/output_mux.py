"""One output stream per replica, carrying every request's deltas: the router ↔ replica hop.

Why: a Ray streaming call per request turns every token of every stream into its own Ray object and
its own RPC, in the replica's process and in the router's, on the same cores as the engines. With
one stream per replica, each engine step's deltas for all its requests cross in one message (a
`Batch`), so the hop costs per step, not per token.

The replica side (`OutputMux`) collects `(request_id, item)` pairs as its requests produce them and
hands over everything ready at once; the router side (`OutputDemux`) sorts a batch into per-request
queues. Items are `Delta`s or a `StreamError` (plain data: an exception's kind and message, so no
replica-side object or traceback reaches the router). Pure asyncio, no Ray: tested without engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dlora.replica.errors import AdapterUnavailable, ReplicaFailure, RequestRejected
from dlora.replica.messages import Delta


@dataclass(frozen=True)
class StreamError:
    """A request's stream ended with an error inside the replica."""

    # "replica_failure" (resubmit elsewhere) | "rejected" (the request's own values: 400) |
    # "adapter_unavailable" (its adapter cannot be got onto the replica's node: another replica) | "error"
    kind: str
    message: str
    param: str | None = None  # rejected: the field; adapter_unavailable: the adapter
    node: str | None = None  # adapter_unavailable: the replica's node

    def exception(self, replica_id: int) -> Exception:
        if self.kind == "adapter_unavailable":
            return AdapterUnavailable(self.param or "", self.node or "", self.message)
        if self.kind == "replica_failure":
            return ReplicaFailure(f"replica {replica_id}: {self.message}")
        if self.kind == "rejected":
            return RequestRejected(self.message, self.param)
        return RuntimeError(f"replica {replica_id}: {self.message}")


Item = Delta | StreamError
Batch = list[tuple[str, Item]]


class OutputMux:
    """Replica side: requests `put` their items; one reader takes every ready item per `batches` step."""

    def __init__(self) -> None:
        self._ready: Batch = []
        self._wake = asyncio.Event()
        self._reader = 0  # a newer reader (the router reconnected) ends the older one

    def put(self, request_id: str, item: Item) -> None:
        self._ready.append((request_id, item))
        self._wake.set()

    async def batches(self) -> AsyncIterator[Batch]:
        self._reader += 1
        me = self._reader
        while me == self._reader:
            await self._wake.wait()
            self._wake.clear()
            if me != self._reader:
                self._wake.set()  # the newer reader takes what is ready
                return
            batch, self._ready = self._ready, []
            if batch:
                yield batch


class OutputDemux:
    """Router side: one queue per open request; a batch's items go to their requests' queues.

    Items for a request no longer open (it was aborted, moved or its client left) are dropped. A
    failed stream fails every request opened under it (`fail_epoch`); requests opened after the stream
    was replaced belong to the new one.
    """

    def __init__(self) -> None:
        self._queues: dict[str, tuple[int, asyncio.Queue[Item | BaseException]]] = {}
        self.epoch = 0

    def open(self, request_id: str) -> asyncio.Queue[Item | BaseException]:
        q: asyncio.Queue[Item | BaseException] = asyncio.Queue()
        self._queues[request_id] = (self.epoch, q)
        return q

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def deliver(self, batch: Batch) -> None:
        for request_id, item in batch:
            entry = self._queues.get(request_id)
            if entry is not None:
                entry[1].put_nowait(item)

    def fail_epoch(self, epoch: int, error: BaseException) -> None:
        for epoch_of, q in self._queues.values():
            if epoch_of == epoch:
                q.put_nowait(error)

    def __len__(self) -> int:
        return len(self._queues)
