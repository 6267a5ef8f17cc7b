"""What one engine step runs (engine_ext/step_plan.py), over plain data: the policy's decision made
safe, LoRA slots, background work and the switch commands."""

from __future__ import annotations

import itertools

from dlora.engine_ext.inband import MERGE, UNMERGE
from dlora.engine_ext.step_plan import Guard, Lora, checked_decision, fit_lora_slots, select, switch_commands
from dlora.scheduling import Decision, Mode, RequestView

BATCH = 10  # engine priority from which requests are batch work


def view(rid: str, adapter: str | None = None, running: bool = False, arrival: float = 0.0, priority: int = 0):
    return RequestView(rid, adapter, arrival, 4, 0, 0, running, 8, priority)


def guard(**kw) -> Guard:
    base = dict(weights=None, switching=True, blocked=(), stalled=False, free_slot=True, background_from=BATCH)
    return Guard(**(base | kw))


MERGE_A0 = Decision(Mode.MERGED, "a0", ("x", "y"))
VIEWS = [view("x", "a0", arrival=1.0), view("y", "a0", arrival=2.0), view("z", "a1", arrival=0.5)]


def test_a_merge_runs_only_once_switching_is_on_and_not_right_after_it_failed():
    assert select(MERGE_A0, VIEWS, guard()) == ("a0", ["x", "y"])
    assert select(MERGE_A0, VIEWS, guard(switching=False)) == (None, ["x", "y"])
    assert select(MERGE_A0, VIEWS, guard(blocked={"a0"})) == (None, ["x", "y"])
    # Already merged: staying merged needs no merge, blocked or not.
    assert select(MERGE_A0, VIEWS, guard(weights="a0", blocked={"a0"})) == ("a0", ["x", "y"])


def test_a_step_that_cannot_progress_runs_everything_unmerged_in_fcfs_order():
    fcfs = (None, ["z", "x", "y"])
    assert select(MERGE_A0, VIEWS, guard(stalled=True)) == fcfs
    assert select(MERGE_A0, VIEWS, guard(free_slot=False)) == fcfs  # none running, no room to admit
    running = [view("x", "a0", running=True, arrival=1.0), *VIEWS[1:]]
    assert select(MERGE_A0, running, guard(free_slot=False)) == ("a0", ["x", "y"])


def test_batch_work_never_shares_a_step_with_online_work_by_its_clients_priority():
    views = [view("b1", priority=BATCH), view("o1"), view("b2", priority=BATCH + 1), view("o2", priority=-1)]
    everything = Decision(Mode.UNMERGED, None, ("b1", "o1", "b2", "o2"))
    assert select(everything, views, guard()) == (None, ["o1", "o2"])
    only_batch = Decision(Mode.UNMERGED, None, ("b1", "b2"))
    assert select(only_batch, views, guard()) == (None, ["b1", "b2"])
    assert select(everything, views, guard(background_from=None)) == (None, ["b1", "o1", "b2", "o2"])
    # A stalled step runs everything (the KV batch work holds may keep online requests out).
    assert select(everything, views, guard(stalled=True)) == (None, ["o2", "o1", "b1", "b2"])  # FCFS: priority first


def test_a_decision_that_breaks_the_contract_becomes_unmerged_fcfs():
    class Broken:
        def decide(self, views, now, max_batch):
            return Decision(Mode.MERGED, "a0", ("x", "z"))  # z (a1) on a0's merged weights

    assert checked_decision(Broken(), VIEWS, 0.0, 8, mixing=False) == Decision(Mode.UNMERGED, None, ("z", "x", "y"))
    assert checked_decision(Broken(), VIEWS, 0.0, 8, mixing=True) == Decision(Mode.MERGED, "a0", ("x", "z"))


def test_a_merged_adapter_keeps_its_lora_slot():
    """max_loras 2, a0 (id 1) merged: one slot is a0's even without its requests, so at most one
    other adapter may be visible, waiting requests included (vLLM's admission does not count a0)."""
    loras = {"b": Lora("b", 2, "/b"), "c": Lora("c", 3, "/c"), "a": Lora("a0", 1, "/a0"), "b2": Lora("b", 2, "/b")}
    running = {"b", "n"}
    order = ["b", "c", "n", "a", "b2"]
    assert fit_lora_slots(order, loras, running, 2, 1) == ["b", "n", "a", "b2"]
    assert fit_lora_slots(order, loras, running, 2, None) == order  # waiting: vLLM's check
    assert fit_lora_slots(order, loras, {"b", "c", "b2"}, 1, None) == ["b", "n", "a", "b2"]
    assert fit_lora_slots(order, loras, running, None, 1) == order  # no LoRA: nothing to count


def test_switch_commands_take_the_worker_from_its_weights_to_the_steps():
    seq = itertools.count(7).__next__
    a1 = Lora("a1", 2, "/a1")
    assert switch_commands("a1", a1, seq) == []
    unmerge, merge = switch_commands("a0", a1, seq)
    assert (unmerge.op, unmerge.adapter, unmerge.seq) == (UNMERGE, "a0", 7)
    assert (merge.op, merge.adapter, merge.path, merge.lora_int_id, merge.seq) == (MERGE, "a1", "/a1", 2, 8)
    (back,) = switch_commands("a1", None, seq)
    assert (back.op, back.adapter, back.seq) == (UNMERGE, "a1", 9)
    assert switch_commands(None, None, seq) == []
