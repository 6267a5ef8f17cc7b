"""The balancer loop: read replica stats, and run a co-migration round when a trigger fires.

Between ticks it also moves queued requests on events (`event_moves_min_wait_s`): when a stream
ends (a slot is free) and when a request has waited that long, so queued work reaches a free replica
within a step instead of a tick.

Every `monitor_interval_s` it refreshes the replicas' stats (for /metrics and for the views), moves
requests stuck in one replica's queue to replicas that can start them now (`migrate_queued`,
migration/queued.py: cheap, so on every tick) or, when none can and `rebalance_min_gain_s` is
set, to busy replicas where they would start sooner (migration/rebalance.py), then checks dLoRA's
triggers (KV pressure, request-count imbalance, queueing delay; at most one round per
`migration_interval_s`). Such a round solves the relaxed co-migration ILP off the event loop.
Either kind of round loads the planned adapters on their targets, then moves each planned request
(abort + resubmit, see router.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dlora.cluster.host_cache import HostCacheFull
from dlora.cluster.migration.ilp import MigrationPlan, plan_migration
from dlora.cluster.migration.problem import MigrationConfig
from dlora.cluster.migration.queued import QueuedConfig, plan_queued, queued_trigger
from dlora.cluster.migration.rebalance import RebalanceConfig, plan_rebalance, rebalance_trigger
from dlora.cluster.migration.simulated_gain import checked
from dlora.cluster.migration.trigger import Trigger, TriggerConfig, check_trigger
from dlora.cluster.placement import AdapterDemand, PlacementPlan, PlacementReplica, plan_placement
from dlora.cluster.policy_views import ClusterView, ReplicaView
from dlora.cluster.router import Router
from dlora.config import ClusterConfig
from dlora.replica.messages import AdapterRef
from dlora.slo.reopt_period import ReoptPeriod
from dlora.waits import wait_event

log = logging.getLogger(__name__)

REOPT_BETA = 0.1  # SeaLLM's beta in Eq. 8: the relative prediction error that keeps the period
EVENT_MIN_GAP_S = 0.02  # event-triggered plans at most this often (each reads every request)


@dataclass
class MigrationRound:
    trigger: Trigger
    plan: MigrationPlan
    moved: int


@dataclass
class Balancer:
    router: Router
    adapter_ref: Callable[[str], AdapterRef]  # name -> what an engine needs to load it
    cfg: ClusterConfig
    rounds: deque[MigrationRound] = field(default_factory=lambda: deque(maxlen=64))
    last_round_at: float | None = None
    last_preload_at: float | None = None
    preloads: list[PlacementPlan] = field(default_factory=list)
    # Hooks for /metrics (the balancer knows nothing of Prometheus).
    on_round: Callable[[MigrationRound], None] = lambda r: None
    on_preload: Callable[[PlacementPlan], None] = lambda p: None

    def __post_init__(self) -> None:
        # SeaLLM's adaptive re-optimisation period (cluster.reoptimize: adaptive); None when fixed.
        self.reopt: ReoptPeriod | None = None
        if self.cfg.reoptimize == "adaptive":
            self.reopt = ReoptPeriod(
                self.cfg.migration_interval_s, REOPT_BETA, self.cfg.reoptimize_min_s, self.cfg.reoptimize_max_s
            )
        self.period_started_at: float | None = None
        self._period_mark: tuple[int, int, int] = (0, 0, 0)  # (arrivals, SLO met, SLO judged) at the period's start
        self._predicted: tuple[float, float] | None = None  # the last period's (arrival rate, attainment)
        self.trigger_cfg = TriggerConfig(
            interval_s=self.cfg.migration_interval_s,
            count_imbalance=self.cfg.count_imbalance,
            queue_delay_s=self.cfg.queue_delay_s,
        )
        self.migration_cfg = MigrationConfig(
            top_k=self.cfg.migration_top_k,
            solver=self.cfg.migration_solver,
            time_limit_s=self.cfg.migration_time_limit_s,
        )
        self.queued_cfg = QueuedConfig(min_wait_s=self.cfg.queued_wait_s, kv_high=self.trigger_cfg.kv_high)
        # Queued-request moves on events as well as ticks (cluster.event_moves_min_wait_s): the
        # router wakes the loop when a stream ends (its replica has a free slot) and when a sent
        # request has waited the threshold; None: ticks only.
        self._wakeup = asyncio.Event()
        self._freed: set[int] = set()  # replicas where a stream ended since the last event plan
        self.event_queued_cfg: QueuedConfig | None = None
        wait = self.cfg.event_moves_min_wait_s
        if wait is not None and self.cfg.migration and self.cfg.migrate_queued:
            self.event_queued_cfg = QueuedConfig(min_wait_s=wait, kv_high=self.trigger_cfg.kv_high)
            self.router.legs.on_ended = self._slot_freed
            self.router.legs.on_sent = self._wake_after_wait
        gain = self.cfg.rebalance_min_gain_s
        self.rebalance_cfg = (
            None
            if gain is None
            else RebalanceConfig(min_wait_s=self.cfg.queued_wait_s, kv_high=self.trigger_cfg.kv_high, min_gain_s=gain)
        )

    def _slot_freed(self, replica_id: int) -> None:
        self._freed.add(replica_id)
        self._wakeup.set()

    def _wake_after_wait(self) -> None:
        assert self.event_queued_cfg is not None  # installed only with event moves on
        asyncio.get_running_loop().call_later(self.event_queued_cfg.min_wait_s, self._wakeup.set)

    async def _sleep_until(self, deadline: float) -> bool:
        """Until the next tick; True if an event woke the loop first."""
        if not await wait_event(self._wakeup, deadline - asyncio.get_running_loop().time()):
            return False
        self._wakeup.clear()
        return True

    async def run(self) -> None:
        """The only reader of the replicas' stats (/metrics renders what it stored), so the first
        read comes at once instead of one interval after start. Between ticks, events (a stream
        ended, a request waited `event_moves_min_wait_s`) run the queued-request moves alone."""
        loop = asyncio.get_running_loop()
        await self._read()
        next_tick = loop.time() + self.cfg.monitor_interval_s
        while True:
            if await self._sleep_until(next_tick):
                await self._on_event()
                continue
            next_tick = loop.time() + self.cfg.monitor_interval_s
            if not await self._read():
                continue
            try:
                if self.reopt is not None:
                    await self.maybe_reoptimize()
                if self.cfg.migration:
                    if self.cfg.migrate_queued:
                        await self.move_queued()
                    await self.maybe_migrate()
                if self.cfg.placement == "dynamic":
                    await self.maybe_preload()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must outlive any one bad round
                log.exception("balancer round failed")

    async def _on_event(self) -> None:
        try:
            await self.move_queued(on_event=True)
        except asyncio.CancelledError:
            raise
        except Exception:  # the loop must outlive any one bad round
            log.exception("event-triggered queued moves failed")
        await asyncio.sleep(EVENT_MIN_GAP_S)  # events coalesce: one plan per gap at most

    async def _read(self) -> bool:
        try:
            await self.router.refresh_stats()
            return True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("reading the replicas' stats failed")
            return False

    async def maybe_migrate(self) -> MigrationRound | None:
        now = self.router.clock()
        self.router.recount()  # plans start from exact sums: expected lengths moved as requests finished
        views = self.router.views()
        trigger = check_trigger(views, now, self.last_round_at, self.trigger_cfg)
        if trigger is None:
            return None
        self.last_round_at = now
        plan = await self._plan_round(views)
        return await self._run_round(trigger, plan)

    async def maybe_reoptimize(self) -> MigrationRound | None:
        """At the end of each adaptive period (SeaLLM Eq. 8): update the period from how well the
        last period's arrival rate and SLO attainment predicted this one's, then run a planned
        co-migration round (when it moves anything) and the adapter preload."""
        assert self.reopt is not None  # called only with cluster.reoptimize: adaptive
        now = self.router.clock()
        if self.period_started_at is None:
            self.period_started_at, self._period_mark = now, self._marks()
            return None
        elapsed = now - self.period_started_at
        if elapsed < self.reopt.period_s:
            return None
        measured = self._period_metrics(elapsed)
        if self._predicted is not None:
            self.reopt.update(zip(measured, self._predicted))
        self._predicted = measured  # SeaLLM predicts the next period from the last one's requests
        self.period_started_at, self._period_mark = now, self._marks()
        self.last_preload_at = None  # the preload runs with the planned round
        done = None
        if self.cfg.migration:
            self.router.recount()
            plan = await self._plan_round(self.router.views())
            if plan.moves or plan.loads:
                self.last_round_at = now
                trigger = Trigger("period", -1, f"every {self.reopt.period_s:.1f} s")
                done = await self._run_round(trigger, plan)
        if self.cfg.placement == "dynamic":
            await self.maybe_preload()
        return done

    def _marks(self) -> tuple[int, int, int]:
        counts = self.router.slo.counts().values()
        return (self.router.tally.arrivals_total, sum(c.attained for c in counts), sum(c.requests for c in counts))

    def _period_metrics(self, elapsed: float) -> tuple[float, float]:
        """(arrivals per second, share of the requests finished in it that attained their SLO)."""
        arrived, met, judged = (b - a for a, b in zip(self._period_mark, self._marks()))
        return arrived / max(elapsed, 1e-9), (met / judged if judged else 1.0)

    async def move_queued(self, on_event: bool = False) -> MigrationRound | None:
        """Requests queued on one replica go to replicas that can start them now, else (on ticks)
        to busy ones where they start sooner (a round only when some move); not gated by
        `migration_interval_s`: nothing is recomputed when they move. `on_event`: woken by a freed
        slot or a long wait, with `cluster.event_moves_min_wait_s` as the wait that counts."""
        t0 = time.perf_counter()
        self.router.recount()
        views, now = self.router.views(), self.router.clock()
        cfg = self.event_queued_cfg if on_event and self.event_queued_cfg is not None else self.queued_cfg
        receivers = None
        if on_event:  # idle replicas and those that just freed a slot: a busy one would hold a move a step
            receivers = self._freed | {v.replica_id for v in views if not v.requests}
            self._freed = set()
        queued, solver = plan_queued(views, now, cfg, receivers), "queued"
        trigger = queued_trigger(queued, cfg) if queued.moves else None
        if trigger is None and self.rebalance_cfg is not None and not on_event:
            queued, solver = plan_rebalance(views, self.router.cost_params(), now, self.rebalance_cfg), "rebalance"
            trigger = rebalance_trigger(queued, self.rebalance_cfg) if queued.moves else None
        if trigger is None:
            return None
        plan = MigrationPlan(
            moves=queued.moves,
            loads=queued.loads,
            solver=solver,
            status="planned",
            solve_ms=1000 * (time.perf_counter() - t0),
        )
        return await self._run_round(trigger, plan)

    async def _plan_round(self, views: list[ReplicaView]) -> MigrationPlan:
        """The co-migration ILP's plan, solved off the event loop, kept only if moving its running
        requests is simulated to pay (`cluster.migration_check_draws`, migration/simulated_gain.py)."""
        params = self.router.cost_params()
        # Read here, on the event loop: finished requests add to these while the solver runs.
        lengths = {a: self.router.output_lengths.lengths_for(a) for a in {r.adapter for v in views for r in v.requests}}

        def plan_and_check() -> MigrationPlan:
            plan = plan_migration(ClusterView(tuple(views)), params, self.migration_cfg)
            kept, gain = checked(plan, views, params, lambda a: lengths.get(a, ()), self.cfg.migration_check_draws)
            if kept is not plan and gain is not None:
                log.info("migration plan not run: %d move(s) simulated to cost %.3f s", len(plan.moves), -gain.median_s)
            return kept

        return await asyncio.to_thread(plan_and_check)

    async def _run_round(self, trigger: Trigger, plan: MigrationPlan) -> MigrationRound:
        moved = await self.execute(plan)
        done = MigrationRound(trigger, plan, moved)
        self.rounds.append(done)
        self.on_round(done)
        log.info(
            "migration round (%s: %s): %s in %.1f ms, moved %d of %d planned, loaded %d adapter(s)",
            trigger.reason,
            trigger.detail,
            plan.solver,
            plan.solve_ms,
            moved,
            len(plan.moves),
            len(plan.loads),
        )
        return done

    async def execute(self, plan: MigrationPlan) -> int:
        """Adapters first (a moved request must find its adapter), then the moves."""
        for adapter, replica_id in plan.loads:
            await self.router.load_on(replica_id, self.adapter_ref(adapter))
        moved = 0
        for request_id, _, dst in plan.moves:
            moved += await self.router.migrate(request_id, dst)
        return moved

    def registered_refs(self, names) -> dict[str, AdapterRef]:
        """What engines need for each of `names` still registered (an unloaded one is skipped)."""
        refs = {}
        for name in names:
            try:
                refs[name] = self.adapter_ref(name)
            except KeyError:  # AdapterNotFoundError: unloaded since its requests came
                continue
        return refs

    async def maybe_preload(self) -> PlacementPlan | None:
        """Long-term preload: copy adapters to raise the minimum burst tolerance (placement.py).

        Memory is counted in the unit the replicas' host caches count in: bytes when the router
        has a budget (`host_cache_bytes`: each adapter takes its size), else adapter slots (each
        replica holds `adapter_slots`, every adapter takes one). Replica memory is twice the
        adapter budget; a request takes one unit, which scales every tolerance alike and so
        changes no choice.
        """
        now = self.router.clock()
        if self.last_preload_at is not None and now - self.last_preload_at < self.cfg.placement_interval_s:
            return None
        self.last_preload_at = now
        rates = self.router.adapter_rates(self.cfg.placement_interval_s)
        if not rates:
            return None
        refs = self.registered_refs(rates)
        budget = self.router.cfg.host_cache_bytes or self.router.cfg.adapter_slots
        replicas = [
            PlacementReplica(
                s.replica_id,
                memory_tokens=2 * budget,
                adapter_budget_tokens=budget,
                resident=frozenset(s.loaded.values()),
            )
            for s in self.router.slots
            if s.serving
        ]
        in_bytes = self.router.cfg.host_cache_bytes is not None
        demands = [AdapterDemand(a, rates[a], size_tokens=ref.size_bytes if in_bytes else 1) for a, ref in refs.items()]
        plan = plan_placement(replicas, demands, tokens_per_request=1.0)
        for adapter, replica_id in plan.loads:
            try:
                await self.router.load_on(replica_id, refs[adapter])
            except HostCacheFull as e:  # its adapters are busy now; the next round may find room
                log.info("preload of %s on replica %d skipped: %s", adapter, replica_id, e)
        self.preloads.append(plan)
        self.on_preload(plan)
        if plan.loads:
            log.info(
                "preloaded %s (min burst tolerance %.2f -> %.2f)",
                plan.loads,
                plan.min_tolerance_before,
                plan.min_tolerance_after,
            )
        return plan
