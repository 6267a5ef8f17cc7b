"""Runs the autoscaler (autoscale.py) against the router: measures, decides, adds and drains replicas.

Every `tick_s` (the balancer's monitor interval) it looks at the router's queue: the requests
assigned to a replica and not yet admitted there, and how long each has waited. Every
`heartbeat_s` it turns what it saw into a `LoadSample` (arrivals, tokens and finished requests from
the router's running totals, SLO attainment from its accounting, queue pressure from the ticks),
asks `Autoscaler.decide`, and acts:

- scale out: a new replica actor (the factory places it on free cores or a GPU), started, with the
  pinned adapters and the adapters most requested over the last rate window preloaded; it counts
  as a replica from the decision on, so a start that takes a minute is not asked for twice;
- scale in: the serving replica whose work is cheapest to move (`drain_choice`: the fewest context
  tokens to recompute, then the fewest queued requests) is drained (`Router.drain`): dispatch
  skips it, its requests move by co-migration, and it stops once empty;
- a scale-out decided while a replica drains takes that replica back first (the drain is
  cancelled, it serves again) instead of starting a new one; a replica an operator drains
  (`drain`, reason "operator": the admin API's `POST /v1/replicas/{id}/drain`) is never taken
  back, since it is going away on purpose (a node to service): the scale-out starts a new one.

Each change is a `ScaleEvent` (`events`, and `on_event` for /metrics). The replica counts every
decision is made on are the serving and starting replicas; draining ones no longer count.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dlora.cluster.autoscale import AutoscaleConfig, Autoscaler, DrainCost, LoadSample, ScaleDecision, drain_choice
from dlora.cluster.router import Replica, Router
from dlora.replica.messages import AdapterRef

log = logging.getLogger(__name__)

OPERATOR = "operator"  # the reason of a drain asked for through the admin API


@dataclass(frozen=True)
class ScaleEvent:
    at: float  # router clock when it was decided
    direction: str  # "out" | "in"
    replica_id: int
    replicas_before: int
    replicas_after: int
    reason: str  # the decision's: "min", "max", "rate", "slo", "queue", "idle"; or "operator"
    seconds: float  # to start (out) or to drain and stop (in)
    moved: int = 0  # requests a drain moved off the replica
    ok: bool = True
    error: str = ""


@dataclass
class _Window:
    """What the ticks of one heartbeat saw, and the router's totals at its start."""

    started: float
    arrivals: int
    tokens: int
    finished: int
    finished_tokens: int
    attained: int
    judged: int
    ticks: int = 0
    saturated_ticks: int = 0
    queue_ages: list[float] = field(default_factory=list)


class ElasticCluster:
    def __init__(
        self,
        router: Router,
        cfg: AutoscaleConfig,
        make_replica: Callable[[int], Replica],
        release_replica: Callable[[int], None] = lambda replica_id: None,
        preload: Callable[[], list[AdapterRef]] = list,
        tick_s: float = 1.0,
        on_event: Callable[[ScaleEvent], None] = lambda e: None,
    ) -> None:
        self.router, self.cfg = router, cfg
        self.autoscaler = Autoscaler(cfg)
        self.make_replica, self.release_replica = make_replica, release_replica
        self.preload, self.on_event = preload, on_event
        self.tick_s = tick_s
        self.starting: dict[int, asyncio.Task] = {}
        self.draining: dict[int, asyncio.Task] = {}
        self.drain_reasons: dict[int, str] = {}  # of the replicas in `draining`
        self.events: deque[ScaleEvent] = deque(maxlen=256)
        self.decisions: deque[tuple[LoadSample, ScaleDecision]] = deque(maxlen=256)
        self._window = self._open_window(router.clock())

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
                if self.router.clock() - self._window.started >= self.cfg.heartbeat_s:
                    self.heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad heartbeat
                log.exception("autoscaler heartbeat failed")

    async def close(self) -> None:
        tasks = [*self.starting.values(), *self.draining.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def serving(self) -> int:
        """Replicas the decisions count: every replica not draining, starting and rebuilding ones
        included (each holds its cores or GPU)."""
        ids = {s.replica_id for s in self.router.slots if not s.draining}
        return len(ids | set(self.starting))

    # ---- measuring ------------------------------------------------------------------------
    def _open_window(self, now: float) -> _Window:
        r = self.router
        counts = r.slo.counts().values()
        return _Window(
            started=now,
            arrivals=r.tally.arrivals_total,
            tokens=r.tally.output_tokens_total,
            finished=r.tally.finished_total,
            finished_tokens=r.tally.finished_tokens_total,
            attained=sum(c.attained for c in counts),
            judged=sum(c.requests for c in counts),
        )

    def tick(self) -> None:
        """One look at the queue: how long the requests not yet admitted on a replica have waited."""
        now = self.router.clock()
        ages = [now - since for since in self.router.table.waiting_since()]
        w = self._window
        w.ticks += 1
        w.saturated_ticks += any(a >= self.tick_s for a in ages)  # waited past one tick: no free slot
        w.queue_ages.extend(ages)

    def sample(self) -> LoadSample:
        """The heartbeat's measurements (closes the window and opens the next)."""
        now = self.router.clock()
        w, nxt = self._window, self._open_window(now)
        self._window = nxt
        judged = nxt.judged - w.judged
        return LoadSample(
            now=now,
            window_s=max(now - w.started, 1e-9),
            replicas=self.serving(),
            arrivals=nxt.arrivals - w.arrivals,
            completions=nxt.finished - w.finished,
            tokens=nxt.tokens - w.tokens,
            finished_tokens=nxt.finished_tokens - w.finished_tokens,
            saturated=w.ticks > 0 and 2 * w.saturated_ticks >= w.ticks,
            slo_attainment=(nxt.attained - w.attained) / judged if judged else None,
            mean_queue_wait_s=statistics.fmean(w.queue_ages) if w.queue_ages else None,
        )

    # ---- deciding and acting --------------------------------------------------------------
    def heartbeat(self) -> ScaleDecision:
        s = self.sample()
        d = self.autoscaler.decide(s)
        self.decisions.append((s, d))
        if d.replicas > s.replicas:
            for _ in range(d.replicas - s.replicas):
                self.scale_out(d.reason)
        elif d.replicas < s.replicas:
            for _ in range(s.replicas - d.replicas):
                self.scale_in(d.reason)
        return d

    def scale_out(self, reason: str) -> int:
        """Take a draining replica back if there is one, else start a new one; returns its id."""
        back = [rid for rid in self.draining if self.drain_reasons.get(rid) != OPERATOR]
        if back:
            rid = back[0]
            before = self.serving()
            self.draining.pop(rid).cancel()  # Router.drain stops moving its requests
            self.drain_reasons.pop(rid, None)
            slot = self.router.find_slot(rid)
            if slot is not None:
                slot.draining = False  # serving again now (the task may not have run at all yet)
            self._emit(ScaleEvent(self.router.clock(), "out", rid, before, before + 1, reason, 0.0))
            return rid
        rid = self.router.pool.reserve_id()
        before = self.serving()
        self.starting[rid] = asyncio.create_task(self._start(rid, reason, before))
        return rid

    async def _start(self, rid: int, reason: str, before: int) -> None:
        t0 = self.router.clock()
        try:
            await self.router.add_replica(self.make_replica(rid), self.preload())
        except asyncio.CancelledError:
            self.release_replica(rid)
            raise
        except Exception as e:
            log.error("autoscaler: replica %d failed to start: %s", rid, e)
            self.release_replica(rid)
            seconds = self.router.clock() - t0
            self._emit(ScaleEvent(t0, "out", rid, before, before, reason, seconds, ok=False, error=str(e)))
            return
        finally:
            self.starting.pop(rid, None)
        self._emit(ScaleEvent(t0, "out", rid, before, before + 1, reason, self.router.clock() - t0))

    def scale_in(self, reason: str) -> int | None:
        """Drain the serving replica whose work is cheapest to move; None if none can go."""
        serving = [s for s in self.router.slots if s.serving]
        if len(serving) <= 1:
            return None
        ids = {s.replica_id for s in serving}
        self.router.recount()
        costs = [
            DrainCost(
                v.replica_id,
                queued=sum(1 for r in v.requests if not r.running),
                running_context_tokens=sum(r.prompt_tokens + r.output_tokens for r in v.requests if r.running),
            )
            for v in self.router.views()
            if v.replica_id in ids
        ]
        rid = drain_choice(costs)
        self.drain(rid, reason)
        return rid

    def drain(self, rid: int, reason: str = OPERATOR) -> None:
        """Drain replica `rid` and remove it once empty. Raises `LookupError` for a replica this
        cluster does not have, `ValueError` for one not serving (starting, down, draining) or the
        last serving one (its work would have nowhere to go)."""
        slot = self.router.find_slot(rid)
        if slot is None:
            raise LookupError(f"no replica {rid}")
        if not slot.serving:
            state = "draining" if slot.draining else "not healthy"
            raise ValueError(f"replica {rid} is not serving ({state}): nothing to drain")
        if not any(s.serving for s in self.router.slots if s is not slot):
            raise ValueError(f"replica {rid} is the last serving replica: its work would have nowhere to go")
        before = self.serving()
        slot.draining = True  # out of dispatch and of the count now, not when the task runs
        self.drain_reasons[rid] = reason
        self.draining[rid] = asyncio.create_task(self._drain(rid, reason, before))

    async def _drain(self, rid: int, reason: str, before: int) -> None:
        t0 = self.router.clock()
        try:
            result = await self.router.drain(rid, self.cfg.drain_timeout_s)
        except asyncio.CancelledError:
            raise  # taken back into service (scale_out recorded it)
        except Exception as e:
            log.error("autoscaler: draining replica %d failed: %s", rid, e)
            self.draining.pop(rid, None)
            self.drain_reasons.pop(rid, None)
            seconds = self.router.clock() - t0
            self._emit(ScaleEvent(t0, "in", rid, before, before, reason, seconds, ok=False, error=str(e)))
            return
        self.draining.pop(rid, None)
        self.drain_reasons.pop(rid, None)
        self.release_replica(rid)
        if result.forced:
            log.warning("replica %d drained with %d request(s) failing over at its deadline", rid, result.forced)
        self._emit(ScaleEvent(t0, "in", rid, before, before - 1, reason, result.seconds, moved=result.moved))

    def _emit(self, event: ScaleEvent) -> None:
        self.events.append(event)
        log.info(
            "autoscaler: scale-%s replica %d (%s): %d -> %d replicas in %.1f s%s",
            event.direction,
            event.replica_id,
            event.reason,
            event.replicas_before,
            event.replicas_after,
            event.seconds,
            "" if event.ok else f", failed: {event.error}",
        )
        self.on_event(event)
