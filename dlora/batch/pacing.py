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


class Pacer:
    """Call `pause()` (in a worker thread) or `await apause()` (on the event loop) between slices."""

    def __init__(
        self,
        online: Callable[[], bool],
        share: float = SHARE_WHILE_ONLINE,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.online = online
        self.share = share
        self.clock = clock
        self._since = clock()

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
