"""An event-driven model of a cluster's replicas: what every discipline of `migration_bound` shares
(its docstring describes the replicas' steps, admission, KV and the SLO policies).

`ModelledCluster` is dispatch at arrival (the real `ProactiveDispatch` over views of these
replicas, or the SLO-aware dispatch of `slo`: `arrival_dispatch.py` over `model_views.py`), each
request queued on the replica it was sent to; a discipline (`dlora.sim.disciplines`) changes where
requests wait and when they move through the hooks `place`, `arrived`, `waiting_queue`,
`more_to_admit`, `after_preemption`, `freed`, `moved_to`, `waited` and `tick`. The server's SLO
policies act here too: each replica's order (`slo.order`, `service_order.py`) and MuxServe's KV
quotas (`slo.kv_quotas`, with the replicas' KV in `replica_kv.py`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from dlora.cluster.dispatch import NoEligibleReplica
from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.policy_views import ReplicaView
from dlora.sim.arrival_dispatch import ArrivalDispatch
from dlora.sim.discipline_hooks import DisciplineHooks
from dlora.sim.model_io import Outcome, ReplicaModel, TraceRequest
from dlora.sim.model_views import ModelViews
from dlora.sim.replica_kv import ReplicaKv
from dlora.sim.service_order import ServiceOrder
from dlora.sim.sim_replica import SimReplica
from dlora.slo.accounting import SloAccounting
from dlora.slo.attainment import tpot_s
from dlora.slo.config import SloConfig
from dlora.slo.kv_shares import KvQuotas

# Event kinds, in the order events at one instant are handled: steps end and requests arrive
# before steps start, so requests arriving together are admitted together. A subclass's own kinds
# come after these (`event`).
STEP_END, ARRIVAL, STEP_START, WAITED, TICK = 0, 1, 2, 3, 4

__all__ = ["ARRIVAL", "STEP_END", "STEP_START", "TICK", "WAITED", "ModelledCluster", "SimReplica"]


class ModelledCluster(DisciplineHooks):
    # Proactive dispatch's start slack (None: pending time alone, dLoRA's dispatch).
    start_slack_s: float | None = None
    # Each request is sent to one replica when it arrives (and KV quotas meter it there).
    sends_at_arrival = True

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        """`oracle_lengths`: dispatch sees each request's true output length instead of the
        estimator's expectation; `slo`: the server's SLO policies (order, dispatch, KV quotas)."""
        self.slo = slo or SloConfig()
        if self.slo.kv_quotas and (model.kv_blocks is None or not self.sends_at_arrival):
            raise ValueError("kv_quotas need KV blocks (kv_blocks) and a replica per request at arrival")
        self.jobs, self.model = list(jobs), model
        self.replicas = [SimReplica(i) for i in range(replicas)]
        self.held: list[int] = []  # no replica could take them yet (the router holds them)
        self.generated = [0] * len(self.jobs)
        self.sent_at = [job.arrival for job in self.jobs]  # when its current replica got it
        self.moved = self.moved_running = 0
        self.admitted: dict[int, float] = {}  # first admission
        self.finished: dict[int, float] = {}
        self.preemptions = 0
        self.estimator = OutputLengthEstimator()
        self.params = model.cost_params()
        self.accounting = SloAccounting(self.slo, self.params)
        self.arrival = ArrivalDispatch(self.jobs, self.slo, self.params, self.accounting, self.start_slack_s)
        self.model_views = ModelViews(self.jobs, self.generated, self.sent_at, model, self.estimator, oracle_lengths)
        self.first_token: dict[int, float] = {}
        self.order = ServiceOrder(self.slo.order, self.jobs, self.generated, self.estimator)
        self.kv = ReplicaKv(self.jobs, self.generated, model, self.slo.kv_quotas)
        start = min((j.arrival for j in self.jobs), default=0.0)
        self.quotas = [KvQuotas(model.kv_blocks or 0, self.slo.quota_period_s, start) for _ in self.replicas]
        self.fairness_gaps: list[float] = []
        self.events: list[tuple[float, int, int, int]] = []  # (time, kind, seq, index)
        self.seq = 0
        self.now = 0.0  # the time of the event being handled

    def push(self, t: float, kind: int, index: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, index))

    def run(self) -> Outcome:
        for i, job in enumerate(self.jobs):
            self.push(job.arrival, ARRIVAL, i)
        self.first_events()
        while self.events:
            t, kind, _, index = heapq.heappop(self.events)
            self.now = t
            if kind == STEP_END:
                self.end_step(t, self.replicas[index])
            elif kind == ARRIVAL:
                self.arrive(t, index)
            elif kind == STEP_START:
                self.start_step(t, self.replicas[index])
            elif kind == TICK:
                self.tick(t)
            elif kind == WAITED:
                if index not in self.admitted:
                    self.waited(t, index)
            else:
                self.event(t, kind, index)
        if len(self.finished) != len(self.jobs):
            raise RuntimeError(f"{len(self.jobs) - len(self.finished)} requests never finished")
        return self.outcome()

    def outcome(self) -> Outcome:
        return Outcome(
            [self.admitted[i] - job.arrival for i, job in enumerate(self.jobs)],
            [self.finished[i] - job.arrival for i, job in enumerate(self.jobs)],
            self.preemptions,
            self.moved,
            self.moved_running,
            ttft_s=[self.first_token[i] - job.arrival for i, job in enumerate(self.jobs)],
            tpot_s=[
                tpot_s(self.first_token[i] - job.arrival, self.finished[i] - job.arrival, job.output_len)
                for i, job in enumerate(self.jobs)
            ],
            slo=self.accounting,
            fairness_gaps=self.fairness_gaps,
            infeasible_dispatches=self.arrival.infeasible,
        )

    # -- the disciplines' hooks besides `DisciplineHooks`' (here: dispatch at arrival)

    def place(self, t: float, i: int) -> int:
        """The replica request i is sent to on arrival (NoEligibleReplica: held for now)."""
        return self.choose(t, i)

    def serving(self) -> list[SimReplica]:
        """The replicas that take requests (all of them here; an elastic cluster's started ones)."""
        return self.replicas

    # -- events

    def arrive(self, t: float, i: int) -> None:
        try:
            rid = self.place(t, i)
        except NoEligibleReplica:
            self.held.append(i)
            return
        self.quotas[rid].arrived(self.jobs[i].adapter)
        self.enqueue(self.replicas[rid].queue, i)
        self.wake(t, self.replicas[rid])
        self.arrived(t, i)

    def end_step(self, t: float, r: SimReplica) -> None:
        still = []
        for i in r.running:
            self.generated[i] += 1
            self.first_token.setdefault(i, t)
            job = self.jobs[i]
            if self.generated[i] >= job.output_len:
                self.estimator.observe(job.adapter, self.generated[i])
                self.order.finished(job.adapter)
                self.finished[i] = t
                self.accounting.record(
                    job.adapter,
                    prompt_tokens=job.prompt_len,
                    ttft_s=self.first_token[i] - job.arrival,
                    latency_s=t - job.arrival,
                    output_tokens=self.generated[i],
                )
            else:
                still.append(i)
        freed = len(still) < len(r.running)
        r.running = still
        r.busy = False
        held, self.held = self.held, []
        for i in held:  # the router retries held requests, in arrival order, as work finishes
            self.arrive(t, i)
        if freed:
            self.freed(t, r)
        self.wake(t, r)

    def apply(self, t: float, moves: Sequence[tuple[str, int, int]]) -> None:
        """Abort + resubmit, as the router does: a moved request joins the receiver's queue (a
        running one gives up its KV and recomputes prompt and output there)."""
        for request_id, src, dst in moves:
            i, source = int(request_id[1:]), self.replicas[src]
            if i in source.running:
                source.running.remove(i)
                self.moved_running += 1
            elif i in source.queue:
                source.queue.remove(i)
            else:
                continue  # finished since the views were read
            self.enqueue(self.replicas[dst].queue, i)
            self.quotas[dst].arrived(self.jobs[i].adapter)  # as a resubmitted request reaches its engine
            self.sent_at[i] = t
            self.moved += 1
            self.wake(t, self.replicas[dst])
            self.moved_to(t, i)

    def wake(self, t: float, r: SimReplica) -> None:
        if not r.busy:
            r.busy = True
            self.push(t, STEP_START, r.rid)

    def wake_all(self, t: float) -> None:
        """Every idle replica looks at the queues (a request any of them may take appeared)."""
        for r in self.serving():
            self.wake(t, r)

    def start_step(self, t: float, r: SimReplica) -> None:
        self.adapt_quotas(t, r)
        self.preempt(t, r)
        queue = self.waiting_queue(r)
        new, loads = self.admit(t, r, [(i, queue) for i in self.startable(r, self.order.in_order(queue))])
        more = self.more_to_admit(t, r)
        if more:
            more_new, more_loads = self.admit(t, r, more)
            new, loads = new + more_new, loads + more_loads
        if not r.running:
            r.busy = False
            return
        c = self.model.costs
        seqs = len(r.running)
        prefill = sum(self.prefill_tokens(r, i) for i in new)
        adapters = len({self.jobs[i].adapter for i in r.running})
        r.step_ends = t + c.step(seqs, prefill, seqs, prefill, adapters) + loads * self.model.load_s
        self.push(r.step_ends, STEP_END, r.rid)

    def prefill_tokens(self, r: SimReplica, i: int) -> int:
        """Tokens request i computes when replica r admits it: its prompt and what it generated (a
        preempted or moved one recomputes them)."""
        return self.jobs[i].prompt_len + self.generated[i]

    # -- KV (`replica_kv.py`) and its quotas (`slo.kv_quotas`; rates metered in every configuration
    # for the fairness gap)

    def kv_free(self, r: SimReplica) -> float:
        return self.kv.free(r.running)

    def preempt(self, t: float, r: SimReplica) -> None:
        """As vLLM does when a step's KV does not fit: the running requests of KV-quota borrowers
        first, then those last in the replica's order (`order.key`: FCFS's latest arrival) go back
        to the queue they wait in (their KV freed, recomputed when they start again)."""
        preempted = False
        while len(r.running) > 1 and self.kv_free(r) < 0:
            borrowers = self.kv.borrowers(r.running, self.quotas[r.rid])
            self.requeue(r, max(r.running, key=lambda i: (self.jobs[i].adapter in borrowers, self.order.key(i))))
            preempted = True
        if preempted:
            self.after_preemption(t)

    def requeue(self, r: SimReplica, i: int) -> None:
        """Preempt running request i: its KV is freed and it waits to start again."""
        r.running.remove(i)
        self.enqueue(self.waiting_queue(r), i)
        self.preemptions += 1

    def enqueue(self, queue: list[int], i: int) -> None:
        bisect.insort(queue, i, key=lambda j: (self.jobs[j].arrival, j))

    def adapt_quotas(self, t: float, r: SimReplica) -> None:
        """At a period's end: the replica's quotas from the rates over it, and a fairness sample."""
        active = {self.jobs[i].adapter for i in (*r.running, *r.queue)}
        q = self.quotas[r.rid]
        if q.adapt(t, active):
            self.fairness_gaps.append(q.fairness_gap(self.kv.used(r.running)))

    def startable(self, r: SimReplica, ordered: list[int]) -> list[int]:
        """`ordered` less the requests the quotas refuse, in the order they start (`ReplicaKv.startable`)."""
        return self.kv.startable(r.running, self.quotas[r.rid], ordered)

    def reclaim(self, r: SimReplica, i: int) -> bool:
        """MuxServe's take-back for request i, within its quota but short of free blocks: preempt
        the borrowers' running requests `ReplicaKv.to_reclaim` names until i fits. False when the
        quotas give it nothing to take back."""
        victims = self.kv.to_reclaim(r.running, self.quotas[r.rid], i, self.order.key)
        if victims is None:
            return False
        for victim in victims:
            self.requeue(r, victim)
        return self.kv.blocks(i) <= self.kv_free(r)

    # -- admission

    def admit(self, t: float, r: SimReplica, candidates: list[tuple[int, list[int]]]) -> tuple[list[int], int]:
        """Start candidates (request, the queue holding it), in order, while slots and KV allow;
        returns those started and how many adapters were loaded for them."""
        m = self.model
        new: list[int] = []
        loads = 0
        free = self.kv_free(r)
        running_adapters = {self.jobs[i].adapter for i in r.running}
        for i, queue in candidates:
            if len(r.running) >= m.max_running:
                break
            a = self.jobs[i].adapter
            joins = a in running_adapters or len(running_adapters) < m.max_loras
            if self.kv.blocks(i) > free:
                if not (joins and self.reclaim(r, i)):
                    break  # vLLM stops admitting at the first request whose KV does not fit
                free = self.kv_free(r)
                running_adapters = {self.jobs[j].adapter for j in r.running}
            if not joins:
                continue
            if a not in r.resident:
                if not self.make_room(r, running_adapters):
                    continue
                loads += 1
            r.resident[a] = t
            queue.remove(i)
            running_adapters.add(a)
            r.running.append(i)
            free -= self.kv.blocks(i)
            self.admitted.setdefault(i, t)
            new.append(i)
        return new, loads

    def make_room(self, r: SimReplica, running_adapters: set[str]) -> bool:
        """Evict the least recently used adapter with no request here, if the replica is full."""
        if len(r.resident) < self.model.adapter_slots:
            return True
        busy = running_adapters | {self.jobs[i].adapter for i in r.queue}
        idle = [a for a in r.resident if a not in busy]
        if not idle:
            return False
        del r.resident[min(idle, key=r.resident.__getitem__)]
        return True

    # -- dispatch at arrival (`arrival_dispatch.py` over `model_views.py`)

    def choose(self, t: float, i: int) -> int:
        live = self.serving()
        views = [self.view(r) for r in live]
        req = self.model_views.load(i, running=False)
        return self.arrival.choose(t, views, [r.running for r in live], req, self.first_token)

    def view(self, r: SimReplica) -> ReplicaView:
        return self.model_views.view(r, self.kv_free(r), self.now)
