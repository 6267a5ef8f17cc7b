"""A request's deadline (`request_timeout_s` from its arrival): every wait of the request is bounded
by it, and when it passes, the open replica stream ends with `RequestTimeout`, which stops the
request's work on its replica."""

from __future__ import annotations

import asyncio

from dlora.cluster.errors import RequestTimeout
from dlora.cluster.request_state import RequestState


class Deadlines:
    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s

    def arm(self, state: RequestState) -> asyncio.TimerHandle | None:
        """Set the request's deadline and end it there; None (no timer) without a timeout."""
        if self.timeout_s is None:
            return None
        loop = asyncio.get_running_loop()
        state.deadline = loop.time() + self.timeout_s
        return loop.call_at(state.deadline, self._expire, state)

    async def in_time(self, state: RequestState, aw):
        """Await `aw` within the request's deadline."""
        if state.deadline is None:
            return await aw
        left = state.deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(0.0, left))
        except TimeoutError:
            raise self.error() from None

    def passed(self, state: RequestState) -> bool:
        return state.deadline is not None and asyncio.get_running_loop().time() >= state.deadline

    def error(self) -> RequestTimeout:
        return RequestTimeout(
            f"request did not finish within its {self.timeout_s:g} s deadline "
            "(server.request_timeout_s); its work was stopped"
        )

    def _expire(self, state: RequestState) -> None:
        state.deadline = asyncio.get_running_loop().time()  # any later wait fails at once
        if state.leg is not None:
            state.leg.interrupt(self.error())
