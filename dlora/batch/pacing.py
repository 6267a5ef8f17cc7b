"""Batch bookkeeping that leaves the API process to online requests while any are in flight.

Reading a batch file, recording thousands of refused lines and writing a large output file take the
API process's CPU in bursts of seconds. On a machine whose cores the replicas use, and with one
interpreter lock shared by the event loop, each burst slows every online stream. While online
requests are in flight, a `Pacer` lets such work use only `share` of the time: after each slice of
work it waits `work x (1 / share - 1)`. With no online request in flight it never waits, so an idle
server does batch bookkeeping at full speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

SHARE_WHILE_ONLINE = 0.25  # of the time batch bookkeeping may work while online requests are in flight
MAX_WAIT_S = 0.5  # one wait at most: a slow slice (a disk stall) does not hold batch work for long
SLICE_ITEMS = 256  # items (lines) of a slice: a few ms of work between two chances for anything else


class Pacer:
    """Call `step()` (in a worker thread) or `await astep()` (on the event loop) after each item: every
    `every` items it pauses (`pause()`, `apause()`), which ends a slice."""

    def __init__(
        self,
        online: Callable[[], bool],
        share: float = SHARE_WHILE_ONLINE,
        clock: Callable[[], float] = time.perf_counter,
        every: int = SLICE_ITEMS,
    ) -> None:
        self.online = online
        self.share = share
        self.clock = clock
        self.every = every
        self._items = 0
        self._since = clock()

    def _slice_ends(self) -> bool:
        self._items += 1
        return self._items % self.every == 0

    def step(self) -> None:
        if self._slice_ends():
            self.pause()

    async def astep(self) -> None:
        if self._slice_ends():
            await self.apause()

    def wait_s(self) -> float:
        """How long to wait now for the work done since the last pause (0 with no online request)."""
        now = self.clock()
        work, self._since = now - self._since, now
        if not self.online():
            return 0.0
        return min(MAX_WAIT_S, work * (1 / self.share - 1))

    def pause(self) -> None:
        wait = self.wait_s()
        if wait > 0:
            time.sleep(wait)
        self._since = self.clock()

    async def apause(self) -> None:
        await asyncio.sleep(self.wait_s())  # 0: still a chance for everything else to run
        self._since = self.clock()
