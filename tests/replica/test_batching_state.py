"""The engine's `BatchingState` on the replica's side, with no engine.

It crosses vLLM's utility call (`call_utility_async`) typed and whole: a replica's AsyncLLM runs its
engine core in another process, a utility's result goes back as msgpack (vLLM's `MsgpackEncoder`
on an `EngineCoreOutputs`) without type information unless VLLM_ALLOW_INSECURE_SERIALIZATION is
set, so the host receives a dataclass as a map and rebuilds it in one place (`messages.from_wire`).
And the replica's stats reads pass each measured sample on once: each asks the engine for the
samples after the newest one the previous read carried."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from dlora.engine_ext.samples import QueueWait, StepSample
from dlora.replica.messages import BatchingState, SwitchTimes, by_adapter_name, from_wire

# Every field away from its default, so a field dropped on the way fails the comparison.
STATE = BatchingState(
    policy="dlora",
    mode="unmerged",
    merged_adapter=None,
    num_switches=5,
    merge_failures=1,
    switch_times={"merge": SwitchTimes(3, 0.06, (0, 1, 3), (0.01, 0.02)), "unmerge": SwitchTimes(2, 0.02)},
    credits={"": 1.5, "a0": 0.25},
    starving=("a1",),
    alpha=0.9,
    beta=0.6,
    switch_cost=0.02,
    kv_usage=0.5,
    kv_capacity_tokens=4096,
    kv_block_tokens=128,
    num_running=3,
    num_waiting=2,
    iterations=(StepSample(2, 6, 1, 0.05, False), StepSample(3, 0, 3, 0.04, True)),
    queue_waits=(QueueWait("cmpl-1-0", 0.125),),
    lora_slot_drains=1,
    kv_fairness_gap=0.75,
    preemptions=4,
    preempted=("cmpl-2-0",),
    weights="restoring",
    weight_restores=2,
    mixed_merged=True,
    samples_seq=17,
)


def across_vllms_utility_encoding(result):
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    frames = MsgpackEncoder().encode(EngineCoreOutputs(utility_output=UtilityOutput(1, result=UtilityResult(result))))
    outputs = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert outputs.utility_output is not None and outputs.utility_output.result is not None
    return outputs.utility_output.result.result


def test_every_field_of_the_engine_state_arrives_typed():
    raw = across_vllms_utility_encoding(STATE)
    assert isinstance(raw, dict)  # what the host receives: plain msgpack values
    state = from_wire(BatchingState, raw)
    for f in dataclasses.fields(BatchingState):
        assert getattr(state, f.name) == getattr(STATE, f.name), f.name
        assert getattr(STATE, f.name) != f.default, f"{f.name} is at its default: the test would miss its loss"
    assert isinstance(state.switch_times["merge"], SwitchTimes) and isinstance(state.iterations[0], tuple)
    assert state.weights_unknown


def test_an_in_process_engines_state_is_used_as_it_is():
    assert from_wire(BatchingState, STATE) is STATE


class Host:
    """EngineHost.batching_state over an engine whose samples are numbered 1..seq."""

    def __init__(self) -> None:
        self.seq, self.asked = 0, []

    async def batching_state(self, since: int = 0) -> BatchingState:
        self.asked.append(since)
        if self.seq < 0:
            raise RuntimeError("engine busy")
        return dataclasses.replace(STATE, samples_seq=self.seq)


def test_each_stats_read_asks_for_the_samples_after_the_previous_one():
    from dlora.replica.ray_replica import ReplicaActor

    read = ReplicaActor.__ray_metadata__.modified_class._batching_state  # the actor's method, without Ray
    actor = SimpleNamespace(host=Host(), replica_id=0, _samples_seen=0)
    actor.host.seq = 4
    assert asyncio.run(read(actor)).samples_seq == 4
    actor.host.seq = 9
    asyncio.run(read(actor))
    actor.host.seq = -1  # a failed read hands nothing on, so the next one asks from the same place
    assert asyncio.run(read(actor)) is None
    assert actor.host.asked == [0, 4, 9] and actor._samples_seen == 9


def test_engine_names_become_adapter_names_on_the_host():
    """The engine knows each version as name@digest; the router compares the merged adapter with a
    request's adapter name, and /metrics labels by it, so the host reports adapter names."""
    engine_side = dataclasses.replace(
        STATE,
        merged_adapter="a0@00112233aabbccdd",
        credits={"": 1.5, "a0@00112233aabbccdd": 0.25, "a0@ffeeddccbbaa9988": 0.75, "a1": 0.5},
        starving=("a1", "a2@0123456789abcdef"),
    )
    host = by_adapter_name(engine_side)
    assert host.merged_adapter == "a0"
    assert host.credits == {"": 1.5, "a0": 0.75, "a1": 0.5}  # two versions alive: the larger credit
    assert host.starving == ("a1", "a2")
    assert dataclasses.replace(host, merged_adapter=None, credits={}, starving=()) == dataclasses.replace(
        engine_side, merged_adapter=None, credits={}, starving=()
    )
