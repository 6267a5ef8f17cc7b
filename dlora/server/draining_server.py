"""uvicorn's server with dlora's signal handling: the first SIGTERM/SIGINT drains, a second stops."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from dlora.server.drain import Drain

log = logging.getLogger(__name__)

CUT_OFF_GRACE_S = 5.0  # for the requests ended at the drain deadline to write their last event


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains (dlora.server.drain) instead of stopping
    at once, and a second one stops at once (streams then get their error event and [DONE])."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self.exit_code = 0
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and sockets:  # uvicorn names the address only for sockets it opened itself
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Replaces uvicorn's handler, which also re-raises the signal after shutting down: that would
        # turn a clean drain on SIGTERM into death by SIGTERM.
        name = signal.Signals(sig).name
        if not self.started or self.drain.draining:
            if self.drain.draining:
                log.warning("%s during the drain: stopping now", name)
                self.exit_code = 128 + sig
                self.force_exit = True
                self.drain.expire()
            self.should_exit = True
            return
        self.drain.begin()
        self._loop.call_soon_threadsafe(self._start_drain, name)

    def _start_drain(self, name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_stop(name))

    async def _drain_then_stop(self, name: str) -> None:
        d = self.drain
        log.warning(
            "%s: draining %d request(s) in flight for up to %g s (server.drain_timeout_s); new requests get 503",
            name,
            d.inflight,
            d.timeout_s,
        )
        if not await d.wait_idle(d.timeout_s):
            log.warning("drain timeout: ending %d request(s) still running", d.inflight)
            d.expire()
            await d.wait_idle(CUT_OFF_GRACE_S)
        log.info("drained; stopping the replicas")
        self.should_exit = True
