"""The `BatchingState` message a replica's host reads from its scheduler (`dlora_batching_state`).

Runs inside vLLM's EngineCore process: `DloraScheduler` (`scheduler.py`) hands over its policy's
snapshot, the worker's weight state, its measures and the queue figures vLLM's scheduler holds;
the message crosses to the host as msgpack (`dlora.replica.messages`). The samples in it are those
numbered after the number the reader names, so reading takes nothing away (`samples.py`). Pure:
no vLLM here.
"""

from __future__ import annotations

from dlora.engine_ext.step_measures import StepMeasures
from dlora.engine_ext.weight_state import WeightTracker, known
from dlora.replica.messages import BatchingState
from dlora.scheduling import Mode, PolicySnapshot


def batching_state(
    snap: PolicySnapshot,
    worker: WeightTracker,
    measures: StepMeasures,
    since: int,
    *,
    kv_usage: float,
    kv_capacity_tokens: int,
    kv_block_tokens: int,
    num_running: int,
    num_waiting: int,
    preempted: tuple[str, ...],
    lora_slot_drains: int,
    kv_fairness_gap: float,
    mixed_merged: bool,
) -> BatchingState:
    """The state now: the policy's and the weights', the queues' (for the balancer's views and
    /metrics; `preempted`: the waiting requests vLLM preempted) and the samples numbered after
    `since`."""
    merged = known(worker.weights)
    steps, waits = measures.since(since)
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
        kv_usage=kv_usage,
        kv_capacity_tokens=kv_capacity_tokens,
        kv_block_tokens=kv_block_tokens,
        num_running=num_running,
        num_waiting=num_waiting,
        iterations=steps,
        queue_waits=waits,
        lora_slot_drains=lora_slot_drains,
        kv_fairness_gap=kv_fairness_gap,
        preemptions=measures.preemptions,
        preempted=preempted,
        weights=worker.state(),
        weight_restores=worker.restores,
        mixed_merged=mixed_merged,
        samples_seq=measures.samples.seq,
    )
