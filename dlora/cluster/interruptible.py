"""An async stream that another task can end at once, with an exception of its choosing.

Why: a replica's stream is an async generator, and an async generator can only be stopped from
the task that iterates it. A request's deadline, or a replica found hung by its stats read, must
end streams that wait on a replica which may never answer; so each stream is read by a task of
its own into a queue, and `interrupt` cancels that task (closing the replica's stream, which
aborts the request in its engine) and hands the reader the exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()


class InterruptibleStream(Generic[T]):
    def __init__(self, source: AsyncIterator[T]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(source))

    async def _pump(self, source: AsyncIterator[T]) -> None:
        try:
            async for item in source:
                self._queue.put_nowait((item, None))
            self._queue.put_nowait((_END, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the reader, raised where it reads
            self._queue.put_nowait((_END, e))

    def interrupt(self, exc: BaseException) -> None:
        """End the stream: the reader gets `exc` instead of anything still queued. No-op once the
        source has ended by itself (the reader then gets all of it)."""
        if self._task.done():
            return
        self._drain()
        self._queue.put_nowait((_END, exc))
        self._task.cancel()

    def _drain(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._items()

    async def _items(self) -> AsyncIterator[T]:
        while True:
            item, exc = await self._queue.get()
            if exc is not None:
                raise exc
            if item is _END:
                return
            yield item

    async def close(self) -> None:
        """Stop reading the source (its own clean-up runs) and wait until it has."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
