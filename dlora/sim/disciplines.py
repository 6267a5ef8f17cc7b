"""Where a request waits and when it may move: one class per discipline `migration_bound` compares.

Each is `replica_model.ModelledCluster` (dispatch at arrival, every request queued where it was
sent) with its hooks overridden; `dlora.sim.migration_bound` describes what each stands for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dlora.cluster.migration.ilp import plan_migration
from dlora.cluster.migration.queued import QueuedConfig, plan_queued
from dlora.cluster.migration.simulated_gain import checked
from dlora.cluster.migration.trigger import TriggerConfig, check_trigger
from dlora.cluster.policy_views import ClusterView
from dlora.config import ClusterConfig
from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.sim.replica_model import TICK, WAITED, ModelledCluster, SimReplica
from dlora.slo.config import SloConfig

START_SLACK_S = ClusterConfig().dispatch_start_slack_s  # the server's dispatch default
MOVE_AFTER_S = 0.1  # a queued request may move once it has waited this long (~ a step + an RPC)


class AtArrival(ModelledCluster):
    """dLoRA's dispatch: once, at arrival, by estimated pending time alone (no start slack)."""

    name = "at_arrival"


class Static(ModelledCluster):
    """The round-robin baseline over a static placement: every request at its adapter's home."""

    name = "static"

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        homes: Mapping[str, int] | None,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        if homes is None:
            raise ValueError("discipline 'static' needs each adapter's home replica (homes)")
        self.homes = homes
        super().__init__(jobs, replicas, model, oracle_lengths=oracle_lengths, slo=slo)

    def place(self, t: float, i: int) -> int:
        return self.homes[self.jobs[i].adapter]


class LateBinding(ModelledCluster):
    """One queue for the whole cluster, in arrival order: a request starts on whichever replica
    frees a slot for it first, and a preempted one may restart anywhere."""

    name = "late_binding"
    sends_at_arrival = False

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        super().__init__(jobs, replicas, model, oracle_lengths=oracle_lengths, slo=slo)
        self.central: list[int] = []

    def arrive(self, t: float, i: int) -> None:
        self.enqueue(self.central, i)
        self.wake_all(t)

    def waiting_queue(self, r: SimReplica) -> list[int]:
        return self.central

    def after_preemption(self, t: float) -> None:
        self.wake_all(t)


class Moves(ModelledCluster):
    """Dispatch at arrival; a replica starting a step also takes requests queued elsewhere that
    have waited `move_after_s` (oldest first), and an idle one looks for them when they have."""

    name = "moves"

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        move_after_s: float = MOVE_AFTER_S,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        super().__init__(jobs, replicas, model, oracle_lengths=oracle_lengths, slo=slo)
        self.move_after_s = move_after_s

    def arrived(self, t: float, i: int) -> None:
        self.push(self.jobs[i].arrival + self.move_after_s, WAITED, i)

    def waited(self, t: float, i: int) -> None:
        self.wake_all(t)  # an idle replica may now take it

    def more_to_admit(self, t: float, r: SimReplica) -> list[tuple[int, list[int]]]:
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
        return [(i, q) for _, i, q in movable]

    def after_preemption(self, t: float) -> None:
        self.wake_all(t)


class SoonestStart(ModelledCluster):
    """Dispatch at arrival as the server ships it: among the replicas with a free running slot
    and KV room, those whose step under way ends within the start slack of the soonest, then the
    least pending time; no moves."""

    name = "soonest_start"
    start_slack_s = START_SLACK_S


class Balancer(SoonestStart):
    """The shipped dispatch, then the shipped balancer's planners on its schedule: every `tick_s`
    the queued-request planner, then dLoRA's triggers and on one the co-migration ILP, run only
    when its moves are simulated to pay (`check_draws` draws)."""

    name = "balancer"

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        tick_s: float,
        trigger: TriggerConfig,
        check_draws: int,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        super().__init__(jobs, replicas, model, oracle_lengths=oracle_lengths, slo=slo)
        self.tick_s, self.trigger, self.check_draws = tick_s, trigger, check_draws
        self.last_round: float | None = None  # the last co-migration round

    def first_events(self) -> None:
        if self.jobs:
            self.push(min(j.arrival for j in self.jobs) + self.tick_s, TICK, 0)

    def tick(self, t: float) -> None:
        """The balancer's monitor tick: queued-request moves, then a co-migration round if a
        trigger fires, each planned over the replicas' views at `t`."""
        plan = plan_queued([self.view(r) for r in self.replicas], t, QueuedConfig(min_wait_s=self.tick_s))
        self.apply(t, plan.moves)
        views = [self.view(r) for r in self.replicas]
        if check_trigger(views, t, self.last_round, self.trigger) is not None:
            self.last_round = t
            params = {v.replica_id: self.params for v in views}
            rounds, _ = checked(
                plan_migration(ClusterView(tuple(views)), params),
                views,
                params,
                self.estimator.lengths_for,
                self.check_draws,
            )
            self.apply(t, rounds.moves)
        if len(self.finished) < len(self.jobs):
            self.push(t + self.tick_s, TICK, 0)


class BalancerEvents(Balancer):
    """`Balancer`, and the queued-request planner also runs on events, as the server's balancer
    does: when a replica's step ends with slots freed, to that replica, and when a request has
    waited `move_after_s` on the replica it was last sent to, to idle replicas."""

    name = "balancer_events"

    def __init__(
        self,
        jobs: Sequence[TraceRequest],
        replicas: int,
        model: ReplicaModel,
        *,
        tick_s: float,
        trigger: TriggerConfig,
        check_draws: int,
        move_after_s: float = MOVE_AFTER_S,
        oracle_lengths: bool = False,
        slo: SloConfig | None = None,
    ) -> None:
        super().__init__(
            jobs,
            replicas,
            model,
            tick_s=tick_s,
            trigger=trigger,
            check_draws=check_draws,
            oracle_lengths=oracle_lengths,
            slo=slo,
        )
        self.move_after_s = move_after_s

    def arrived(self, t: float, i: int) -> None:
        self.push(self.jobs[i].arrival + self.move_after_s, WAITED, i)

    def waited(self, t: float, i: int) -> None:
        self.event_moves(t)  # its wait crossed the threshold

    def freed(self, t: float, r: SimReplica) -> None:
        self.event_moves(t, r)

    def moved_to(self, t: float, i: int) -> None:
        self.push(t + self.move_after_s, WAITED, i)  # its wait there is timed afresh, as each sent leg's is

    def event_moves(self, t: float, freed: SimReplica | None = None) -> None:
        """The queued-request planner at once, to idle replicas and to the one that just freed a
        slot (at its step boundary); a busy replica would make a moved request wait out its step,
        and moving there lost 3-13% against dispatch alone on fixed lengths."""
        receivers = {r.rid for r in self.replicas if not r.busy and not r.running and not r.queue}
        if freed is not None:
            receivers.add(freed.rid)
        views = [self.view(r) for r in self.replicas]
        plan = plan_queued(views, t, QueuedConfig(min_wait_s=self.move_after_s), receivers)
        self.apply(t, plan.moves)
