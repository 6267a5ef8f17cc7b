"""How much batch work may be in the engines now: batch work yields to online traffic.

The engines already admit queued batch requests after online ones (a larger engine priority)
and preempt them first when KV runs short; the gate also keeps batch requests from holding the
engines' running slots while online requests wait for one: each online request in flight takes
one batch place. With the server busy online, batch work waits; it resumes as online load falls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dlora.waits import wait_event

POLL_S = 0.05  # how often a waiting batch request looks at the online load again


def batch_room(limit: int, online_in_flight: int, batch_in_flight: int) -> int:
    """How many more batch requests may start."""
    return max(0, limit - online_in_flight - batch_in_flight)


class BatchGate:
    """Shared by every running batch. `limit()` and `online()` are read at each admission."""

    def __init__(self, limit: Callable[[], int], online: Callable[[], int]) -> None:
        self.limit = limit
        self.online = online
        self.in_flight = 0
        self._changed = asyncio.Event()

    async def acquire(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Take a place once there is room; False (and no place) if `stop()` turns true first."""
        while batch_room(self.limit(), self.online(), self.in_flight) < 1:
            if stop():
                return False
            self._changed.clear()
            await wait_event(self._changed, POLL_S)
        if stop():
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1
        self._changed.set()
