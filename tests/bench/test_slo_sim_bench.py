"""bench/slo_sim/run.py's flags, rates and summary (the model and the study: tests/sim/test_slo_sim.py)."""

from __future__ import annotations

import pytest

from bench.slo_sim.run import at_rate, parse_args, summarize
from dlora.sim.migration_bound import TraceRequest


def test_quick_is_one_small_scale_written_outside_the_repository():
    args = parse_args(["--quick"])
    assert (args.scales, args.loads, args.seeds) == ([(8, 8)], [0.8], 1)
    assert not args.out.endswith("bench/slo_sim/result.json")
    assert parse_args([]).scales == [(8, 8), (32, 32)]


def test_bad_flags_are_refused_by_name(capsys):
    for argv, needle in ((["--scales", "8"], "--scales"), (["--configs", "nope"], "unknown configuration 'nope'")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert needle in capsys.readouterr().err


def test_a_rate_rescales_the_arrival_times_only():
    jobs = [TraceRequest(0.0, "a", 5, 3, 8), TraceRequest(2.0, "b", 6, 4, 8)]
    assert at_rate(jobs, 4.0) == [TraceRequest(0.0, "a", 5, 3, 8), TraceRequest(0.5, "b", 6, 4, 8)]


def test_summary_is_taken_at_the_highest_load():
    def point(load: float, nl: dict[str, float]) -> dict:
        means = {
            c: {"normalized_latency": v, "slo_attainment": 0.5, "slo_attainment_coldest_adapter": 0.25}
            for c, v in nl.items()
        }
        return {"load": load, "rate": 10 * load, "mean_over_seeds": means}

    scale = {
        "replicas": 8,
        "adapters": 8,
        "points": [point(1.2, {"fcfs": 6.0, "seallm": 3.0}), point(0.4, {"fcfs": 1.0, "seallm": 1.0})],
        "search": {"rate": 8.0, "replicas_for_target": {"fcfs": 20, "seallm": None}},
    }
    got = summarize([scale], ["fcfs", "seallm"])["8_replicas"]
    assert got["load"] == 1.2 and got["normalized_latency_vs_fcfs"] == {"fcfs": 1.0, "seallm": 2.0}
    assert got["replicas_for_99pct"] == {"fcfs": 20, "seallm": None} and got["slo_attainment"]["seallm"] == 0.5
