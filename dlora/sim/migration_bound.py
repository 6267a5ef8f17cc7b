"""What moving requests between replicas could gain over dispatch at arrival, on a given trace.

dLoRA's reactive half exists because dispatch decides once, at arrival, on estimated lengths: a
request may then wait on one replica while another frees a slot, or be preempted on a replica
whose KV fills while another has room. The natural limit of moving queued requests is *late
binding*: one queue for the whole cluster, in arrival order, each request starting on whichever
replica frees a slot for it first, with moves free and instant. The ratio

    mean queueing delay(dispatch at arrival) / mean queueing delay(other discipline)

on the same requests is then what that discipline wins over dispatch alone (dLoRA's "vs
proactive-only"). Late binding is not a strict bound: it ignores adapter grouping and KV, and
where those bind, dispatch followed by quick moves beats it; so several disciplines are run and
the best is what migration could reach. This module runs them with an event-driven model of the
replicas, cheaply and without the machine's noise:

- a replica runs continuous-batching steps: at each step start it admits queued requests in
  arrival order while it has a free running slot (`max_running`), skipping one whose adapter would
  be one distinct adapter too many for a step (`max_loras`, as vLLM does) or could not be loaded
  (`adapter_slots` full of adapters with requests there); the step lasts `StepCosts.step`
  (`dlora.sim.step_costs`, the batching simulator's model: unmerged LoRA, the `cpu-einsum` fit by
  default, plus the load time of adapters it loads; dispatch sees the same costs as the router's
  `CostParams`, `ReplicaModel.cost_params`) and gives each
  running request one token; an admitted request's first step prefills its prompt;
- `at_arrival`: each request goes, once, where the real `ProactiveDispatch` by pending time alone
  (dLoRA's dispatch, no start slack) sends it, over views of the modelled replicas with expected
  lengths from the real `OutputLengthEstimator` fed with finished requests (`oracle_lengths` gives
  dispatch the true lengths instead);
- `late_binding`: the cluster-wide queue above;
- `static` (with `homes`): each request to its adapter's one home replica, dLoRA's round-robin
  baseline over a static placement;
- `moves`: dispatch at arrival, and any replica starting a step also takes requests queued
  elsewhere that have waited `move_after_s` (oldest first): queued-request migration that reacts
  within about a step and an RPC. Late binding also wins, where waits are short, by starting a
  request at whichever replica's step boundary comes first, which no real move is quick enough
  for; `moves` leaves that out;
- `soonest_start`: dispatch at arrival as the server ships it (`cluster.dispatch_start_slack_s`):
  among the replicas with a free running slot and KV room, those whose step under way ends within
  the slack of the soonest (the model knows when each step ends; the router estimates it from when
  the replica's tokens last came and its cost model), then the least pending time; no moves;
- `balancer`: the shipped dispatch (`soonest_start`), then the shipped balancer's own planners on
  its own schedule: every `TICK_S` the queued-request planner (`migration.queued.plan_queued`:
  requests queued a tick or more, preempted ones included, to replicas that can start them), then
  dLoRA's triggers (`check_trigger`: KV, count imbalance, queueing delay; a round at most every 2 s)
  and on one, the co-migration ILP (`plan_migration`), run only when its moves are simulated to pay
  (`migration.simulated_gain.checked`, the server's default draws), whose moved running requests
  recompute their context on the receiver;
- `balancer_events`: `balancer`, and the queued-request planner also runs on events, as the
  server's balancer does (`cluster.event_moves_min_wait_s`): whenever a replica's step ends with
  requests finished (slots freed), to that replica, and when a request has waited `move_after_s`
  on the replica it was last sent to, to idle replicas; it moves requests queued `move_after_s` or
  more that the receivers can start now.

With `kv_blocks`, a replica admits a request only while its KV blocks fit, and before a step
whose growing contexts do not fit it preempts its latest-arriving running requests, as vLLM does
(they recompute prompt and output when they start again); under late binding and moves a
preempted request may restart on another replica, the ideal of moving running requests out of a
full replica. Left out: merging, and migration's own cost beyond that recompute (which only makes
the bound looser). Queueing delay is first admission minus arrival, the engines' own measure;
`Outcome` also has each request's end-to-end latency, TTFT and time per output token, and the
preemptions.

SLO-aware serving (`slo`, a `dlora.slo.config.SloConfig`; its default is everything above) runs
the server's policy code in the same model, so the policies can be compared at cluster sizes no
machine here runs:

- `order: seallm`: each replica admits its queued requests in SeaLLM's doubling-budget order
  (`dlora.slo.priority.sort_key`) instead of arrival, and a replica whose KV runs out preempts the
  running request last in that order. Each adapter's profile is the mean and deviation of its
  finished requests' lengths (the router's `OutputLengthEstimator`, cluster-wide, where the
  server keeps one per engine), the pooled lengths while it has fewer than the estimator's
  `min_samples`, and the requests' cap before 8 requests finished anywhere, as the server does.
- `dispatch: slo_feasible | best_fit`: dispatch at arrival by Aladdin's feasibility checks
  (`dlora.slo.feasible_dispatch.choose`) over the same views, each running request's seconds
  since its first token as its decode time, and each request's SLO as the accounting sets it.
- `kv_quotas`: MuxServe's per-adapter KV quotas (`dlora.slo.kv_quota.KvQuotas`, one per replica,
  fed with each request dispatched there and re-adapted every `quota_period_s`). Once a period has
  set quotas, `plan_admissions` decides each step which queued requests may start: every request
  its adapter's quota covers first, in the replica's order, then borrowers while blocks are free.
  A request within its quota that finds too few free blocks takes them back from borrowers
  (`KvQuotas.admit`'s reclaim: their running requests preempted, last in order first, as
  MuxServe's lending prescribes; the server instead leaves them to vLLM's preemption, where they
  go first), and preemption for KV growth takes borrowers' requests first.

Every finished request is judged by `dlora.slo.accounting.SloAccounting` with the isolated times of
the model's own `CostParams` (`Outcome.slo`). Every replica meters rates as the quotas do, quotas
on or off, so MuxServe's fairness gap (max |R_a - R_b|, R = KV blocks held / request rate) is
sampled at each replica's every period boundary in every configuration (`Outcome.fairness_gaps`).
"""

from __future__ import annotations

import bisect
import heapq
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dlora.cluster.dispatch import NoEligibleReplica, ProactiveDispatch
from dlora.cluster.estimators.cost_model import CostParams
from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.migration.ilp import plan_migration
from dlora.cluster.migration.queued import QueuedConfig, plan_queued
from dlora.cluster.migration.simulated_gain import checked
from dlora.cluster.migration.trigger import TriggerConfig, check_trigger
from dlora.cluster.snapshots import ClusterView, ReplicaView, RequestLoad
from dlora.config import ClusterConfig
from dlora.sim.step_costs import StepCosts, preset
from dlora.slo import feasible_dispatch
from dlora.slo.accounting import SloAccounting
from dlora.slo.attainment import tpot_s
from dlora.slo.config import SloConfig
from dlora.slo.kv_quota import AdapterName, KvQuotas, plan_admissions
from dlora.slo.priority import LengthStats, length_stats, sort_key

DISCIPLINES = ("at_arrival", "late_binding", "moves", "soonest_start", "balancer", "balancer_events")
# the disciplines that dispatch as the server does (the others: dLoRA's pending time alone)
SHIPPED_DISPATCH = ("soonest_start", "balancer", "balancer_events")
START_SLACK_S = ClusterConfig().dispatch_start_slack_s
STATIC = "static"  # the round-robin baseline over a static placement: every request at its adapter's home
MOVE_AFTER_S = 0.1  # `moves`: a queued request may move once it has waited this long (~ a step + an RPC)
# `balancer`: as bench/cluster_balancing's servers run it (monitor interval, round interval,
# count trigger; the queue-delay trigger's default)
TICK_S = 0.5
ROUND_TRIGGER = TriggerConfig(interval_s=2.0, count_imbalance=4, queue_delay_s=2.0)
CHECK_DRAWS = ClusterConfig().migration_check_draws  # the server's default


@dataclass(frozen=True)
class Job:
    """One request of the trace: arrival second, adapter, prompt tokens, the tokens it will generate."""

    arrival: float
    adapter: str
    prompt_len: int
    output_len: int
    max_tokens: int


@dataclass(frozen=True)
class ReplicaModel:
    max_running: int = 16  # vLLM max_num_seqs
    max_loras: int = 8  # distinct adapters in one step
    adapter_slots: int = 8  # adapters resident at once (max_cpu_loras)
    load_s: float = 0.02  # loading an absent adapter, paid by the step that admits it
    kv_blocks: int | None = None  # KV blocks per replica (None: KV never binds)
    block_tokens: int = 128  # tokens per KV block (vLLM's CPU block size)
    costs: StepCosts = field(default_factory=lambda: preset("cpu-einsum"))

    def cost_params(self) -> CostParams:
        """The dispatch cost model's view of these costs (what fitting measured steps converges to)."""
        c = self.costs
        return CostParams(
            per_iteration_s=c.fixed_s + c.lora_fixed_s,
            per_decode_token_s=c.per_seq_s + c.lora_per_seq_s,
            per_prefill_token_s=c.per_prefill_token_s + c.lora_per_prefill_token_s,
            adapter_load_s=self.load_s,
            max_batch=self.max_running,
        )


@dataclass
class Outcome:
    queue_s: list[float]  # per job: arrival to first admission
    latency_s: list[float]  # per job: arrival to its last token
    preemptions: int
    moved: int = 0  # `balancer`: requests its planners moved (queued ones, and running ones in rounds)
    moved_running: int = 0  # of which running, by co-migration rounds
    ttft_s: list[float] = field(default_factory=list)  # per job: arrival to its first token
    tpot_s: list[float | None] = field(default_factory=list)  # per job: Aladdin's ATGT (None: one token)
    slo: SloAccounting | None = None  # every job judged against the SLO it was held to
    fairness_gaps: list[float] = field(default_factory=list)  # MuxServe's gap, per replica and period
    infeasible_dispatches: int = 0  # `slo_feasible` / `best_fit`: no replica met every check


@dataclass
class _Replica:
    rid: int
    queue: list[int] = field(default_factory=list)  # job indices in arrival order (not late binding)
    running: list[int] = field(default_factory=list)
    resident: dict[str, float] = field(default_factory=dict)  # adapter -> last use (LRU)
    busy: bool = False  # a step is running or about to start
    step_ends: float = 0.0  # when its last step started ends


class _Model:
    def __init__(
        self,
        jobs: Sequence[Job],
        replicas: int,
        model: ReplicaModel,
        discipline: str,
        oracle_lengths: bool,
        move_after_s: float,
        homes: Mapping[str, int] | None,
        slo: SloConfig | None = None,
    ) -> None:
        if discipline not in (*DISCIPLINES, STATIC):
            raise ValueError(f"discipline {discipline!r}: choose from {', '.join((*DISCIPLINES, STATIC))}")
        if discipline == STATIC and homes is None:
            raise ValueError("discipline 'static' needs each adapter's home replica (homes)")
        self.slo = slo or SloConfig()
        if self.slo.kv_quotas and (model.kv_blocks is None or discipline == "late_binding"):
            raise ValueError("kv_quotas need KV blocks (kv_blocks) and a replica per request at arrival")
        self.homes = homes or {}
        self.jobs, self.model, self.discipline, self.oracle = list(jobs), model, discipline, oracle_lengths
        self.move_after_s = move_after_s
        self.replicas = [_Replica(i) for i in range(replicas)]
        self.central: list[int] = []  # late binding's one queue
        self.held: list[int] = []  # at_arrival: no replica could take them yet (the router holds them)
        self.generated = [0] * len(self.jobs)
        self.sent_at = [job.arrival for job in self.jobs]  # when its current replica got it
        self.last_round: float | None = None  # `balancer`: the last co-migration round
        self.moved = self.moved_running = 0
        self.admitted: dict[int, float] = {}  # first admission
        self.finished: dict[int, float] = {}
        self.preemptions = 0
        self.estimator = OutputLengthEstimator()
        self.dispatch = ProactiveDispatch(start_slack_s=START_SLACK_S if discipline in SHIPPED_DISPATCH else None)
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
        # (time, kind, seq, index): kind 0 a step ends, 1 a request arrives, 2 a step starts, 3 a
        # queued request may move (`moves`), 4 a balancer tick, 5 and up a subclass's (`event`); at
        # one instant steps start after arrivals and ends, so requests arriving together are
        # admitted together
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.now = 0.0  # the time of the event being handled

    def push(self, t: float, kind: int, index: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, index))

    def run(self) -> Outcome:
        for i, job in enumerate(self.jobs):
            self.push(job.arrival, 1, i)
        if self.discipline in ("balancer", "balancer_events") and self.jobs:
            self.push(min(j.arrival for j in self.jobs) + TICK_S, 4, 0)
        while self.events:
            t, kind, _, index = heapq.heappop(self.events)
            self.now = t
            if kind == 0:
                self.end_step(t, self.replicas[index])
            elif kind == 1:
                self.arrive(t, index)
            elif kind == 2:
                self.start_step(t, self.replicas[index])
            elif kind == 4:
                self.tick(t)
            elif kind == 3:
                if index in self.admitted:
                    pass
                elif self.discipline == "balancer_events":  # its wait crossed the threshold
                    self.event_moves(t)
                else:  # an idle replica may now take it
                    self.wake_all(t)
            else:
                self.event(t, kind, index)
        if len(self.finished) != len(self.jobs):
            raise RuntimeError(f"{len(self.jobs) - len(self.finished)} requests never finished")
        return self.outcome()

    def event(self, t: float, kind: int, index: int) -> None:
        """An event of a kind a subclass adds (5 and up)."""
        raise ValueError(f"unknown event kind {kind}")

    def serving(self) -> list[_Replica]:
        """The replicas that take requests (all of them here; an elastic cluster's started ones)."""
        return self.replicas

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

    # -- events

    def arrive(self, t: float, i: int) -> None:
        if self.discipline == "late_binding":
            self.enqueue(self.central, i)
            self.wake_all(t)
            return
        try:
            rid = self.homes[self.jobs[i].adapter] if self.discipline == STATIC else self.choose(t, i)
        except NoEligibleReplica:
            self.held.append(i)
            return
        self.quotas[rid].arrived(self.jobs[i].adapter)
        self.enqueue(self.replicas[rid].queue, i)
        self.wake(t, self.replicas[rid])
        if self.discipline in ("moves", "balancer_events"):
            self.push(self.jobs[i].arrival + self.move_after_s, 3, i)

    def end_step(self, t: float, r: _Replica) -> None:
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
        if freed and self.discipline == "balancer_events":
            self.event_moves(t, r)
        self.wake(t, r)

    def tick(self, t: float) -> None:
        """The balancer's monitor tick: queued-request moves, then a co-migration round if a
        trigger fires, each planned over the replicas' views at `t`."""
        plan = plan_queued([self.view(r) for r in self.replicas], t, QueuedConfig(min_wait_s=TICK_S))
        self.apply(t, plan.moves)
        views = [self.view(r) for r in self.replicas]
        if check_trigger(views, t, self.last_round, ROUND_TRIGGER) is not None:
            self.last_round = t
            params = {v.replica_id: self.params for v in views}
            rounds, _ = checked(
                plan_migration(ClusterView(tuple(views)), params),
                views,
                params,
                self.estimator.lengths_for,
                CHECK_DRAWS,
            )
            self.apply(t, rounds.moves)
        if len(self.finished) < len(self.jobs):
            self.push(t + TICK_S, 4, 0)

    def event_moves(self, t: float, freed: _Replica | None = None) -> None:
        """`balancer_events`: the queued-request planner at once, to idle replicas and to the one
        that just freed a slot (at its step boundary); a busy replica would make a moved request
        wait out its step, and moving there lost 3-13% against dispatch alone on fixed lengths."""
        receivers = {r.rid for r in self.replicas if not r.busy and not r.running and not r.queue}
        if freed is not None:
            receivers.add(freed.rid)
        views = [self.view(r) for r in self.replicas]
        plan = plan_queued(views, t, QueuedConfig(min_wait_s=self.move_after_s), receivers)
        self.apply(t, plan.moves)

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
            if self.discipline == "balancer_events":  # its wait there is timed afresh, as each sent leg's is
                self.push(t + self.move_after_s, 3, i)

    def wake(self, t: float, r: _Replica) -> None:
        if not r.busy:
            r.busy = True
            self.push(t, 2, r.rid)

    def wake_all(self, t: float) -> None:
        """Every idle replica looks at the queues (a request any of them may take appeared)."""
        for r in self.serving():
            self.wake(t, r)

    def start_step(self, t: float, r: _Replica) -> None:
        self.adapt_quotas(t, r)
        self.preempt(t, r)
        queue = self.central if self.discipline == "late_binding" else r.queue
        new, loads = self.admit(t, r, [(i, queue) for i in self.startable(r, self.in_order(queue))])
        if self.discipline == "moves":  # then requests that have waited long enough elsewhere
            movable = sorted(
                (
                    (self.jobs[i].arrival, i, o.queue)
                    for o in self.replicas
                    if o is not r
                    for i in o.queue
                    if t - self.jobs[i].arrival >= self.move_after_s - 1e-12
                ),
                key=lambda x: x[:2],
            )
            more, more_loads = self.admit(t, r, [(i, q) for _, i, q in movable])
            new, loads = new + more, loads + more_loads
        if not r.running:
            r.busy = False
            return
        c = self.model.costs
        seqs = len(r.running)
        prefill = sum(self.jobs[i].prompt_len + self.generated[i] for i in new)  # a preempted one recomputes
        adapters = len({self.jobs[i].adapter for i in r.running})
        r.step_ends = t + c.step(seqs, prefill, seqs, prefill, adapters) + loads * self.model.load_s
        self.push(r.step_ends, 0, r.rid)

    # -- KV

    def blocks(self, i: int) -> int:
        """KV blocks request i needs for its next step (its context and the token it generates)."""
        return -(-(self.jobs[i].prompt_len + self.generated[i] + 1) // self.model.block_tokens)

    def kv_free(self, r: _Replica) -> float:
        if self.model.kv_blocks is None:
            return float("inf")
        return self.model.kv_blocks - sum(self.blocks(i) for i in r.running)

    def kv_used(self, r: _Replica) -> dict[AdapterName, int]:
        """KV blocks each adapter's running requests hold (for their next step)."""
        used: dict[AdapterName, int] = {}
        for i in r.running:
            a = self.jobs[i].adapter
            used[a] = used.get(a, 0) + self.blocks(i)
        return used

    def preempt(self, t: float, r: _Replica) -> None:
        """As vLLM does when a step's KV does not fit: the running requests of KV-quota borrowers
        first, then those last in the replica's order (`order_key`: FCFS's latest arrival) go back
        to the queue (their KV freed, recomputed when they start again); with late binding, to
        the cluster's queue, and with moves, another replica may take them at once."""
        preempted = False
        while len(r.running) > 1 and self.kv_free(r) < 0:
            borrowers = self.borrowers(r)
            self.requeue(r, max(r.running, key=lambda i: (self.jobs[i].adapter in borrowers, self.order_key(i))))
            preempted = True
        if preempted and self.discipline in ("late_binding", "moves"):
            self.wake_all(t)

    def requeue(self, r: _Replica, i: int) -> None:
        """Preempt running request i: its KV is freed and it waits to start again."""
        r.running.remove(i)
        self.enqueue(self.central if self.discipline == "late_binding" else r.queue, i)
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

    def adapt_quotas(self, t: float, r: _Replica) -> None:
        """At a period's end: the replica's quotas from the rates over it, and a fairness sample."""
        active = {self.jobs[i].adapter for i in (*r.running, *r.queue)}
        q = self.quotas[r.rid]
        if q.adapt(t, active):
            self.fairness_gaps.append(q.fairness_gap(self.kv_used(r)))

    def quotas_set(self, r: _Replica) -> dict[AdapterName, int]:
        """The replica's quotas when they decide (`kv_quotas` on and a period has set them), else {}."""
        return self.quotas[r.rid].quotas if self.slo.kv_quotas else {}

    def borrowers(self, r: _Replica) -> set[AdapterName]:
        """Adapters holding more KV blocks here than their quota (none without quotas)."""
        quotas = self.quotas_set(r)
        return {a for a, u in self.kv_used(r).items() if quotas and u > quotas.get(a, 0)}

    def startable(self, r: _Replica, ordered: list[int]) -> list[int]:
        """`ordered` less the requests the quotas refuse, in the order they start: with quotas set,
        `plan_admissions`' (those within their adapter's quota first, then borrowers while blocks
        are free); otherwise all of them, as they are."""
        quotas = self.quotas_set(r)
        if not quotas:
            return ordered
        asks = [(str(i), self.jobs[i].adapter, self.blocks(i)) for i in ordered]
        plan = plan_admissions(asks, self.kv_used(r), quotas, self.quotas[r.rid].total_blocks)
        return [int(i) for i in plan.admitted]

    def reclaim(self, r: _Replica, i: int) -> bool:
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

    def admit(self, t: float, r: _Replica, candidates: list[tuple[int, list[int]]]) -> tuple[list[int], int]:
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

    def make_room(self, r: _Replica, running_adapters: set[str]) -> bool:
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

    def view(self, r: _Replica) -> ReplicaView:
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


def simulate(
    jobs: Sequence[Job],
    replicas: int,
    model: ReplicaModel,
    discipline: str,
    oracle_lengths: bool = False,
    move_after_s: float = MOVE_AFTER_S,
    homes: Mapping[str, int] | None = None,
    slo: SloConfig | None = None,
) -> Outcome:
    """`jobs` under `discipline`, with `slo`'s order, dispatch and KV quotas (see the module docstring)."""
    return _Model(jobs, replicas, model, discipline, oracle_lengths, move_after_s, homes, slo).run()


def capacity_rps(model: ReplicaModel, replicas: int, jobs: Sequence[Job]) -> float:
    """Requests per second `replicas` modelled replicas complete on `jobs`' lengths with every
    running slot busy: a full batch's steps for the mean output, plus each request's prefill."""
    c = model.costs
    mean_out = statistics.fmean(j.output_len for j in jobs)
    mean_prompt = statistics.fmean(j.prompt_len for j in jobs)
    b = model.max_running
    if model.kv_blocks is not None:  # as many as fit in KV at their mean context (prompt + half the output)
        b = max(1, min(b, int(model.kv_blocks * model.block_tokens // (mean_prompt + mean_out / 2))))
    step = c.step(b, 0, b, 0, model.max_loras)
    per_batch = mean_out * step + b * mean_prompt * (c.per_prefill_token_s + c.lora_per_prefill_token_s)
    return replicas * b / per_batch


def queue_delays(jobs: Sequence[Job], replicas: int, model: ReplicaModel, discipline: str, **kw) -> list[float]:
    """Each job's seconds from arrival to its first admission under `discipline`."""
    return simulate(jobs, replicas, model, discipline, **kw).queue_s


def bound(jobs: Sequence[Job], replicas: int, model: ReplicaModel, homes: Mapping[str, int] | None = None) -> dict:
    """Mean queueing delay and latency under each discipline on `jobs` (and the static baseline,
    given `homes`), each migrating discipline's gain over dispatch alone, and the best of them."""
    runs = {d: simulate(jobs, replicas, model, d) for d in DISCIPLINES}
    runs["at_arrival_oracle"] = simulate(jobs, replicas, model, "at_arrival", True)
    if homes is not None:
        runs[STATIC] = simulate(jobs, replicas, model, STATIC, homes=homes)
    means = {d: statistics.fmean(o.queue_s) for d, o in runs.items()}

    def ratio(num: str, den: str) -> float | None:
        return means[num] / means[den] if means[den] > 0 else None

    out: dict[str, Any] = {
        "mean_queue_s": means,
        "mean_latency_s": {d: statistics.fmean(o.latency_s) for d, o in runs.items()},
        "preemptions": {d: o.preemptions for d, o in runs.items()},
        "balancer_moved": runs["balancer"].moved,
        "balancer_moved_running": runs["balancer"].moved_running,
        "balancer_events_moved": runs["balancer_events"].moved,
        "gain_of_late_binding": ratio("at_arrival", "late_binding"),
        "gain_of_moves": ratio("at_arrival", "moves"),
        "gain_of_soonest_start": ratio("at_arrival", "soonest_start"),
        "gain_of_balancer": ratio("at_arrival", "balancer"),
        "gain_of_balancer_events": ratio("at_arrival", "balancer_events"),
    }
    keys = (
        "gain_of_late_binding",
        "gain_of_moves",
        "gain_of_soonest_start",
        "gain_of_balancer",
        "gain_of_balancer_events",
    )
    gains = [g for k in keys if (g := out[k]) is not None]
    out["best_gain"] = max(gains) if gains else None
    if homes is not None:  # dispatch at arrival against the static baseline
        out["dispatch_vs_static"] = ratio(STATIC, "at_arrival")
    return out
