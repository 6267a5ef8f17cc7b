"""The `BatchingState` message built from the scheduler's parts (`batching_state.py`)."""

from __future__ import annotations

from dlora.engine_ext.batching_state import batching_state
from dlora.engine_ext.step_measures import StepMeasures
from dlora.engine_ext.weight_state import WeightTracker
from dlora.scheduling import Mode, PolicySnapshot


def state(measures: StepMeasures, since: int = 0, worker: WeightTracker | None = None):
    snap = PolicySnapshot("dlora", Mode.MERGED, "a", 3, credits={None: 1.5, "a": 2.0}, starving=frozenset({None, "b"}))
    return batching_state(
        snap,
        worker or WeightTracker(),
        measures,
        since,
        kv_usage=0.25,
        kv_capacity_tokens=4096,
        kv_block_tokens=128,
        num_running=2,
        num_waiting=3,
        preempted=("r7",),
        lora_slot_drains=1,
        kv_fairness_gap=0.5,
        mixed_merged=True,
    )


def test_the_state_carries_the_samples_after_the_readers_number_and_names_the_base_model_as_empty():
    measures = StepMeasures()
    measures.step_cost({"x": 4}, 4, 1.0, False)  # the warm-up step: not a sample
    measures.queued("x", 0.0)
    measures.waits_end(["x"], 0.5)
    measures.step_cost({"x": 1}, 1, 0.1, False)
    measures.preemptions = 2
    got = state(measures)
    assert (got.samples_seq, got.queue_waits, got.iterations) == (2, (("x", 0.5),), ((1, 0, 1, 0.1, False),))
    assert state(measures, since=2).queue_waits == () and state(measures, since=2).iterations == ()
    assert got.credits == {"": 1.5, "a": 2.0} and got.starving == ("", "b")
    assert (got.num_running, got.num_waiting, got.preempted, got.preemptions) == (2, 3, ("r7",), 2)
    # the weights are the worker's (nothing merged yet), not the policy's plan
    assert (got.mode, got.merged_adapter, got.num_switches) == (Mode.UNMERGED.value, None, 0)
