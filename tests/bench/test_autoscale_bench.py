"""bench/autoscale's pure parts: its arrivals, what it counts as a failed or changed stream, the
per-phase SLO attainment from /metrics samples, the replica-seconds."""

from __future__ import annotations

import pytest

from bench.autoscale import run as bench
from bench.autoscale.run import Outcome, attainment_between, summarize


def test_arrivals_follow_the_three_phases_rates():
    args = bench.parse_args(["--phases", "100,100,100", "--low", "0.5", "--high", "2.0"])
    got = bench.arrivals(args, capacity=1.0)
    counts = {p: sum(1 for o in got if o.phase == p) for p in ("low", "high", "low-again")}
    assert 30 < counts["low"] < 75 and 150 < counts["high"] < 250 and 30 < counts["low-again"] < 75
    assert all(0 <= o.arrival_s < 100 for o in got if o.phase == "low")
    assert all(100 <= o.arrival_s < 200 for o in got if o.phase == "high")
    assert [o.arrival_s for o in got] == sorted(o.arrival_s for o in got)


@pytest.mark.parametrize("bad", ["1,2", "1,x,3", "0,1,1"])
def test_bad_phases_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--phases", bad])
    assert "--phases" in capsys.readouterr().err


def sample(t, serving, met=0.0, missed=0.0):
    return {"t": t, "replicas": {"serving": serving}, "slo_met": met, "slo_missed": missed}


def test_summary_counts_failed_and_changed_streams_and_replica_seconds():
    refs = {(0, "a0"): "abc", (1, None): "xyz"}
    outcomes = [
        Outcome(0, 0, "a0", "low", 1.0, ttft_s=0.1, text="abc", finish_reason="length"),
        Outcome(1, 1, None, "high", 12.0, ttft_s=0.5, text="xyzxyz", finish_reason="length"),  # restarted
        Outcome(2, 0, "a0", "high", 13.0, error="HTTP 503"),
        Outcome(3, 1, None, "low-again", 25.0, ttft_s=0.2, text="xyz", finish_reason="length"),
    ]
    samples = [sample(0, 1), sample(10, 1, 1, 0), sample(15, 2, 1, 1), sample(20, 1, 2, 1), sample(30, 1, 3, 1)]
    got = summarize(outcomes, samples, refs, [10, 10, 10], capacity=2.0)
    assert (got["failed_streams"], got["mismatched_streams"]) == (1, 1)
    assert got["failed_indices"] == [2] and got["mismatched_indices"] == [1]
    assert got["replica_seconds"] == 10 + 5 + 10 + 10  # 1 x 10 s, 1 x 5 s, 2 x 5 s, 1 x 10 s
    assert got["replica_seconds_fixed_two"] == 60 and got["replica_seconds_saved_vs_fixed_two"] == round(1 - 35 / 60, 3)
    assert got["second_replica_serving_after_high_start_s"] == 5.0 and got["back_to_one_replica_at_s"] == 20
    assert got["per_phase"]["high"]["requests"] == 2 and got["per_phase"]["high"]["ttft_p50_s"] == 0.5


def test_attainment_between_two_times_is_the_share_met_among_those_finished_in_between():
    samples = [sample(0, 1), sample(5, 1, 2, 0), sample(10, 1, 3, 3), sample(15, 1, 3, 3)]
    assert attainment_between(samples, 0, 5) == 1.0  # from the first sample: what finished before is not counted
    assert attainment_between([sample(0, 1, 7, 7), sample(5, 1, 9, 7)], 0, 5) == 1.0
    assert attainment_between(samples, 6, 10) == 0.25  # 1 met, 3 missed since t=5
    assert attainment_between(samples, 11, 15) is None  # nothing finished


def test_the_operator_drain_takes_the_busiest_serving_replica_and_never_the_last():
    def listing(*rows):
        return {"data": [{"id": i, "state": st, "requests": n} for i, st, n in rows]}

    assert bench.busiest_serving(listing((0, "serving", 1), (1, "serving", 3)))["id"] == 1
    assert bench.busiest_serving(listing((0, "serving", 2), (1, "serving", 2)))["id"] == 0  # lowest id of equals
    assert bench.busiest_serving(listing((0, "serving", 1), (1, "draining", 5), (2, "serving", 0)))["id"] == 0
    assert bench.busiest_serving(listing((0, "serving", 4), (1, "starting", 0))) is None  # the last serving one
    assert bench.parse_args(["--phases", "10,20,30"]).operator_drain_at == 20.0  # the high phase's middle
    assert bench.parse_args(["--operator-drain-at", "-1"]).operator_drain_at == -1.0
