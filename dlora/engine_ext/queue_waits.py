"""How long each engine request waited in a replica's scheduler before it first ran.

Runs inside vLLM's EngineCore process.

Why in the scheduler: only the engine knows when it first scheduled a request (the router sees the
first token, i.e. queueing *and* prefill). vLLM measures the same interval (`queued_ts` to the first
`scheduled_ts`, its `request_queue_time_seconds`) only with log stats on (a scheduler stats
object built and shipped every step, per-request stats in the frontend), and it drops a request
that is aborted before its first token, which is exactly what a migration of a queued request
does. Here `scheduler.py` calls `queued` when a request enters the scheduler and `end` with the
requests each step admits and with those finished from outside (aborts, errors): a request that
never ran waited until it was aborted.
The finished intervals go into the scheduler's sample log (`samples.py`) and reach the router with
the replica's stats (`BatchingState.queue_waits`).
Resumptions after a preemption do not count: like vLLM, the wait ends at the first scheduling.
"""

from __future__ import annotations

from collections.abc import Iterable

from dlora.engine_ext.samples import QueueWait


class QueueWaits:
    def __init__(self) -> None:
        self._queued: dict[str, float] = {}  # request id -> time it entered the scheduler

    def queued(self, request_id: str, now: float) -> None:
        self._queued.setdefault(request_id, now)

    def end(self, request_ids: Iterable[str], now: float) -> list[QueueWait]:
        """The waits that end now: a step admitted these requests, or they finished from outside
        (abort, error) before they ever ran. A request whose wait already ended is left out, so
        resumptions after a preemption and aborts of running requests change nothing."""
        ended = []
        for rid in request_ids:
            since = self._queued.pop(rid, None)
            if since is not None:
                ended.append(QueueWait(rid, max(0.0, now - since)))
        return ended
