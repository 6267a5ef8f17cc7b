"""A batch's finished lines on their way to its journal (dlora/batch/store.py), in groups.

A line's end never waits for the disk, and the event loop never does: the lines that finish within
`every_s` of each other are written together, one write and one fsync in a worker thread. A batch
of 2,500 lines its route refuses is then one fsync, not 2,500 on the event loop. After a crash the
lines of the group not yet written run again; a stop (`close`) writes every line first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

FLUSH_EVERY_S = 0.2  # a finished line reaches the disk within this, less a write's own time

Entry = tuple[int, dict]  # a line number and its output line
Write = Callable[[list[Entry]], None]  # writes a group durably (blocking: it runs in a worker thread)


class Journal:
    def __init__(self, write: Write, every_s: float = FLUSH_EVERY_S) -> None:
        self._write = write
        self._every_s = every_s
        self._pending: list[Entry] = []
        self._timer: asyncio.TimerHandle | None = None
        self._writing: asyncio.Task | None = None  # the group being written, if any

    def add(self, line: int, output: dict) -> None:
        """Journal a finished line (from the event loop): it is written with the next group."""
        self._pending.append((line, output))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._every_s, self._write_group)

    def _write_group(self) -> None:
        self._timer = None
        if self._writing is not None and not self._writing.done():
            # the previous group is still on its way to the disk: this one follows it
            self._timer = asyncio.get_running_loop().call_later(self._every_s, self._write_group)
            return
        if self._writing is not None and self._writing.exception() is not None:
            return  # the disk failed: `close` raises it, and the batch fails
        group, self._pending = self._pending, []
        self._writing = asyncio.create_task(asyncio.to_thread(self._write, group))

    async def close(self) -> None:
        """Write every line added so far; raises what a failed write raised."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._writing is not None:
            await asyncio.shield(self._writing)
        group, self._pending = self._pending, []
        if group:
            await asyncio.to_thread(self._write, group)
