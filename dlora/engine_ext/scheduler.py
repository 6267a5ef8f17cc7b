"""The batching policy inside vLLM's scheduler (`scheduler_cls`): one decision per engine step.

Runs inside vLLM's EngineCore process. This module holds the vLLM overrides; what they decide is
in pure modules beside it, each tested without an engine.

Each `schedule()`:
1. one `RequestView` per unfinished request (running and waiting) -> `policy.decide()`, made safe
   (`step_plan.py`): merges vetoed while the worker hooks are missing or after a failed merge,
   unmerged FCFS when the step could not progress, batch work never beside online work, at most
   `max_loras` adapters running;
2. the requests not allowed are hidden from vLLM's queues while `super().schedule()` runs, then put
   back (`queue_hiding.py`): they keep their KV blocks and RUNNING status and are never preempted;
3. if the weights must change, in-band `SwitchCommand`s go on this step's SchedulerOutput, so the
   worker changes the weights right before the forward pass of exactly the batch chosen for them.
   While adapter X is merged, other requests run in the same step only if the engine mixes
   (`mixed_merged`, needs dlora's LoRA backends: the worker's LoRA layers then subtract X's delta
   from every other token, see punica_wrapper.py). Without mixing (the default, and always with the
   `vllm` backend) only X's requests are ever scheduled: a base or other-adapter request on merged
   weights would compute wrong outputs and cache wrong KV under its normal prefix hash;
4. prefix-cache hits are limited to blocks computed in the weight state the step runs in
   (`prefix_filter.py`, wrapping `kv_cache_manager.get_computed_blocks`).

`update_from_output()` records the state of the blocks the step completed, reads the worker's
`SwitchReport`s into the `WeightTracker` (`weight_state.py`: a failed merge leaves the base weights;
a report missing, late or unsure makes them UNKNOWN and nothing runs until their restore is
confirmed) and feeds `policy.observe()` the measured step and switch times.

The policy's name and parameters arrive through vLLM's `additional_config`
(`engine_keys.BATCHING_CONFIG_KEY`); mixing is turned off when the replica's LoRA backend
(`DLORA_LORA_BACKEND`) is `vllm`, and at `dlora_setup` when a worker reports it cannot compensate.
Importing this module in the engine-core process (vLLM does, to resolve `scheduler_cls`) adds two
EngineCore utilities, reached with `engine_core.call_utility_async(...)`: `dlora_setup` (install
the worker hooks, enable switching) and `dlora_batching_state` (the `BatchingState` message, with
the measured samples after the number the caller names, `samples.py`: reading changes nothing).

GPU note: this subclasses the synchronous `Scheduler`. vLLM forces synchronous scheduling on CPU;
`engine.build_engine_args` also turns `async_scheduling` off elsewhere, since with `AsyncScheduler`
the next step is scheduled before the previous one's reports (a failed merge) are known.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.sched.request_queue import RequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from dlora import env
from dlora.engine_ext import grammar_replay, prefix_filter, queue_hiding, samples, step_plan
from dlora.engine_ext.inband import CMDS_ATTR, REPORTS_ATTR, SwitchCommand, SwitchReport
from dlora.engine_ext.kv_quotas import EngineKvQuotas
from dlora.engine_ext.prefix_states import UNMERGED, PrefixStates, State
from dlora.engine_ext.queue_waits import QueueWaits
from dlora.engine_ext.samples import QueueWait, SampleLog
from dlora.engine_ext.step_plan import Plan
from dlora.engine_ext.step_trace import adapter_counts, open_trace
from dlora.engine_ext.weight_state import UNKNOWN, Weights, WeightTracker, known, split_reports, weights_after
from dlora.replica.engine_keys import BACKGROUND_PRIORITY_KEY, BATCHING_CONFIG_KEY
from dlora.replica.messages import BatchingState
from dlora.scheduling import BatchingConfig, IterationStats, Mode, RequestView, make_policy
from dlora.scheduling.lora_slots import LoraSlotAging

log = logging.getLogger(__name__)


def policy_from(additional_config, lora_backend: str) -> tuple[str, BatchingConfig]:
    settings = dict((additional_config or {}).get(BATCHING_CONFIG_KEY) or {"policy": "unmerged"})
    name = settings.pop("policy")
    return name, BatchingConfig(**settings).for_lora_backend(lora_backend)


def background_from(additional_config) -> int | None:
    """The engine priority from which requests are background work (None: none are)."""
    return dict(additional_config or {}).get(BACKGROUND_PRIORITY_KEY)


def without_mixing(config: BatchingConfig) -> BatchingConfig:
    return dataclasses.replace(config, mixed_merged=False)


def _view(r: Request, client_priority: int) -> RequestView:
    return RequestView(
        req_id=r.request_id,
        adapter=_adapter(r),
        arrival_time=r.arrival_time,
        num_prompt_tokens=r.num_prompt_tokens,
        num_computed_tokens=r.num_computed_tokens,
        num_output_tokens=r.num_output_tokens,
        running=r.status == RequestStatus.RUNNING,
        max_tokens=r.max_tokens,
        priority=client_priority,
    )


def _adapter(r: Request) -> str | None:
    return r.lora_request.lora_name if r.lora_request else None


def _loras(requests: Iterable[Request]) -> dict[str, step_plan.Lora]:
    return {
        r.request_id: step_plan.Lora(lr.lora_name, lr.lora_int_id, lr.lora_path)
        for r in requests
        if (lr := r.lora_request) is not None
    }


@dataclass
class _Step:
    started: float
    cmds: list[SwitchCommand]
    restricted: bool  # some unfinished requests were hidden
    weights: Weights = None  # adapter merged for this step, as planned
    before: Weights = None  # adapter merged before it
    trace: dict | None = None  # what the step trace records at schedule time (step_trace.py)

    @property
    def restoring(self) -> bool:
        """A step of `Restore` (nothing scheduled, the weights unknown)."""
        return self.weights is UNKNOWN


class DloraScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        name, config = policy_from(self.vllm_config.additional_config, env.DLORA_LORA_BACKEND.get())
        self.batching_policy = make_policy(name, config)
        self._dlora_policy_name = name
        self._dlora_mixing = config.mixed_merged  # other requests may run while an adapter is merged
        # The policy serves in an order other than FCFS (scheduling.order): vLLM's queues follow it.
        self._dlora_service_order = config.order != "fcfs"
        self._dlora_client_priority: dict[str, int] = {}  # what each request's client asked for
        # Requests from this priority on are background (batch) work: no step runs them beside online ones.
        self._dlora_background_from = background_from(self.vllm_config.additional_config)
        # MuxServe's per-adapter KV quotas (kv_quotas.py): always measured (the fairness gap),
        # enforced with scheduling.kv_quotas.
        blocks = self.cache_config.num_gpu_blocks
        assert blocks is not None  # EngineCore sizes the KV cache before it builds the scheduler
        self._dlora_kv_quotas = EngineKvQuotas(blocks, self.block_size, config.kv_quota_period_s, time.monotonic())
        self._dlora_kv_enforce = config.kv_quotas
        if config.kv_quotas:
            self._dlora_service_order = True  # borrowers go last in vLLM's preemption order
        self._dlora_max_batch = max(1, min(config.max_batch, self.max_num_running_reqs))
        self._dlora_max_loras = self.lora_config.max_loras if self.lora_config else None
        # A request waiting for a LoRA batch slot gets one after config.lora_slot_starve_s (lora_slots.py).
        self._dlora_slot_aging = (
            LoraSlotAging(self._dlora_max_loras, config.lora_slot_starve_s)
            if self._dlora_max_loras and config.lora_slot_starve_s is not None
            else None
        )
        self._dlora_switching = False  # the worker hooks are installed (dlora_setup)
        self._dlora_worker = WeightTracker()  # the worker's weights and their switches (weight_state.py)
        self._dlora_step: _Step | None = None
        self._dlora_stalled = False
        self._dlora_preemptions = 0  # running requests vLLM preempted for KV room (each recomputes on resume)
        # Each step's cost (the router's per-replica cost model, dlora/cluster/estimators/replica_cost.py)
        # and each request's wait before its first step (queue_waits.py), numbered (samples.py).
        self._dlora_samples = SampleLog()
        self._dlora_warm = False  # whether a step has run (the first one is not a cost sample)
        self._dlora_queue_waits = QueueWaits()
        # Weight state of the cached KV blocks (docstring, 4.); None without prefix caching.
        self._dlora_prefix: PrefixStates | None = None
        self._dlora_lookup_state: State = UNMERGED  # the state this step's cache hits must have
        self._dlora_lineage: prefix_filter.Lineages = {}
        self._dlora_trace = open_trace(env.DLORA_STEP_TRACE.get())
        if self.kv_cache_manager.enable_caching:
            self._dlora_prefix = PrefixStates()
            self._dlora_vllm_computed_blocks = self.kv_cache_manager.get_computed_blocks
            # A vLLM seam (engine_ext/__init__.py): this manager's cache hits are filtered by weight
            # state. Replacing the method on the instance is deliberate (hence the ignore).
            self.kv_cache_manager.get_computed_blocks = self._dlora_computed_blocks  # type: ignore[method-assign]
        log.info("dlora batching policy %r: %s", name, config)

    # ---- control (EngineCore utilities) ------------------------------------------------------

    def dlora_enable_switching(self, workers_mix: bool) -> None:
        """Let the policy merge; `workers_mix`: every worker compensates a merged adapter."""
        if self._dlora_mixing and not workers_mix:
            log.warning("the workers cannot compensate a merged adapter: mixed merged steps are off")
            config = without_mixing(self.batching_policy.config)
            self.batching_policy = make_policy(self._dlora_policy_name, config)
            self._dlora_mixing = False
        self._dlora_switching = True

    def dlora_batching_state(self, since: int = 0) -> BatchingState:
        """The batching state now, with the samples numbered after `since` (samples.py)."""
        snap, worker = self.batching_policy.snapshot(), self._dlora_worker
        merged = known(worker.weights)
        num_blocks = self.cache_config.num_gpu_blocks
        assert num_blocks is not None  # EngineCore sizes the KV cache before it builds the scheduler
        steps, waits = samples.split(self._dlora_samples.since(since))
        return BatchingState(
            policy=snap.policy,
            mode=(Mode.MERGED if merged else Mode.UNMERGED).value,
            merged_adapter=merged,
            num_switches=worker.switches,
            merge_failures=worker.failures,
            switch_times={op: h.times() for op, h in worker.times.items()},
            credits={("" if a is None else a): c for a, c in snap.credits.items()},
            starving=tuple(sorted("" if a is None else a for a in snap.starving)),
            alpha=snap.alpha,
            beta=snap.beta,
            switch_cost=snap.switch_cost,
            # queue state for the balancer's views and /metrics
            kv_usage=self.kv_cache_manager.usage,
            kv_capacity_tokens=num_blocks * self.block_size,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            iterations=steps,
            queue_waits=waits,
            lora_slot_drains=self._dlora_slot_aging.drains if self._dlora_slot_aging else 0,
            kv_fairness_gap=self._dlora_kv_quotas.fairness_gap(),
            preemptions=self._dlora_preemptions,
            # Preempted (KV ran out) and back in the waiting queue: they re-prefill when resumed,
            # and the router must not count them as running (dispatch's prefill, queued moves).
            preempted=tuple(r.request_id for r in self.waiting if r.status == RequestStatus.PREEMPTED),
            weights=worker.state(),
            weight_restores=worker.restores,
            mixed_merged=self._dlora_mixing,
            samples_seq=self._dlora_samples.seq,
        )

    def _preempt_request(self, request, timestamp: float, *args, **kwargs) -> None:
        # Counted here because vLLM keeps only a per-request count, which leaves with the request.
        self._dlora_preemptions += 1
        super()._preempt_request(request, timestamp, *args, **kwargs)

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False):
        started = time.perf_counter()
        requests = [*self.running, *self.waiting, *self.kv_holding_waiting]
        if not requests:
            return super().schedule(throttle_prefills)
        worker = self._dlora_worker
        plan = Plan([], UNKNOWN, worker.restore_commands()) if worker.weights is UNKNOWN else self._dlora_plan(requests)
        if self._dlora_service_order:
            self._dlora_apply_order(plan.visible, requests)
        self._dlora_lookup_state = prefix_filter.state_of(plan.target)
        out, restricted = self._dlora_schedule_visible(plan.visible, throttle_prefills)
        if plan.cmds:
            setattr(out, CMDS_ATTR, plan.cmds)
        step = _Step(started, plan.cmds, restricted, plan.target, worker.weights)
        if self._dlora_trace is not None:
            step.trace = {"unfinished": adapter_counts(_adapter(r) for r in requests), "allowed": len(plan.visible)}
        worker.weights = plan.target  # corrected by the worker's reports (_dlora_observe)
        self._dlora_step = step
        self._dlora_waits_ended(self._dlora_queue_waits.end((r.req_id for r in out.scheduled_new_reqs), started))
        return out

    def add_request(self, request: Request) -> None:
        self._dlora_kv_quotas.arrived(request)
        # Kept as given: with a service order the request's own priority becomes its place.
        self._dlora_client_priority[request.request_id] = request.priority
        super().add_request(request)
        self._dlora_queue_waits.queued(request.request_id, time.perf_counter())

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        self._dlora_waits_ended(self._dlora_queue_waits.end((r.request_id for r in finished), time.perf_counter()))
        return finished

    def _dlora_waits_ended(self, waits: list[QueueWait]) -> None:
        for wait in waits:
            self._dlora_samples.append(wait)

    def _handle_blocked_waiting_request(self, request: Request) -> bool:
        compiling = request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        ready = super()._handle_blocked_waiting_request(request)
        if ready and compiling and not grammar_replay.replay(self.structured_output_manager, request):
            self.grammar_compile_error_reqs.add(request.request_id)  # vLLM ends it with an error
            return False
        return ready

    def _free_request(self, request: Request, *args, **kwargs):
        # Every finished request passes here (stopped, capped or aborted); finish_requests sees
        # only the aborted ones.
        self._dlora_client_priority.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        ended = time.perf_counter()
        step, self._dlora_step = self._dlora_step, None
        if step is not None and step.trace is not None:  # before vLLM drops the finished requests
            step.trace["scheduled"] = adapter_counts(
                _adapter(self.requests[rid]) for rid in scheduler_output.num_scheduled_tokens if rid in self.requests
            )
        if step is not None and self._dlora_prefix is not None:
            # Before vLLM frees the blocks of the requests that finish in this step.
            self._dlora_record_blocks(scheduler_output, step, self._dlora_ran(step, model_runner_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if step is not None:
            self._dlora_observe(step, scheduler_output, model_runner_output, ended)
        prefix_filter.prune(self._dlora_lineage, self.requests)
        return outputs

    # ---- deciding (step_plan.py) -------------------------------------------------------------

    def _dlora_plan(self, requests: list[Request]) -> Plan:
        client = self._dlora_client_priority
        views = [_view(r, client.get(r.request_id, r.priority)) for r in requests]
        now = time.time()  # the clock of vLLM's arrival_time
        decision = step_plan.checked_decision(
            self.batching_policy, views, now, self._dlora_max_batch, self._dlora_mixing
        )
        target, allowed = step_plan.select(decision, views, self._dlora_guard())
        running = {v.req_id for v in views if v.running}
        by_id = {r.request_id: r for r in requests}
        allowed = self._dlora_kv_quotas.admissible(allowed, by_id, running, self._dlora_kv_enforce, time.monotonic())
        if target is None and self._dlora_slot_aging is not None:
            allowed = step_plan.without(allowed, self._dlora_slot_aging.held_back(views, now))
        loras = _loras(requests)
        lora = step_plan.lora_named(loras, target) if target is not None else None
        visible = step_plan.fit_lora_slots(allowed, loras, running, self._dlora_max_loras, lora and lora.int_id)
        # known(): the weights are known here (unknown ones take the restore's plan)
        worker = self._dlora_worker
        return Plan(visible, target, step_plan.switch_commands(known(worker.weights), lora, worker.next_seq))

    def _dlora_guard(self) -> step_plan.Guard:
        return step_plan.Guard(
            weights=known(self._dlora_worker.weights),
            switching=self._dlora_switching,
            blocked=self._dlora_worker.blocked_at(time.monotonic()),
            stalled=self._dlora_stalled,
            free_slot=len(self.running) + self.num_waiting_for_streaming_input < self.max_num_active_reqs,
            background_from=self._dlora_background_from,
        )

    # ---- vLLM's queues (queue_hiding.py) -------------------------------------------------------

    def _dlora_apply_order(self, visible: list[str], requests: list[Request]) -> None:
        """Serve in the policy's order: each request's priority becomes its place, then the
        waiting queues are rebuilt (they are heaps keyed at entry)."""
        borrowers = self._dlora_kv_quotas.borrowers() if self._dlora_kv_enforce else set()
        order = queue_hiding.service_order(requests, self._dlora_client_priority, borrowers, _adapter, visible)
        for position, r in enumerate(order):
            r.priority = position
        self.waiting = self._dlora_queue(self.waiting)
        self.kv_holding_waiting = self._dlora_queue(self.kv_holding_waiting)

    def _dlora_queue(self, requests: Iterable[Request]) -> RequestQueue:
        queue = create_request_queue(self.policy)
        for r in requests:
            queue.add_request(r)
        return queue

    def _dlora_schedule_visible(self, visible_order: list[str], throttle_prefills: bool):
        visible = set(visible_order)
        running = self.running
        shown_running, hidden_running = queue_hiding.split(running, visible)
        shown_waiting, hidden_waiting = queue_hiding.split(self.waiting, visible)
        shown_holding, hidden_holding = queue_hiding.split(self.kv_holding_waiting, visible)
        if not (hidden_running or hidden_waiting or hidden_holding):
            return super().schedule(throttle_prefills), False
        self.running = shown_running
        self.waiting = self._dlora_queue(queue_hiding.in_rank_order(shown_waiting, visible_order))
        self.kv_holding_waiting = self._dlora_queue(shown_holding)
        self.max_num_active_reqs -= len(hidden_running)  # hidden running requests still hold a model-runner slot
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs += len(hidden_running)
            self.running = queue_hiding.running_after(running, self.running, visible)
            for r in hidden_waiting:
                self.waiting.add_request(r)
            for r in hidden_holding:
                self.kv_holding_waiting.add_request(r)
        return out, True

    # ---- prefix cache (prefix_filter.py) -------------------------------------------------------

    def _dlora_computed_blocks(self, request: Request):
        """vLLM's `KVCacheManager.get_computed_blocks`, hits limited to this step's weight state.

        Returns vLLM's (blocks, num_computed_tokens, shared_prefix_boundary). Nothing is ref-counted
        yet (`allocate_slots` touches the blocks the scheduler finally adopts), so a shorter or
        substituted block list is as valid as vLLM's own.
        """
        found = self._dlora_vllm_computed_blocks(request)
        blocks, num_tokens, _ = found
        ledger, kvm = self._dlora_prefix, self.kv_cache_manager
        assert ledger is not None  # this lookup is installed only with prefix caching (__init__)
        pool = kvm.block_pool.blocks
        kept = prefix_filter.usable_hit(
            blocks.blocks, num_tokens, self._dlora_lookup_state, ledger, lambda block_id: pool[block_id].block_hash
        )
        if kept is None:
            return found
        ids, tokens = kept
        if not ids:
            return kvm.empty_kv_cache_blocks, 0, 0
        # A single group has no shared-prefix junction (the boundary is 0).
        return kvm.create_kv_cache_blocks(([pool[i] for i in ids],)), tokens, 0

    @staticmethod
    def _dlora_ran(step: _Step, model_runner_output) -> Weights:
        """The weights the step actually ran on, as far as its reports tell (weight_state.py)."""
        mine, _ = split_reports(step.cmds, getattr(model_runner_output, REPORTS_ATTR, None) or ())
        return weights_after(step.cmds, mine, step.weights)

    def _dlora_record_blocks(self, scheduler_output, step: _Step, ran: Weights) -> None:
        assert self._dlora_prefix is not None  # called only with prefix caching (update_from_output)
        managers = [
            m for m in self.kv_cache_manager.coordinator.single_type_managers if m.kv_cache_spec.prefix_cacheable
        ]
        scheduled = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is not None and n > 0:
                end = r.num_computed_tokens
                scheduled.append(prefix_filter.Scheduled(rid, end - n, end, r.num_preemptions))
        prefix_filter.record_step(
            self._dlora_prefix,
            self._dlora_lineage,
            scheduled,
            step.weights,
            ran,
            lambda rid: [(m.req_to_blocks.get(rid, ()), m.block_size) for m in managers],
        )

    # ---- after the step ----------------------------------------------------------------------

    def _dlora_observe(self, step: _Step, scheduler_output, model_runner_output, ended: float) -> None:
        received: list[SwitchReport] = list(getattr(model_runner_output, REPORTS_ATTR, None) or [])
        reports = self._dlora_worker.observe(step.cmds, step.weights, received, time.monotonic())
        merged = known(self._dlora_worker.weights)
        switch_s = sum(r.seconds for r in reports)
        self._dlora_record_iteration(scheduler_output, ended - step.started - switch_s, merged)
        self.batching_policy.observe(
            IterationStats(
                mode=Mode.MERGED if merged else Mode.UNMERGED,
                merged_adapter=merged,
                num_requests=len(scheduler_output.num_scheduled_tokens),
                iteration_time=ended - step.started,
                switch_time=switch_s,
                num_tokens=scheduler_output.total_num_scheduled_tokens,
                prefill_tokens=samples.prefill_tokens(
                    scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens
                ),
            )
        )
        self._dlora_stalled = (
            step.restricted and not step.restoring and scheduler_output.total_num_scheduled_tokens == 0
        )
        if step.trace is not None and self._dlora_trace is not None:
            self._dlora_trace.write_step(
                step.trace,
                ended - step.started,
                switch_s,
                scheduler_output.total_num_scheduled_tokens,
                known(step.before),
                merged,
                self.batching_policy.snapshot(),
            )
        if not (self.running or self.waiting or self.kv_holding_waiting):
            # Idle from now on (schedule() is not called): close the step in the policy's clock,
            # so the idle gap is not taken for the duration of this step.
            self.batching_policy.decide([], time.time(), self._dlora_max_batch)

    def _dlora_record_iteration(self, scheduler_output, seconds: float, merged: str | None) -> None:
        """One step for the cluster cost model (samples.py)."""
        sample = samples.step_sample(
            scheduler_output.num_scheduled_tokens,
            scheduler_output.total_num_scheduled_tokens,
            seconds,
            merged is not None,
        )
        if sample is not None and not self._dlora_warm:
            # The engine's first step also warms it up (allocations, kernel selection): 8-13 s more
            # than its tokens cost on a CPU, which a least-squares fit of a few dozen steps would
            # read as a per-step cost of a few hundred ms.
            self._dlora_warm = True
        elif sample is not None:
            self._dlora_samples.append(sample)


# ---- EngineCore utilities (added in the engine-core process when vLLM imports this module) ------


def _dlora_setup(self) -> list:
    """Install the worker hooks, then let the scheduler merge. Returns each worker's install result."""
    results = self.model_executor.collective_rpc("dlora_install")
    self.scheduler.dlora_enable_switching(all(self.model_executor.collective_rpc("dlora_can_mix")))
    return list(results)


def _dlora_batching_state(self, since: int = 0) -> BatchingState:
    return self.scheduler.dlora_batching_state(since)


for _name, _fn in (("dlora_setup", _dlora_setup), ("dlora_batching_state", _dlora_batching_state)):
    if not hasattr(EngineCore, _name):
        setattr(EngineCore, _name, _fn)
