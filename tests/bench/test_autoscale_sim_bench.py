"""bench/autoscale_sim/run.py's flags, sizing and summary (the model: tests/sim/test_elastic.py)."""

from __future__ import annotations

import pytest

from bench.autoscale_sim.run import fixed_mean, parse_args, per_minute, summarize
from dlora.sim.migration_bound import TraceRequest


def test_quick_is_small_and_written_outside_the_repository():
    args = parse_args(["--quick"])
    assert args.scales == [4] and args.period == 600.0
    assert not args.out.endswith("bench/autoscale_sim/result.json")
    assert parse_args([]).scales == [8, 32]


@pytest.mark.parametrize("argv, needle", [(["--scales", "x"], "--scales"), (["--amplitude", "1.5"], "--amplitude")])
def test_bad_flags_are_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert needle in capsys.readouterr().err


def test_fixed_mean_sizes_for_the_mean_rate_at_the_utilization_target():
    jobs = [TraceRequest(float(i), "a", 1, 1, 1) for i in range(3600)]  # 1 req/s all day
    assert fixed_mean(jobs, per_replica=0.25, period=3600.0, most=32) == 5  # 1 / (0.25 * 0.8)
    assert fixed_mean(jobs, per_replica=0.25, period=3600.0, most=3) == 3


def test_arrivals_per_minute():
    got = per_minute(
        [TraceRequest(1.0, "a", 1, 1, 1), TraceRequest(59.0, "a", 1, 1, 1), TraceRequest(130.0, "a", 1, 1, 1)]
    )
    assert got == {"t": [30.0, 90.0, 150.0], "rps": [2 / 60, 0.0, 1 / 60]}


def test_summary_against_the_fixed_peak_cluster():
    def run(rs: float, att: float) -> dict:
        return {"replica_seconds": rs, "slo_attainment": att}

    scale = {
        "replicas": 8,
        "runs": {"fixed_max": run(1000, 1.0), "fixed_mean": run(500, 0.5), "autoscaled": run(600, 0.995)},
    }
    got = summarize([scale])["8_replicas"]
    assert got["replica_seconds_saved_vs_fixed_max"] == pytest.approx(0.4)
    assert got["attainment_vs_fixed_max"] == pytest.approx(0.995) and got["met"] is True
    scale["runs"]["autoscaled"] = run(800, 0.995)
    assert summarize([scale])["8_replicas"]["met"] is False
