"""The steps an engine reports for the router's cost model (`DloraScheduler._dlora_record_iteration`)."""

from __future__ import annotations

from types import SimpleNamespace

from dlora.engine_ext.samples import SampleLog
from dlora.engine_ext.scheduler import DloraScheduler


def step(tokens: dict[str, int]):
    return SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()))


def test_the_engines_first_step_is_not_a_cost_sample():
    # The first step also warms the engine up (8.6 s for a 6-token prompt in a CPU run whose
    # 2,048-token prefills took 11 s): as a sample it would set the router's fixed step cost.
    scheduler = SimpleNamespace(_dlora_warm=False, _dlora_samples=SampleLog())
    record = DloraScheduler._dlora_record_iteration
    record(scheduler, step({}), 0.01, None)  # nothing scheduled: not a step, and not the first one
    record(scheduler, step({"r1": 6}), 8.6, None)
    assert scheduler._dlora_samples.since(0) == []
    record(scheduler, step({"r1": 6}), 0.05, None)
    record(scheduler, step({"r1": 1, "r2": 1}), 0.04, "a")
    record(scheduler, step({"r1": 1}), 0.0, None)  # no time measured: no sample
    # (sequences, prompt tokens, decoded tokens, seconds, merged)
    assert scheduler._dlora_samples.since(0) == [(1, 6, 0, 0.05, False), (2, 0, 2, 0.04, True)]
