"""The steps an engine reports for the router's cost model (`StepMeasures.step_cost`)."""

from __future__ import annotations

from dlora.engine_ext.step_measures import StepMeasures, iteration_stats
from dlora.scheduling import Mode


def test_the_engines_first_step_is_not_a_cost_sample():
    # The first step also warms the engine up (8.6 s for a 6-token prompt in a CPU run whose
    # 2,048-token prefills took 11 s): as a sample it would set the router's fixed step cost.
    measures = StepMeasures()
    measures.step_cost({}, 0, 0.01, False)  # nothing scheduled: not a step, and not the first one
    measures.step_cost({"r1": 6}, 6, 8.6, False)
    assert measures.samples.since(0) == []
    measures.step_cost({"r1": 6}, 6, 0.05, False)
    measures.step_cost({"r1": 1, "r2": 1}, 2, 0.04, True)
    measures.step_cost({"r1": 1}, 1, 0.0, False)  # no time measured: no sample
    # (sequences, prompt tokens, decoded tokens, seconds, merged)
    assert measures.samples.since(0) == [(1, 6, 0, 0.05, False), (2, 0, 2, 0.04, True)]


def test_queue_waits_and_step_costs_share_one_numbering():
    measures = StepMeasures()
    measures.queued("a", 1.0)
    measures.queued("b", 1.5)
    measures.step_cost({"a": 4}, 4, 0.5, False)  # the warm-up step
    measures.waits_end(["a"], 2.0)
    measures.step_cost({"a": 1}, 1, 0.1, False)
    measures.waits_end(["a", "b"], 3.0)  # a's wait already ended: only b's counts
    steps, waits = measures.since(0)
    assert steps == ((1, 0, 1, 0.1, False),)
    assert waits == (("a", 1.0), ("b", 1.5))
    assert measures.samples.seq == 3
    assert measures.since(2) == ((), (("b", 1.5),))


def test_the_policy_sees_a_step_with_its_prompt_tokens_and_switch_time():
    stats = iteration_stats({"a": 5, "b": 1}, 6, 0.3, 0.1, "x")
    assert (stats.mode, stats.merged_adapter, stats.num_requests) == (Mode.MERGED, "x", 2)
    assert (stats.num_tokens, stats.prefill_tokens, stats.iteration_time, stats.switch_time) == (6, 5, 0.3, 0.1)
    assert iteration_stats({}, 0, 0.01, 0.0, None).mode == Mode.UNMERGED
