"""The replica model with prefix caches: a replica's engine prefills only what its cache lacks, and
prefix-aware dispatch (the server's code) sends a repeated prompt back to the replica holding it."""

from __future__ import annotations

import pytest

from dlora.sim.model_io import ReplicaModel, TraceRequest
from dlora.sim.prefix_model import PrefixCluster

HISTORY = tuple(range(600))  # 4 full blocks of 128 before its last token
OTHER = tuple(range(10_000, 10_300))
MODEL = ReplicaModel(max_running=64, kv_blocks=182, block_tokens=128)


def run(dispatch: str, start_slack_s: float | None = None) -> PrefixCluster:
    jobs = [
        TraceRequest(0.0, "a", len(HISTORY), 2, 2),  # computes HISTORY on replica 0 (the lower id of two idle)
        TraceRequest(5.0, "b", len(OTHER), 100, 100),  # a backlog there: 100 decode steps
        TraceRequest(6.0, "a", len(HISTORY), 2, 2),  # the same prompt again
    ]
    model = PrefixCluster(jobs, [HISTORY, OTHER, HISTORY], 2, MODEL, dispatch, start_slack_s)
    model.run()
    return model


@pytest.mark.parametrize("start_slack_s", [None, 0.05], ids=["pending time alone", "with the start slack"])
def test_prefix_aware_dispatch_reuses_the_cached_history_despite_the_backlog(start_slack_s):
    model = run("prefix", start_slack_s)
    assert model.locality_dispatches == 1
    assert model.hit_tokens == 4 * 128
    assert model.prompt_tokens == 2 * len(HISTORY) + len(OTHER)


def test_blind_dispatch_sends_the_repeat_to_the_idle_replica_and_prefills_it_all():
    model = run("today")
    assert model.locality_dispatches == 0
    assert model.hit_tokens == 0


def test_an_unknown_dispatch_is_refused():
    with pytest.raises(ValueError, match="dispatch 'nearest'"):
        PrefixCluster([], [], 2, MODEL, "nearest")
