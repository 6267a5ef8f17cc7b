"""An elastic cluster in the replica model: the autoscaler sizing it as the load moves.

The replicas are `migration_bound`'s (`dlora.sim.replica_model`), dispatched at arrival as the
server ships it (the real `ProactiveDispatch` with the default start slack, the `SoonestStart`
discipline; or the SLO-aware dispatch of `slo`); `dlora.cluster.autoscale.Autoscaler` decides at
every heartbeat from what the window measured, as the server's balancer would read it from the
replicas: arrivals, completions, output tokens generated and those of the finished requests,
whether requests waited for a slot at most step starts, SLO attainment of the requests that
finished (judged as `SloAccounting` judges them) and the mean queue wait of those admitted.

- Scale-out starts replicas (the lowest-numbered stopped ones): each is billed from the decision
  and takes requests `startup_s` later (a replica actor starting its engine and loading adapters).
- Scale-in drains the replica `drain_choice` picks: it takes no new request, its queued requests
  are dispatched again at once and its running ones moved by co-migration (each recomputes prompt
  and generated tokens on its receiver, as a moved request does), then it stops. Nothing is lost.

`replica_seconds` bills every replica from its start (or the first arrival) to its stop (or the
last finish): what a cloud bill counts. A fixed cluster of N bills N x that span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dlora.cluster.autoscale import Autoscaler, DrainCost, LoadSample, drain_choice
from dlora.cluster.dispatch import NoEligibleReplica
from dlora.config import AutoscaleConfig
from dlora.sim.disciplines import SoonestStart
from dlora.sim.model_io import Outcome, ReplicaModel, TraceRequest
from dlora.sim.replica_model import TICK, SimReplica
from dlora.slo.config import SloConfig

HEARTBEAT, STARTED = TICK + 1, TICK + 2  # event kinds after the base model's
ON, STARTING, OFF = "on", "starting", "off"


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at: float
    replicas_from: int
    replicas_to: int
    reason: str


@dataclass
class ElasticOutcome:
    outcome: Outcome
    replica_seconds: float
    span_s: float  # first arrival to last finish
    events: list[ScaleEvent] = field(default_factory=list)
    drained_requests: int = 0  # moved off replicas being removed (queued and running)
    replicas_over_time: list[tuple[float, int]] = field(default_factory=list)  # (heartbeat, billed replicas)


class _Elastic(SoonestStart):
    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        model: ReplicaModel,
        cfg: AutoscaleConfig,
        initial: int,
        startup_s: float,
        slo: SloConfig | None,
    ) -> None:
        if not cfg.min_replicas <= initial <= cfg.max_replicas:
            raise ValueError(f"initial replicas {initial}: must be in [{cfg.min_replicas}, {cfg.max_replicas}]")
        super().__init__(jobs, cfg.max_replicas, model, slo=slo)
        self.cfg, self.scaler, self.startup_s = cfg, Autoscaler(cfg), startup_s
        self.start = min((j.arrival for j in jobs), default=0.0)
        self.state = [ON if i < initial else OFF for i in range(cfg.max_replicas)]
        self.billed_since: dict[int, float] = {i: self.start for i in range(initial)}
        self.replica_seconds = 0.0
        self.scale_events: list[ScaleEvent] = []
        self.drained = 0
        self.timeline: list[tuple[float, int]] = []
        self._seen: set[int] = set()
        self._window = _Window()
        self._judged = (0, 0)  # (finished, attained) when the last heartbeat read them
        self.last_finish = self.start

    # -- the base model's hooks

    def run(self) -> Outcome:
        if self.jobs:
            self.push(self.start + self.cfg.heartbeat_s, HEARTBEAT, 0)
        return super().run()

    def serving(self) -> list[SimReplica]:
        return [r for r in self.replicas if self.state[r.rid] == ON]

    def event(self, t: float, kind: int, index: int) -> None:
        if kind == HEARTBEAT:
            self.heartbeat(t)
        elif kind == STARTED:
            self.started(t, index)
        else:
            super().event(t, kind, index)

    def arrive(self, t: float, i: int) -> None:
        if i not in self._seen:  # the router's retries of held requests are not arrivals
            self._seen.add(i)
            self._window.arrivals += 1
        super().arrive(t, i)

    def wake(self, t: float, r: SimReplica) -> None:
        if self.state[r.rid] == ON:
            super().wake(t, r)

    def admit(self, t: float, r: SimReplica, candidates: list[tuple[int, list[int]]]) -> tuple[list[int], int]:
        new, loads = super().admit(t, r, candidates)
        for i in new:
            if self.admitted[i] == t and i not in self._window.admitted:
                self._window.admitted.add(i)
                self._window.wait_s += t - self.jobs[i].arrival
        self._window.steps += 1
        self._window.queued_steps += bool(r.queue)  # requests wait here for a slot
        return new, loads

    def end_step(self, t: float, r: SimReplica) -> None:
        w = self._window
        w.tokens += len(r.running)
        w.finished_tokens += sum(n for i in r.running if (n := self.generated[i] + 1) >= self.jobs[i].output_len)
        super().end_step(t, r)
        self.last_finish = t

    # -- the autoscaler

    def heartbeat(self, t: float) -> None:
        w, self._window = self._window, _Window()
        counts = self.accounting.counts().values()
        finished = sum(c.requests for c in counts)
        attained = sum(c.attained for c in counts)
        done, met = finished - self._judged[0], attained - self._judged[1]
        self._judged = (finished, attained)
        billed = sum(1 for s in self.state if s != OFF)
        sample = LoadSample(
            now=t,
            window_s=self.cfg.heartbeat_s,
            replicas=billed,
            arrivals=w.arrivals,
            completions=done,
            tokens=w.tokens,
            finished_tokens=w.finished_tokens,
            saturated=w.steps > 0 and w.queued_steps >= w.steps / 2,
            slo_attainment=met / done if done else None,
            mean_queue_wait_s=w.wait_s / len(w.admitted) if w.admitted else None,
        )
        decision = self.scaler.decide(sample)
        if decision.replicas > billed:
            self.scale_out(t, decision.replicas - billed)
        elif decision.replicas < billed:
            self.scale_in(t, billed - decision.replicas)
        if decision.replicas != billed:
            self.scale_events.append(ScaleEvent(t, billed, decision.replicas, decision.reason))
        self.timeline.append((t, decision.replicas))
        if len(self.finished) < len(self.jobs):
            self.push(t + self.cfg.heartbeat_s, HEARTBEAT, 0)

    def scale_out(self, t: float, count: int) -> None:
        for rid in [i for i, s in enumerate(self.state) if s == OFF][:count]:
            self.state[rid] = STARTING
            self.billed_since[rid] = t
            self.push(t + self.startup_s, STARTED, rid)

    def started(self, t: float, rid: int) -> None:
        if self.state[rid] != STARTING:
            return
        self.state[rid] = ON
        held, self.held = self.held, []
        for i in held:  # requests the router held for want of a replica
            self.arrive(t, i)
        self.wake(t, self.replicas[rid])

    def scale_in(self, t: float, count: int) -> None:
        for _ in range(count):
            live = self.serving()
            if len(live) <= 1:
                return  # starting replicas are not drained; one always serves
            costs = [
                DrainCost(r.rid, len(r.queue), sum(self.jobs[i].prompt_len + self.generated[i] for i in r.running))
                for r in live
            ]
            self.drain(t, self.replicas[drain_choice(costs)])

    def drain(self, t: float, r: SimReplica) -> None:
        """Stop dispatching to `r`, move everything it holds, stop it."""
        self.state[r.rid] = OFF
        self.replica_seconds += t - self.billed_since.pop(r.rid)
        moving = [*r.running, *r.queue]
        r.running, r.queue, r.resident = [], [], {}
        self.drained += len(moving)
        for i in sorted(moving, key=lambda j: (self.jobs[j].arrival, j)):
            try:
                dst = self.choose(t, i)
            except NoEligibleReplica:
                self.held.append(i)
                continue
            self.enqueue(self.replicas[dst].queue, i)
            self.quotas[dst].arrived(self.jobs[i].adapter)
            self.sent_at[i] = t
            self.wake(t, self.replicas[dst])

    def result(self) -> ElasticOutcome:
        outcome = self.run()
        end = self.last_finish
        for since in self.billed_since.values():
            self.replica_seconds += max(0.0, end - since)
        return ElasticOutcome(
            outcome, self.replica_seconds, end - self.start, self.scale_events, self.drained, self.timeline
        )


@dataclass
class _Window:
    arrivals: int = 0
    steps: int = 0  # step starts on any replica
    queued_steps: int = 0  # of which left requests waiting for a slot
    tokens: int = 0  # output tokens generated
    finished_tokens: int = 0  # output tokens of the requests that finished
    admitted: set[int] = field(default_factory=set)
    wait_s: float = 0.0


def simulate_elastic(
    jobs: Sequence[TraceRequest],
    model: ReplicaModel,
    cfg: AutoscaleConfig,
    initial: int | None = None,
    startup_s: float = 30.0,
    slo: SloConfig | None = None,
) -> ElasticOutcome:
    """`jobs` on a cluster the autoscaler sizes between `cfg`'s bounds, from `initial` replicas
    (default: the minimum)."""
    start = cfg.min_replicas if initial is None else initial
    return _Elastic(jobs, model, cfg, start, startup_s, slo).result()
