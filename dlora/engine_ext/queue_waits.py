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
The finished intervals go to the router with the replica's stats (`BatchingState.queue_waits`).
Resumptions after a preemption do not count: like vLLM, the wait ends at the first scheduling.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

MAX_UNREAD = 65_536  # intervals kept until the next stats read (the router reads every second)


class QueueWaits:
    def __init__(self, max_unread: int = MAX_UNREAD) -> None:
        self._queued: dict[str, float] = {}  # request id -> time it entered the scheduler
        self._done: deque[tuple[str, float]] = deque(maxlen=max_unread)

    def queued(self, request_id: str, now: float) -> None:
        self._queued.setdefault(request_id, now)

    def end(self, request_ids: Iterable[str], now: float) -> None:
        """The wait of these requests ends now: a step admitted them, or they finished from outside
        (abort, error) before they ever ran. A request whose wait already ended is ignored, so
        resumptions after a preemption and aborts of running requests change nothing."""
        for rid in request_ids:
            since = self._queued.pop(rid, None)
            if since is not None:
                self._done.append((rid, max(0.0, now - since)))

    def drain(self) -> list[tuple[str, float]]:
        """(request id, seconds) of every wait that ended since the previous call."""
        out = list(self._done)
        self._done.clear()
        return out
