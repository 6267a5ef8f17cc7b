"""The batching policy inside vLLM's scheduler (`scheduler_cls`): one decision per engine step.

Runs inside vLLM's EngineCore process.

Each `schedule()`:
1. one `RequestView` per unfinished request (running and waiting) -> `policy.decide()`;
2. safety, whatever the policy said: a merge is vetoed while the worker hooks are not installed or
   shortly after that adapter failed to merge; if the allowed requests cannot make progress (none
   running and no free slot, or the previous restricted step scheduled nothing) the step falls
   back to unmerged FCFS over everything; running requests beyond `max_loras` distinct adapters
   wait (vLLM asserts on that, and hidden requests make it possible), and while an adapter is
   merged it holds one of those slots whether its requests run or not;
3. the requests not allowed are hidden from `running`/`waiting` while `super().schedule()` runs,
   then put back: they keep their KV blocks and their RUNNING status, and are never preempted
   (only visible requests are preemption victims);
4. if the weights must change, in-band `SwitchCommand`s go on this step's SchedulerOutput, so the
   worker changes the weights right before the forward pass of exactly the batch chosen for them.
   While adapter X is merged, other requests run in the same step only if the engine mixes
   (`mixed_merged`, needs dlora's LoRA backends: the worker's LoRA layers then subtract X's delta
   from every other token, see punica_wrapper.py). Without mixing (the default, and always with the
   `vllm` backend) only X's requests are ever scheduled: a base or other-adapter request on merged
   weights would compute wrong outputs and cache wrong KV under its normal prefix hash.
5. prefix-cache blocks are not shared across weight states: X's blocks carry the same hash merged
   and unmerged (the same function, but in bf16 not the same rounding), so after every step the
   state each newly completed block was computed in is recorded (`prefix_states.py`, the state
   that actually ran: a failed merge ran unmerged; in a mixed step every request's blocks are
   recorded in X's state), and vLLM's prefix-cache lookup
   (`kv_cache_manager.get_computed_blocks`, wrapped) keeps only the leading hit blocks computed in
   the state this step runs in, taking another cached copy of the same hash where vLLM found the
   wrong one. Requests admitted with those hits report the reduced `num_cached_tokens`.

`update_from_output()` reads the worker's `SwitchReport`s (merge failed -> the replica is unmerged,
that adapter is not merged again for `MERGE_RETRY_S`) and feeds `policy.observe()` the measured
iteration time and switch time. A report missing, late, or unsure of the weights makes them
UNKNOWN (`weight_state.py`): the blocks that step completed are recorded as never reusable, and
from the next step on nothing runs until an UNMERGE has put the base weights back and its report
confirmed it (or the engine stops, `WeightsUnknown`), never assuming the base is back.

The policy's name and parameters arrive through vLLM's `additional_config`
(`engine.BATCHING_CONFIG_KEY`); mixing is turned off when the replica's LoRA backend
(`DLORA_LORA_BACKEND`) is `vllm`, and at `dlora_setup` when a worker reports it cannot compensate
(a policy that mixes anyway breaks `check_decision` and falls back to unmerged FCFS). Importing
this module in the engine-core process (vLLM does, to resolve `scheduler_cls`) adds two EngineCore
utilities, reached with `engine_core.call_utility_async(...)`: `dlora_setup` (install the worker
hooks, tell the scheduler whether the workers mix, enable switching) and `dlora_batching_state` (a
plain dict for /metrics).

GPU note: this subclasses the synchronous `Scheduler`. vLLM forces synchronous scheduling on CPU;
`engine.build_engine_args` also turns `async_scheduling` off elsewhere, since with `AsyncScheduler`
the next step is scheduled before the previous one's reports (a failed merge) are known. An
`AsyncScheduler` variant would need the weight state to be tracked one step ahead (untested).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request, RequestStatus

from dlora import env
from dlora.engine_ext import grammar_replay, prefix_states
from dlora.engine_ext.inband import CMDS_ATTR, MERGE, REPORTS_ATTR, UNMERGE, SwitchCommand, SwitchReport
from dlora.engine_ext.kv_quotas import EngineKvQuotas
from dlora.engine_ext.prefix_states import MIXED, UNMERGED, PrefixStates, State
from dlora.engine_ext.queue_waits import QueueWaits
from dlora.engine_ext.step_trace import adapter_counts, open_trace
from dlora.engine_ext.weight_state import UNKNOWN, Restore, Unknown, Weights, split_reports, weights_after
from dlora.replica.engine import BACKGROUND_PRIORITY_KEY, BATCHING_CONFIG_KEY
from dlora.replica.messages import SWITCH_SECONDS_BUCKETS
from dlora.scheduling import (
    BatchingConfig,
    Decision,
    IterationStats,
    Mode,
    RequestView,
    check_decision,
    make_policy,
)
from dlora.scheduling.background import without_background
from dlora.scheduling.dynamic_batching import fcfs_key
from dlora.scheduling.lora_slots import LoraSlotAging

log = logging.getLogger(__name__)

MERGE_RETRY_S = 30.0  # after a failed merge, that adapter runs unmerged for this long
RECENT_SWITCHES = 64  # durations kept per kind for the batching state
RECENT_ITERATIONS = 512  # measured steps kept until the router's next stats read drains them


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


def _prefill_tokens(scheduler_output) -> int:
    """Prompt tokens a step computed: a request scheduled for one token is decoding (vLLM's
    scheduler gives a prefill chunk more; a one-token prompt chunk counts as a decode, which
    prices the same)."""
    per_request = scheduler_output.num_scheduled_tokens
    return scheduler_output.total_num_scheduled_tokens - sum(1 for n in per_request.values() if n == 1)


def _lora_id(r: Request) -> int | None:
    lr = r.lora_request
    return lr.lora_int_id if lr is not None and lr.lora_int_id > 0 else None


def _lora_request_of(requests: Iterable[Request], adapter: str):
    """The LoRARequest of `adapter` (policies only merge an adapter that has requests)."""
    return next(r.lora_request for r in requests if r.lora_request and r.lora_request.lora_name == adapter)


class SwitchHistogram:
    def __init__(self) -> None:
        self.count, self.total = 0, 0.0
        self.buckets = [0] * len(SWITCH_SECONDS_BUCKETS)  # non-cumulative here
        self.recent: deque[float] = deque(maxlen=RECENT_SWITCHES)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        i = bisect.bisect_left(SWITCH_SECONDS_BUCKETS, seconds)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.recent.append(seconds)

    def to_dict(self) -> dict:
        cumulative, running = [], 0
        for n in self.buckets:
            running += n
            cumulative.append(running)
        return {
            "count": self.count,
            "total_seconds": self.total,
            "bucket_counts": cumulative,
            "recent": list(self.recent),
        }


@dataclass
class _Plan:
    """What this step runs: the visible requests (priority order) and the weights they need."""

    visible: list[str]
    target: Weights  # adapter merged for this step (None = base weights; UNKNOWN: restoring)
    cmds: list[SwitchCommand] = field(default_factory=list)


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


def _known(weights: Weights) -> str | None:
    """The adapter merged, for what only knows adapters and the base (the policy, traces)."""
    return None if isinstance(weights, Unknown) else weights


def _prefix_state(weights: Weights) -> State:
    return MIXED if isinstance(weights, Unknown) else (weights or UNMERGED)


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
        self._dlora_weights: Weights = None  # adapter merged on the worker (weight_state.py)
        self._dlora_restore: Restore | None = None  # set while the weights are UNKNOWN
        self._dlora_seq = 0  # of the last switch command sent
        self._dlora_restores = 0  # times the weights were unknown and restored
        self._dlora_blocked: dict[str, float] = {}  # adapter -> monotonic time it may merge again
        self._dlora_step: _Step | None = None
        self._dlora_stalled = False
        self._dlora_switches = 0
        self._dlora_failures = 0
        self._dlora_preemptions = 0  # running requests vLLM preempted for KV room (each recomputes on resume)
        self._dlora_times = {MERGE: SwitchHistogram(), UNMERGE: SwitchHistogram()}
        # (num_seqs, prefill_tokens, decode_tokens, seconds, merged) per step, for the router's
        # per-replica cost model (dlora/cluster/estimators/cost_model.py); drained by each dlora_state() call.
        self._dlora_iterations: deque[tuple[int, int, int, float, bool]] = deque(maxlen=RECENT_ITERATIONS)
        self._dlora_warm = False  # whether a step has run (the first one is not a cost sample)
        # Seconds each request waited before its first step (queue_waits.py); drained like the steps.
        self._dlora_queue_waits = QueueWaits()
        # Weight state of the cached KV blocks (docstring, 5.); None without prefix caching.
        self._dlora_prefix: PrefixStates | None = None
        self._dlora_lookup_state: State = UNMERGED  # the state this step's cache hits must have
        self._dlora_lineage: dict[str, tuple[int, State]] = {}  # req -> (num_preemptions, lineage)
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

    def dlora_state(self) -> dict:
        snap = self.batching_policy.snapshot()
        merged = _known(self._dlora_weights)
        num_blocks = self.cache_config.num_gpu_blocks
        assert num_blocks is not None  # EngineCore sizes the KV cache before it builds the scheduler
        return {
            "policy": snap.policy,
            "mode": (Mode.MERGED if merged else Mode.UNMERGED).value,
            "merged_adapter": merged,
            "mixed_merged": self._dlora_mixing,
            "num_switches": self._dlora_switches,
            "merge_failures": self._dlora_failures,
            "weights_unknown": self._dlora_weights is UNKNOWN,  # restoring: nothing runs
            "weight_restores": self._dlora_restores,
            "lora_slot_drains": self._dlora_slot_aging.drains if self._dlora_slot_aging else 0,
            "kv_fairness_gap": self._dlora_kv_quotas.fairness_gap(),
            "preemptions": self._dlora_preemptions,
            "switch_times": {op: h.to_dict() for op, h in self._dlora_times.items()},
            "credits": {("" if a is None else a): c for a, c in snap.credits.items()},
            "starving": sorted("" if a is None else a for a in snap.starving),
            "alpha": snap.alpha,
            "beta": snap.beta,
            "switch_cost": snap.switch_cost,
            # queue state for the balancer's views and /metrics
            "kv_usage": self.kv_cache_manager.usage,
            "kv_capacity_tokens": num_blocks * self.block_size,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "iterations": self._dlora_drain_iterations(),
            "queue_waits": self._dlora_queue_waits.drain(),
            # Preempted (KV ran out) and back in the waiting queue: they re-prefill when resumed,
            # and the router must not count them as running (dispatch's prefill, queued moves).
            "preempted": [r.request_id for r in self.waiting if r.status == RequestStatus.PREEMPTED],
        }

    def _preempt_request(self, request, timestamp: float, *args, **kwargs) -> None:
        # Counted here because vLLM keeps only a per-request count, which leaves with the request.
        self._dlora_preemptions += 1
        super()._preempt_request(request, timestamp, *args, **kwargs)

    def _dlora_drain_iterations(self) -> list[tuple[int, int, int, float, bool]]:
        out = list(self._dlora_iterations)
        self._dlora_iterations.clear()
        return out

    # ---- the step ----------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False):
        started = time.perf_counter()
        requests = [*self.running, *self.waiting, *self.kv_holding_waiting]
        if not requests:
            return super().schedule(throttle_prefills)
        plan = self._dlora_restore_plan() if self._dlora_weights is UNKNOWN else self._dlora_plan(requests)
        if self._dlora_service_order:
            self._dlora_apply_order(plan.visible, requests)
        self._dlora_lookup_state = _prefix_state(plan.target)
        out, restricted = self._dlora_schedule_visible(plan.visible, throttle_prefills)
        if plan.cmds:
            setattr(out, CMDS_ATTR, plan.cmds)
        step = _Step(started, plan.cmds, restricted, plan.target, self._dlora_weights)
        if self._dlora_trace is not None:
            step.trace = {"unfinished": adapter_counts(_adapter(r) for r in requests), "allowed": len(plan.visible)}
        self._dlora_weights = plan.target  # corrected by the worker's reports (_dlora_observe)
        self._dlora_step = step
        self._dlora_queue_waits.end((r.req_id for r in out.scheduled_new_reqs), started)
        return out

    def add_request(self, request: Request) -> None:
        self._dlora_kv_quotas.arrived(request)
        # Kept as given: with a service order the request's own priority becomes its place.
        self._dlora_client_priority[request.request_id] = request.priority
        super().add_request(request)
        self._dlora_queue_waits.queued(request.request_id, time.perf_counter())

    def finish_requests(self, request_ids, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        self._dlora_queue_waits.end((r.request_id for r in finished), time.perf_counter())
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
            self._dlora_record_blocks(scheduler_output, step, self._dlora_ran(step, model_runner_output))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if step is not None:
            self._dlora_observe(step, scheduler_output, model_runner_output, ended)
        self._dlora_prune_lineage()
        return outputs

    # ---- deciding ----------------------------------------------------------------------------

    def _dlora_plan(self, requests: list[Request]) -> _Plan:
        by_id = {r.request_id: r for r in requests}
        client = self._dlora_client_priority
        views = [_view(r, client.get(r.request_id, r.priority)) for r in requests]
        now = time.time()  # the clock of vLLM's arrival_time
        decision = self.batching_policy.decide(views, now, self._dlora_max_batch)
        try:
            check_decision(decision, views, self._dlora_max_batch, self._dlora_mixing)
        except ValueError as e:
            log.error("batching policy broke its contract (%s); running unmerged FCFS this step", e)
            decision = Decision(Mode.UNMERGED, None, tuple(v.req_id for v in sorted(views, key=fcfs_key)))
        target = decision.merged_adapter if decision.mode is Mode.MERGED else None
        allowed = list(decision.allowed_req_ids)
        if target is not None and target != self._dlora_weights and not self._dlora_may_merge(target):
            target = None  # run the adapter's requests unmerged; observe() tells the policy
        if self._dlora_stalled or not self._dlora_can_progress(allowed, by_id):
            target = None
            allowed = [v.req_id for v in sorted(views, key=fcfs_key)]
        else:
            # Not after a step that ran nothing: online requests the KV held by paused batch work
            # keeps out would wait forever; that step runs everything (vLLM then preempts by priority).
            allowed = without_background(
                allowed, lambda i: client.get(i, by_id[i].priority), self._dlora_background_from
            )
        allowed = self._dlora_within_quotas(allowed, by_id)
        if target is None and self._dlora_slot_aging is not None:
            held = self._dlora_slot_aging.held_back(views, now)
            allowed = [i for i in allowed if i not in held] if held else allowed
        lr = _lora_request_of(by_id.values(), target) if target is not None else None
        plan = _Plan(self._dlora_fit_lora_slots(allowed, by_id, lr.lora_int_id if lr else None), target)
        if target != self._dlora_weights:
            if self._dlora_weights is not None:
                # _known: the weights are known here (unknown ones take _dlora_restore_plan)
                plan.cmds.append(SwitchCommand(UNMERGE, _known(self._dlora_weights), seq=self._dlora_next_seq()))
            if lr is not None:
                plan.cmds.append(SwitchCommand(MERGE, target, lr.lora_path, lr.lora_int_id, self._dlora_next_seq()))
        return plan

    def _dlora_restore_plan(self) -> _Plan:
        """While the weights are unknown: nothing runs (any request could compute on the wrong
        weights and cache its KV), only the restore's UNMERGE is sent (weight_state.py)."""
        assert self._dlora_restore is not None  # set whenever the weights become UNKNOWN
        cmd = self._dlora_restore.command(self._dlora_next_seq)  # raises WeightsUnknown at the end
        return _Plan([], UNKNOWN, [cmd] if cmd is not None else [])

    def _dlora_next_seq(self) -> int:
        self._dlora_seq += 1
        return self._dlora_seq

    def _dlora_may_merge(self, adapter: str) -> bool:
        if not self._dlora_switching:
            return False
        until = self._dlora_blocked.get(adapter)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self._dlora_blocked[adapter]
        return True

    def _dlora_can_progress(self, allowed: list[str], by_id: dict[str, Request]) -> bool:
        """False when the allowed requests cannot run at all (the engine would spin on empty steps)."""
        if not allowed:
            return False
        if any(by_id[i].status == RequestStatus.RUNNING for i in allowed):
            return True
        occupied = len(self.running) + self.num_waiting_for_streaming_input
        return occupied < self.max_num_active_reqs

    def _dlora_fit_lora_slots(self, allowed: list[str], by_id: dict[str, Request], merged_id: int | None) -> list[str]:
        """Hide requests whose adapter would exceed max_loras distinct adapters this step.

        vLLM schedules every visible running request and asserts that they use at most max_loras
        adapters; with requests hidden, more adapters than that can be running. Waiting requests
        stay: vLLM's admission check counts adapters itself. Except while an adapter is merged
        (lora id `merged_id`): the worker keeps it in a slot whether its requests are scheduled or
        not (it compensates it, worker.py), which vLLM's admission does not count, so that slot
        is taken first and waiting requests count too.
        """
        if self._dlora_max_loras is None:
            return allowed
        loras: set[int] = set() if merged_id is None else {merged_id}
        kept = []
        for rid in allowed:
            r = by_id[rid]
            lid = _lora_id(r)
            counted = r.status == RequestStatus.RUNNING or merged_id is not None
            if lid is not None and counted and lid not in loras:
                if len(loras) >= self._dlora_max_loras:
                    continue
                loras.add(lid)
            kept.append(rid)
        return kept

    def _dlora_within_quotas(self, allowed: list[str], by_id: dict[str, Request]) -> list[str]:
        """`allowed` without the waiting requests the KV quotas hold back this step (with quotas
        off: `allowed`, after recording the blocks in use for the fairness gap)."""
        waiting = [by_id[i] for i in allowed if by_id[i].status != RequestStatus.RUNNING]
        admitted = [r for r in by_id.values() if r.status == RequestStatus.RUNNING]
        if not self._dlora_kv_enforce:
            self._dlora_kv_quotas.observe(admitted, waiting, time.monotonic())
            return allowed
        refused = self._dlora_kv_quotas.refused(admitted, waiting, time.monotonic())
        kept = [i for i in allowed if i not in refused]
        return kept or allowed[:1]  # never an empty step while requests wait (the engine would spin)

    # ---- service order -------------------------------------------------------------------------

    def _dlora_apply_order(self, visible: list[str], requests: list[Request]) -> None:
        """Serve in the policy's order (`scheduling.order` other than fcfs, or KV quotas on): vLLM
        admits waiting requests, and preempts running ones when KV runs out, by (priority,
        arrival); each request's priority becomes its place: after the priority its client asked
        for (kept at add_request), borrowers of KV quota last, then the policy's order. Then the
        waiting queues are rebuilt: they are heaps keyed at entry."""
        client = self._dlora_client_priority
        rank = {rid: i for i, rid in enumerate(visible)}
        last = len(rank)
        borrowers = self._dlora_kv_quotas.borrowers() if self._dlora_kv_enforce else set()

        def place(r: Request) -> tuple:
            return (client.get(r.request_id, 0), _adapter(r) in borrowers, rank.get(r.request_id, last))

        for position, r in enumerate(sorted(requests, key=place)):
            r.priority = position
        for name in ("waiting", "kv_holding_waiting"):
            old = getattr(self, name)
            rebuilt = create_request_queue(self.policy)
            for r in old:
                rebuilt.add_request(r)
            setattr(self, name, rebuilt)

    # ---- hiding --------------------------------------------------------------------------------

    def _dlora_schedule_visible(self, visible_order: list[str], throttle_prefills: bool):
        visible = set(visible_order)
        running, waiting, holding = self.running, self.waiting, self.kv_holding_waiting
        hidden_running = [r for r in running if r.request_id not in visible]
        hidden_waiting = [r for r in waiting if r.request_id not in visible]
        hidden_holding = [r for r in holding if r.request_id not in visible]
        if not (hidden_running or hidden_waiting or hidden_holding):
            return super().schedule(throttle_prefills), False
        rank = {rid: i for i, rid in enumerate(visible_order)}
        self.running = [r for r in running if r.request_id in visible]
        self.waiting = create_request_queue(self.policy)
        for r in sorted((r for r in waiting if r.request_id in visible), key=lambda r: rank[r.request_id]):
            self.waiting.add_request(r)
        self.kv_holding_waiting = create_request_queue(self.policy)
        for r in holding:
            if r.request_id in visible:
                self.kv_holding_waiting.add_request(r)
        # Hidden running requests still hold a model-runner slot.
        self.max_num_active_reqs -= len(hidden_running)
        try:
            out = super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs += len(hidden_running)
            # self.running is now the visible ones minus the preempted, plus the newly admitted.
            after = {id(r) for r in self.running}
            before = {id(r) for r in running}
            self.running = [r for r in running if id(r) in after or r.request_id not in visible] + [
                r for r in self.running if id(r) not in before
            ]
            for r in hidden_waiting:
                self.waiting.add_request(r)
            for r in hidden_holding:
                self.kv_holding_waiting.add_request(r)
        return out, True

    # ---- prefix cache: blocks reused only in the weight state they were computed in -----------

    def _dlora_computed_blocks(self, request: Request):
        """vLLM's `KVCacheManager.get_computed_blocks`, hits limited to this step's weight state.

        Returns vLLM's (blocks, num_computed_tokens, shared_prefix_boundary). Nothing is ref-counted
        yet (`allocate_slots` touches the blocks the scheduler finally adopts), so a shorter or
        substituted block list is as valid as vLLM's own.
        """
        found = self._dlora_vllm_computed_blocks(request)
        blocks, num_tokens, _ = found
        state, ledger, kvm = self._dlora_lookup_state, self._dlora_prefix, self.kv_cache_manager
        assert ledger is not None  # this lookup is installed only with prefix caching (__init__)
        if num_tokens == 0 or (state == UNMERGED and not ledger.any_not_unmerged):
            return found  # nothing but unmerged blocks was ever recorded: vLLM's hit as it is
        groups = blocks.blocks
        hit = groups[0] if len(groups) == 1 else ()
        per_block = num_tokens // len(hit) if hit else 0
        if not hit or num_tokens != len(hit) * per_block:
            # Several KV cache groups (hybrid models) or a sub-block hit: all or nothing.
            if state == UNMERGED and all(
                ledger.state_of(b.block_id, b.block_hash) == UNMERGED for g in groups for b in g if not b.is_null
            ):
                return found
            return kvm.empty_kv_cache_blocks, 0, 0
        pool = kvm.block_pool.blocks
        keep = ledger.usable_prefix(
            [(b.block_id, b.block_hash) for b in hit], state, lambda block_id: pool[block_id].block_hash
        )
        if len(keep) == len(hit) and all(i == b.block_id for i, b in zip(keep, hit)):
            return found
        if not keep:
            return kvm.empty_kv_cache_blocks, 0, 0
        # A single group has no shared-prefix junction (the boundary is 0).
        return kvm.create_kv_cache_blocks(([pool[i] for i in keep],)), len(keep) * per_block, 0

    @staticmethod
    def _dlora_ran(step: _Step, model_runner_output) -> Weights:
        """The weights the step actually ran on, as far as its reports tell (weight_state.py)."""
        mine, _ = split_reports(step.cmds, getattr(model_runner_output, REPORTS_ATTR, None) or ())
        return weights_after(step.cmds, mine, step.weights)

    def _dlora_record_blocks(self, scheduler_output, step: _Step, ran: Weights) -> None:
        """Record the state of the blocks each scheduled request completed in this step.

        vLLM caches (hashes) a request's full blocks up to its computed tokens, so the blocks newly
        cached in this step are the ones its tokens [start, end) completed. Their state is the
        request's lineage: tokens before `start` either ran in earlier steps (the lineage kept per
        request) or were cache hits at admission, which matched this step's planned state.
        """
        ledger, lineage = self._dlora_prefix, self._dlora_lineage
        assert ledger is not None  # called only with prefix caching (update_from_output)
        managers = [
            m for m in self.kv_cache_manager.coordinator.single_type_managers if m.kv_cache_spec.prefix_cacheable
        ]
        state_ran = _prefix_state(ran)  # unknown weights: MIXED, never reused
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = self.requests.get(rid)
            if r is None or n <= 0:
                continue
            end = r.num_computed_tokens
            start = end - n
            prev = lineage.get(rid)
            if prev is None or prev[0] != r.num_preemptions:  # first step since admission
                prev_state = _prefix_state(step.weights) if start > 0 else None
            else:
                prev_state = prev[1]
            state = prefix_states.combine(prev_state, state_ran)
            lineage[rid] = (r.num_preemptions, state)
            for m in managers:
                blocks = m.req_to_blocks.get(rid, ())
                for b in blocks[start // m.block_size : min(end // m.block_size, len(blocks))]:
                    if b.block_hash is not None and not b.is_null:
                        ledger.record(b.block_id, b.block_hash, state)

    def _dlora_prune_lineage(self) -> None:
        if len(self._dlora_lineage) > len(self.requests):
            for rid in [rid for rid in self._dlora_lineage if rid not in self.requests]:
                del self._dlora_lineage[rid]

    # ---- after the step ----------------------------------------------------------------------

    def _dlora_observe(self, step: _Step, scheduler_output, model_runner_output, ended: float) -> None:
        received: list[SwitchReport] = list(getattr(model_runner_output, REPORTS_ATTR, None) or [])
        reports, late = split_reports(step.cmds, received)
        if step.restoring:
            self._dlora_settle_restore(received)
        else:
            self._dlora_weights = weights_after(step.cmds, reports, step.weights)
            if self._dlora_weights is UNKNOWN:
                log.error(
                    "the worker did not confirm dlora switch command(s) %s (reports: %s); its weights are "
                    "unknown: nothing runs until the base weights are restored",
                    step.cmds,
                    reports,
                )
                self._dlora_restore = Restore()
        if late and not step.restoring:  # while restoring, the restore's own late report settles it
            log.warning("ignoring %d dlora switch report(s) of earlier steps: %s", len(late), late)
        for report in reports:
            if report.ok:
                self._dlora_switches += 1
                self._dlora_times[report.op].observe(report.seconds)
            else:
                self._dlora_failures += 1
                if report.op == MERGE and report.adapter is not None:
                    self._dlora_blocked[report.adapter] = time.monotonic() + MERGE_RETRY_S
        merged = _known(self._dlora_weights)
        self._dlora_record_iteration(scheduler_output, ended - step.started - sum(r.seconds for r in reports), merged)
        self.batching_policy.observe(
            IterationStats(
                mode=Mode.MERGED if merged else Mode.UNMERGED,
                merged_adapter=merged,
                num_requests=len(scheduler_output.num_scheduled_tokens),
                iteration_time=ended - step.started,
                switch_time=sum(r.seconds for r in reports),
                num_tokens=scheduler_output.total_num_scheduled_tokens,
                prefill_tokens=_prefill_tokens(scheduler_output),
            )
        )
        self._dlora_stalled = (
            step.restricted and not step.restoring and scheduler_output.total_num_scheduled_tokens == 0
        )
        if step.trace is not None:
            self._dlora_write_trace(step, scheduler_output, ended, reports, merged)
        if not (self.running or self.waiting or self.kv_holding_waiting):
            # Idle from now on (schedule() is not called): close the step in the policy's clock,
            # so the idle gap is not taken for the duration of this step.
            self.batching_policy.decide([], time.time(), self._dlora_max_batch)

    def _dlora_write_trace(self, step: _Step, scheduler_output, ended: float, reports, merged) -> None:
        trace, out = step.trace, self._dlora_trace
        assert trace is not None and out is not None  # a step gets a trace only while one is open
        snap = self.batching_policy.snapshot()
        out.write(
            t=time.time(),
            step_s=round(ended - step.started, 6),
            switch_s=round(sum(r.seconds for r in reports), 6),
            before=_known(step.before),
            weights=merged,
            unfinished=trace["unfinished"],
            allowed=trace["allowed"],
            scheduled=trace["scheduled"],
            tokens=scheduler_output.total_num_scheduled_tokens,
            alpha=snap.alpha,
            beta=snap.beta,
            starving=sorted("" if a is None else a for a in snap.starving),
            planner=snap.planner,
        )

    def _dlora_settle_restore(self, received: list[SwitchReport]) -> None:
        assert self._dlora_restore is not None  # a restoring step runs only while one is set
        if self._dlora_restore.settle(received):
            log.warning("dlora: the base weights are restored and confirmed; serving resumes")
            self._dlora_weights, self._dlora_restore = None, None
            self._dlora_restores += 1

    def _dlora_record_iteration(self, scheduler_output, seconds: float, merged: str | None) -> None:
        """One step for the cluster cost model: a request scheduled for one token is decoding."""
        per_request = scheduler_output.num_scheduled_tokens
        if not per_request or seconds <= 0:
            return
        if not self._dlora_warm:
            # The engine's first step also warms it up (allocations, kernel selection): 8-13 s more
            # than its tokens cost on a CPU, which a least-squares fit of a few dozen steps would
            # read as a per-step cost of a few hundred ms.
            self._dlora_warm = True
            return
        prefill = _prefill_tokens(scheduler_output)
        decode = scheduler_output.total_num_scheduled_tokens - prefill
        self._dlora_iterations.append((len(per_request), prefill, decode, seconds, merged is not None))


# ---- EngineCore utilities (added in the engine-core process when vLLM imports this module) ------


def _dlora_setup(self) -> list:
    """Install the worker hooks, then let the scheduler merge. Returns each worker's install result."""
    results = self.model_executor.collective_rpc("dlora_install")
    self.scheduler.dlora_enable_switching(all(self.model_executor.collective_rpc("dlora_can_mix")))
    return list(results)


def _dlora_batching_state(self) -> dict:
    return self.scheduler.dlora_state()


for _name, _fn in (("dlora_setup", _dlora_setup), ("dlora_batching_state", _dlora_batching_state)):
    if not hasattr(EngineCore, _name):
        setattr(EngineCore, _name, _fn)
