"""Each request's queueing delay, as /metrics exports it (`dlora_request_queue_time_seconds`).

Definition (vLLM's `request_queue_time_seconds`, extended to a cluster): the seconds a request
waited before an engine first scheduled it, summed over every replica it was sent to (a migrated or
resubmitted request waits again on its new replica), plus the time the router held it before
sending it anywhere (waiting for a healthy replica). Loading its adapter before sending it is not
counted, as vLLM loads a LoRA inside the step that runs it.

Where the numbers come from: each replica's scheduler measures its part per engine request
(dlora/engine_ext/queue_waits.py) and ships it with the stats the router reads every monitor interval
and on every /metrics scrape. A request therefore often finishes before its last part arrives; its
total is observed once every part is known, i.e. at the first stats read after it finished. A part
that cannot come (the replica failed) or has not come `expiry_s` after the request finished is
replaced by the router's bound for it: from sending the request to its first token from that
replica, or to the end of that stream if no token came (an upper bound: it includes the prefill).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

EXPIRY_S = 60.0  # a finished request waits this long for its replicas' measurements

Observer = Callable[[str | None, float], None]  # (adapter, seconds), once per request


@dataclass
class _Leg:
    """The request on one replica (one engine request id)."""

    sent: float
    first_token: float | None = None
    ended: float | None = None
    measured: float | None = None  # the replica's own measurement
    lost: bool = False  # the replica failed: no measurement will come

    @property
    def known(self) -> bool:
        return self.measured is not None or self.lost

    def seconds(self, request_end: float) -> float:
        if self.measured is not None:
            return self.measured
        return max(0.0, (self.first_token or self.ended or request_end) - self.sent)


@dataclass
class _Request:
    adapter: str | None
    router_s: float = 0.0
    legs: dict[str, _Leg] = field(default_factory=dict)
    finished_at: float | None = None

    def total(self) -> float:
        end = self.finished_at if self.finished_at is not None else 0.0
        return self.router_s + sum(leg.seconds(end) for leg in self.legs.values())


class QueueTimes:
    """Per-request accounting; the router calls it, `observer` receives each request's total once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, expiry_s: float = EXPIRY_S):
        self.clock = clock
        self.expiry_s = expiry_s
        self.observer: Observer = lambda adapter, seconds: None
        self._requests: dict[str, _Request] = {}
        self._engine_ids: dict[str, str] = {}  # engine request id -> request id
        self._parked: dict[str, None] = {}  # finished, some part still unknown; oldest first

    def start(self, request_id: str, adapter: str | None) -> None:
        self._requests[request_id] = _Request(adapter)

    def router_wait(self, request_id: str, seconds: float) -> None:
        self._requests[request_id].router_s += max(0.0, seconds)

    def sent(self, request_id: str, engine_id: str) -> None:
        """The request goes to a replica as `engine_id` (its id there)."""
        self._requests[request_id].legs[engine_id] = _Leg(self.clock())
        self._engine_ids[engine_id] = request_id

    def first_token(self, engine_id: str) -> None:
        leg = self._leg(engine_id)
        if leg is not None and leg.first_token is None:
            leg.first_token = self.clock()

    def stream_ended(self, engine_id: str, lost: bool = False) -> None:
        """The replica's stream for `engine_id` ended; `lost`: the replica failed."""
        leg = self._leg(engine_id)
        if leg is None:
            return
        if leg.ended is None:
            leg.ended = self.clock()
        leg.lost = leg.lost or lost
        self._maybe_done(self._engine_ids[engine_id])

    def report(self, waits: Iterable[tuple[str, float]]) -> None:
        """A replica's measurements: (engine request id, seconds queued there)."""
        for engine_id, seconds in waits:
            leg = self._leg(engine_id)
            if leg is not None:
                leg.measured = max(0.0, seconds)
                self._maybe_done(self._engine_ids[engine_id])

    def finish(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        req.finished_at = self.clock()
        self._parked[request_id] = None
        self._maybe_done(request_id)
        self.expire()

    def expire(self) -> None:
        """Observe requests that finished `expiry_s` ago with the router's bounds for missing parts."""
        now = self.clock()
        for rid in list(self._parked):
            finished_at = self._requests[rid].finished_at
            assert finished_at is not None  # `finish` sets it before parking the request
            if now - finished_at < self.expiry_s:
                break
            self._observe(rid)

    @property
    def pending(self) -> int:
        """Requests not observed yet (in flight, or finished and waiting for a measurement)."""
        return len(self._requests)

    def _leg(self, engine_id: str) -> _Leg | None:
        rid = self._engine_ids.get(engine_id)
        return self._requests[rid].legs[engine_id] if rid is not None else None

    def _maybe_done(self, request_id: str) -> None:
        req = self._requests[request_id]
        if req.finished_at is not None and all(leg.known for leg in req.legs.values()):
            self._observe(request_id)

    def _observe(self, request_id: str) -> None:
        req = self._requests.pop(request_id)
        self._parked.pop(request_id, None)
        for engine_id in req.legs:
            self._engine_ids.pop(engine_id, None)
        self.observer(req.adapter, req.total())
