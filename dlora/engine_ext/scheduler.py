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
   (`prefix_lookup.py`, wrapping `kv_cache_manager.get_computed_blocks`; its rules in `prefix_filter.py`).

`update_from_output()` records the state of the blocks the step completed, reads the worker's
`SwitchReport`s into the `WeightTracker` (`weight_state.py`: a failed merge leaves the base weights;
a report missing, late or unsure makes them UNKNOWN and nothing runs until their restore is
confirmed) and feeds `policy.observe()` the measured step and switch times; each step's cost,
each request's queue wait and vLLM's preemptions are kept in `StepMeasures` (`step_measures.py`).

The policy's name and parameters arrive through vLLM's `additional_config`
(`engine_keys.BATCHING_CONFIG_KEY`); mixing is turned off when the replica's LoRA backend
(`DLORA_LORA_BACKEND`) is `vllm`, and at `dlora_setup` when a worker reports it cannot compensate.
Importing this module in the engine-core process (vLLM does, to resolve `scheduler_cls`) adds two
EngineCore utilities, reached with `engine_core.call_utility_async(...)`: `dlora_setup` (install
the worker hooks, enable switching) and `dlora_batching_state` (the `BatchingState` message,
`batching_state.py`, with the measured samples after the number the caller names, `samples.py`:
reading changes nothing).

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
from dlora.engine_ext import grammar_replay, prefix_filter, queue_hiding, step_plan
from dlora.engine_ext.batching_state import batching_state
from dlora.engine_ext.inband import CMDS_ATTR, REPORTS_ATTR, SwitchCommand, SwitchReport
from dlora.engine_ext.kv_quotas import EngineKvQuotas
from dlora.engine_ext.prefix_lookup import PrefixLookup
from dlora.engine_ext.step_measures import StepMeasures, iteration_stats
from dlora.engine_ext.step_plan import Plan
from dlora.engine_ext.step_trace import adapter_counts, open_trace
from dlora.engine_ext.weight_state import UNKNOWN, Weights, WeightTracker, known, split_reports, weights_after
from dlora.replica.engine_keys import BACKGROUND_PRIORITY_KEY, BATCHING_CONFIG_KEY
from dlora.replica.messages import BatchingState
from dlora.scheduling import BatchingConfig, RequestView, make_policy
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
        # Each step's cost (the router's per-replica cost model, dlora/cluster/estimators/replica_cost.py),
        # each request's wait before its first step, numbered (samples.py), and the preemptions.
        self._dlora_measures = StepMeasures()
        self._dlora_trace = open_trace(env.DLORA_STEP_TRACE.get())
        # Cache hits only from blocks of this step's weight state (docstring, 4.); None without prefix caching.
        self._dlora_prefix = PrefixLookup(self.kv_cache_manager) if self.kv_cache_manager.enable_caching else None
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
        """The batching state now, with the samples numbered after `since` (batching_state.py)."""
        num_blocks = self.cache_config.num_gpu_blocks
        assert num_blocks is not None  # EngineCore sizes the KV cache before it builds the scheduler
        return batching_state(
            self.batching_policy.snapshot(),
            self._dlora_worker,
            self._dlora_measures,
            since,
            kv_usage=self.kv_cache_manager.usage,
            kv_capacity_tokens=num_blocks * self.block_size,
            kv_block_tokens=self.block_size,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            # Preempted (KV ran out) and back in the waiting queue: they re-prefill when resumed,
            # and the router must not count them as running (dispatch's prefill, queued moves).
            preempted=tuple(r.request_id for r in self.waiting if r.status == RequestStatus.PREEMPTED),
            lora_slot_drains=self._dlora_slot_aging.drains if self._dlora_slot_aging else 0,
            kv_fairness_gap=self._dlora_kv_quotas.fairness_gap(),
            mixed_merged=self._dlora_mixing,
        )

    def _preempt_request(self, request, timestamp: float, *args, **kwargs) -> None:
        self._dlora_measures.preemptions += 1
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
        if self._dlora_prefix is not None:
            self._dlora_prefix.state = prefix_filter.state_of(plan.target)
        out, restricted = self._dlora_schedule_visible(plan.visible, throttle_prefills)
        if plan.cmds:
            setattr(out, CMDS_ATTR, plan.cmds)
        step = _Step(started, plan.cmds, restricted, plan.target, worker.weights)
        if self._dlora_trace is not None:
            step.trace = {"unfinished": adapter_counts(_adapter(r) for r in requests), "allowed": len(plan.visible)}
        worker.weights = plan.target  # corrected by the worker's reports (_dlora_observe)
        self._dlora_step = step
        self._dlora_measures.waits_end((r.req_id for r in out.scheduled_new_reqs), started)
        return out

    def add_request(self, request: Request) -> None:
        self._dlora_kv_quotas.arrived(request)
        # Kept as given: with a service order the request's own priority becomes its place.
        self._dlora_client_priority[request.request_id] = request.priority
        super().add_request(request)
        self._dlora_measures.queued(request.request_id, time.perf_counter())

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        self._dlora_measures.waits_end((r.request_id for r in finished), time.perf_counter())
        return finished

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
            ran = self._dlora_ran(step, model_runner_output)
            self._dlora_prefix.record_step(scheduler_output, self.requests, step.weights, ran)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if step is not None:
            self._dlora_observe(step, scheduler_output, model_runner_output, ended)
        if self._dlora_prefix is not None:
            self._dlora_prefix.prune(self.requests)
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

    # ---- the weights a step ran on (weight_state.py) --------------------------------------------

    @staticmethod
    def _dlora_ran(step: _Step, model_runner_output) -> Weights:
        """The weights the step actually ran on, as far as its reports tell (weight_state.py)."""
        mine, _ = split_reports(step.cmds, getattr(model_runner_output, REPORTS_ATTR, None) or ())
        return weights_after(step.cmds, mine, step.weights)

    # ---- after the step ----------------------------------------------------------------------

    def _dlora_observe(self, step: _Step, scheduler_output, model_runner_output, ended: float) -> None:
        received: list[SwitchReport] = list(getattr(model_runner_output, REPORTS_ATTR, None) or [])
        reports = self._dlora_worker.observe(step.cmds, step.weights, received, time.monotonic())
        merged = known(self._dlora_worker.weights)
        switch_s = sum(r.seconds for r in reports)
        tokens, total = scheduler_output.num_scheduled_tokens, scheduler_output.total_num_scheduled_tokens
        self._dlora_measures.step_cost(tokens, total, ended - step.started - switch_s, merged is not None)
        self.batching_policy.observe(iteration_stats(tokens, total, ended - step.started, switch_s, merged))
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
