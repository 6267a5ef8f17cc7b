"""An event-driven model of a cluster's replicas: what every discipline of `migration_bound` shares
(its docstring describes the replicas' steps, admission, KV and the SLO policies).

`ModelledCluster` is dispatch at arrival (the real `ProactiveDispatch` over views of these
replicas, or the SLO-aware dispatch of `slo`), each request queued on the replica it was sent
to; a discipline (`dlora.sim.disciplines`) changes where requests wait and when they move through
the hooks `place`, `arrived`, `waiting_queue`, `more_to_admit`, `after_preemption`, `freed`,
`moved_to`, `waited` and `tick`. The server's SLO policies act here too: each replica's order
(`slo.order`) and MuxServe's KV quotas (`slo.kv_quotas`).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlora.cluster import feasible_dispatch
from dlora.cluster.dispatch import NoEligibleReplica, ProactiveDispatch
from dlora.cluster.estimators.output_lengths import OutputLengthEstimator, length_stats
from dlora.cluster.policy_views import ReplicaView, RequestLoad
from dlora.sim.model_io import Outcome, ReplicaModel, TraceRequest
from dlora.slo.accounting import SloAccounting
from dlora.slo.attainment import tpot_s
from dlora.slo.config import SloConfig
from dlora.slo.kv_shares import AdapterName, KvQuotas, plan_admissions
from dlora.slo.priority import LengthStats, sort_key

# Event kinds, in the order events at one instant are handled: steps end and requests arrive
# before steps start, so requests arriving together are admitted together. A subclass's own kinds
# come after these (`event`).
STEP_END, ARRIVAL, STEP_START, WAITED, TICK = 0, 1, 2, 3, 4


@dataclass
class SimReplica:
    rid: int
    queue: list[int] = field(default_factory=list)  # job indices in arrival order (not late binding)
    running: list[int] = field(default_factory=list)
    resident: dict[str, float] = field(default_factory=dict)  # adapter -> last use (LRU)
    busy: bool = False  # a step is running or about to start
    step_ends: float = 0.0  # when its last step started ends


class ModelledCluster:
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
        self.jobs, self.model, self.oracle = list(jobs), model, oracle_lengths
        self.replicas = [SimReplica(i) for i in range(replicas)]
        self.held: list[int] = []  # no replica could take them yet (the router holds them)
        self.generated = [0] * len(self.jobs)
        self.sent_at = [job.arrival for job in self.jobs]  # when its current replica got it
        self.moved = self.moved_running = 0
        self.admitted: dict[int, float] = {}  # first admission
        self.finished: dict[int, float] = {}
        self.preemptions = 0
        self.estimator = OutputLengthEstimator()
        self.dispatch = ProactiveDispatch(start_slack_s=self.start_slack_s)
        self.params = model.cost_params()
        self.accounting = SloAccounting(self.slo, self.params)
        # each request's SLO, by its dispatch id (fixed by its adapter and prompt; dispatch asks often)
        self.slo_by_id = {f"r{i}": self.accounting.slo_of(j.adapter, j.prompt_len) for i, j in enumerate(self.jobs)}
        self.first_token: dict[int, float] = {}
        self.infeasible = 0
        # SeaLLM profiles: adapters with enough finished requests of their own (dropped at each
        # finish of theirs), and the pooled one the others use (None: recompute, a request finished)
        self.profiles: dict[str, LengthStats] = {}
        self.pooled_profile: LengthStats | None = None
        self.cap_profile = LengthStats(float(min((j.max_tokens for j in self.jobs), default=1)))
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
            infeasible_dispatches=self.infeasible,
        )

    # -- the disciplines' hooks (here: dispatch at arrival, nothing moves)

    def first_events(self) -> None:
        """Events to schedule besides the arrivals, before the first is handled."""

    def place(self, t: float, i: int) -> int:
        """The replica request i is sent to on arrival (NoEligibleReplica: held for now)."""
        return self.choose(t, i)

    def arrived(self, t: float, i: int) -> None:
        """Request i has just been queued on the replica it was sent to."""

    def waiting_queue(self, r: SimReplica) -> list[int]:
        """The queue `r` admits from, and where its preempted requests go back to."""
        return r.queue

    def more_to_admit(self, t: float, r: SimReplica) -> list[tuple[int, list[int]]]:
        """Requests `r` may also start at this step, after its own queue's (request, its queue)."""
        return []

    def after_preemption(self, t: float) -> None:
        """A replica has just preempted requests for KV."""

    def freed(self, t: float, r: SimReplica) -> None:
        """`r`'s step has just ended with requests finished: running slots are free there."""

    def moved_to(self, t: float, i: int) -> None:
        """Request i has just been moved to another replica's queue."""

    def waited(self, t: float, i: int) -> None:
        """Request i, still not admitted, reached a wait a discipline set (`WAITED`)."""

    def tick(self, t: float) -> None:
        """A periodic event a discipline set (`TICK`)."""

    def event(self, t: float, kind: int, index: int) -> None:
        """An event of a kind a subclass adds (after `TICK`)."""
        raise ValueError(f"unknown event kind {kind}")

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
                self.profiles.pop(job.adapter, None)
                self.pooled_profile = None
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
        new, loads = self.admit(t, r, [(i, queue) for i in self.startable(r, self.in_order(queue))])
        more = self.more_to_admit(t, r)
        if more:
            more_new, more_loads = self.admit(t, r, more)
            new, loads = new + more_new, loads + more_loads
        if not r.running:
            r.busy = False
            return
        c = self.model.costs
        seqs = len(r.running)
        prefill = sum(self.jobs[i].prompt_len + self.generated[i] for i in new)  # a preempted one recomputes
        adapters = len({self.jobs[i].adapter for i in r.running})
        r.step_ends = t + c.step(seqs, prefill, seqs, prefill, adapters) + loads * self.model.load_s
        self.push(r.step_ends, STEP_END, r.rid)

    # -- KV

    def blocks(self, i: int) -> int:
        """KV blocks request i needs for its next step (its context and the token it generates)."""
        return -(-(self.jobs[i].prompt_len + self.generated[i] + 1) // self.model.block_tokens)

    def kv_free(self, r: SimReplica) -> float:
        if self.model.kv_blocks is None:
            return float("inf")
        return self.model.kv_blocks - sum(self.blocks(i) for i in r.running)

    def kv_used(self, r: SimReplica) -> dict[AdapterName, int]:
        """KV blocks each adapter's running requests hold (for their next step)."""
        used: dict[AdapterName, int] = {}
        for i in r.running:
            a = self.jobs[i].adapter
            used[a] = used.get(a, 0) + self.blocks(i)
        return used

    def preempt(self, t: float, r: SimReplica) -> None:
        """As vLLM does when a step's KV does not fit: the running requests of KV-quota borrowers
        first, then those last in the replica's order (`order_key`: FCFS's latest arrival) go back
        to the queue they wait in (their KV freed, recomputed when they start again)."""
        preempted = False
        while len(r.running) > 1 and self.kv_free(r) < 0:
            borrowers = self.borrowers(r)
            self.requeue(r, max(r.running, key=lambda i: (self.jobs[i].adapter in borrowers, self.order_key(i))))
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

    # -- service order (`slo.order`)

    def profile(self, adapter: str) -> LengthStats:
        """SeaLLM's length profile of `adapter`: its own finished lengths, else the pooled ones,
        else (before `min_samples` finished anywhere) the requests' cap."""
        own = self.profiles.get(adapter)
        if own is not None:
            return own
        if self.pooled_profile is None:
            pooled = self.estimator.pooled_samples()
            enough = len(pooled) >= self.estimator.cfg.min_samples
            self.pooled_profile = LengthStats.of(pooled) if enough else self.cap_profile
        got = length_stats(self.estimator, adapter, self.pooled_profile)
        if got is not self.pooled_profile:
            self.profiles[adapter] = got
        return got

    def order_key(self, i: int) -> tuple:
        """Request i's place in its replica's order, smallest served first: arrival (fcfs) or
        SeaLLM's (O_r, arrival), then the index."""
        job = self.jobs[i]
        if self.slo.order == "fcfs":
            return (job.arrival, i)
        return (*sort_key(job.arrival, self.generated[i], self.profile(job.adapter)), i)

    def in_order(self, queue: list[int]) -> list[int]:
        """The queued requests in the order the replica admits them (queues are kept in arrival order)."""
        return list(queue) if self.slo.order == "fcfs" else sorted(queue, key=self.order_key)

    # -- KV quotas (`slo.kv_quotas`; rates metered in every configuration for the fairness gap)

    def adapt_quotas(self, t: float, r: SimReplica) -> None:
        """At a period's end: the replica's quotas from the rates over it, and a fairness sample."""
        active = {self.jobs[i].adapter for i in (*r.running, *r.queue)}
        q = self.quotas[r.rid]
        if q.adapt(t, active):
            self.fairness_gaps.append(q.fairness_gap(self.kv_used(r)))

    def quotas_set(self, r: SimReplica) -> dict[AdapterName, int]:
        """The replica's quotas when they decide (`kv_quotas` on and a period has set them), else {}."""
        return self.quotas[r.rid].quotas if self.slo.kv_quotas else {}

    def borrowers(self, r: SimReplica) -> set[AdapterName]:
        """Adapters holding more KV blocks here than their quota (none without quotas)."""
        quotas = self.quotas_set(r)
        return {a for a, u in self.kv_used(r).items() if quotas and u > quotas.get(a, 0)}

    def startable(self, r: SimReplica, ordered: list[int]) -> list[int]:
        """`ordered` less the requests the quotas refuse, in the order they start: with quotas set,
        `plan_admissions`' (those within their adapter's quota first, then borrowers while blocks
        are free); otherwise all of them, as they are."""
        quotas = self.quotas_set(r)
        if not quotas:
            return ordered
        asks = [(str(i), self.jobs[i].adapter, self.blocks(i)) for i in ordered]
        plan = plan_admissions(asks, self.kv_used(r), quotas, self.quotas[r.rid].total_blocks)
        return [int(i) for i in plan.admitted]

    def reclaim(self, r: SimReplica, i: int) -> bool:
        """MuxServe's take-back for request i, within its quota but short of free blocks: preempt
        the borrowers' running requests `KvQuotas.admit` names (each adapter's last in order
        first) until i fits. False when the quotas give it nothing to take back."""
        if not self.quotas_set(r):
            return False
        ans = self.quotas[r.rid].admit(self.jobs[i].adapter, self.blocks(i), self.kv_used(r))
        if not ans.reclaim:
            return False
        for adapter, blocks in ans.reclaim.items():
            mine = sorted((j for j in r.running if self.jobs[j].adapter == adapter), key=self.order_key)
            while blocks > 0 and mine:
                victim = mine.pop()
                blocks -= self.blocks(victim)
                self.requeue(r, victim)
        return self.blocks(i) <= self.kv_free(r)

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
            if self.blocks(i) > free:
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
            free -= self.blocks(i)
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

    # -- dispatch at arrival

    def choose(self, t: float, i: int) -> int:
        live = self.serving()
        views = [self.view(r) for r in live]
        req = self.load(i, running=False)
        if self.slo.dispatch == "least_pending":
            return self.dispatch.choose(views, req, {v.replica_id: self.params for v in views}).replica_id
        slo_replicas = [
            feasible_dispatch.SloReplica(
                v, self.params, {f"r{j}": t - self.first_token[j] for j in r.running if j in self.first_token}
            )
            for v, r in zip(views, live)
        ]
        got = feasible_dispatch.choose(
            slo_replicas,
            req,
            lambda x: self.slo_by_id[x.request_id],
            t,
            self.slo.dispatch,
            self.slo.gamma,
            self.slo.theta,
        )
        self.infeasible += not got.feasible
        return got.replica_id

    def view(self, r: SimReplica) -> ReplicaView:
        requests = tuple(self.load(i, True) for i in r.running) + tuple(self.load(i, False) for i in r.queue)
        m = self.model
        kv = 0.0 if m.kv_blocks is None else 1 - self.kv_free(r) / m.kv_blocks
        capacity = 1 << 20 if m.kv_blocks is None else m.kv_blocks * m.block_tokens
        return ReplicaView(
            r.rid,
            requests,
            resident_adapters=frozenset(r.resident),
            kv_usage=kv,
            kv_capacity_tokens=capacity,
            adapter_slots=m.adapter_slots,
            batch_adapter_slots=m.max_loras,
            max_running=m.max_running,
            step_left_s=max(0.0, r.step_ends - self.now) if r.busy else 0.0,
        )

    def load(self, i: int, running: bool) -> RequestLoad:
        job, generated = self.jobs[i], self.generated[i]
        expected = (
            float(job.output_len)
            if self.oracle
            else self.estimator.expected_total(job.adapter, generated, job.max_tokens)
        )
        return RequestLoad(
            f"r{i}",
            job.adapter,
            job.prompt_len,
            generated,
            expected,
            running,
            queued_since=self.sent_at[i],
            arrival=job.arrival,
        )
