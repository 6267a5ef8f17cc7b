"""The skew benchmark's repetition and summary logic (bench/dynamic_batching_skew/run.py), no servers."""

from __future__ import annotations

import pytest

from bench.dynamic_batching_skew.run import (
    POLICIES,
    median_points,
    rep_points,
    schedule,
    summarize_reps,
)

SKEWS = [1.0, 10.0]


def test_schedule_runs_every_policy_once_per_rep_in_rotating_order_and_vllm_once():
    for k in range(4):
        runs = schedule(k, 3)
        assert runs.count((None, "vllm")) == 1
        for rep in range(3):
            order = [s for r, s in runs if r == rep]
            assert sorted(order) == sorted(POLICIES)
        firsts = {[s for r, s in schedule(k, 3) if r == rep][0] for rep in range(3)}
        assert firsts == set(POLICIES)  # no policy always goes first


def point(policy, skew, lat, rep=None):
    return {
        "policy": policy,
        "skew": skew,
        "top_share": 0.9 if skew == 10.0 else 0.12,
        "rep": rep,
        "metrics": {"avg_latency_per_output_token_ms": lat, "output_throughput": 1.0},
    }


def test_summary_uses_point_medians_and_reports_each_reps_own_ratios():
    lat = {  # (policy, skew) -> latency per rep; rep 2 is a slow machine for everyone
        ("unmerged", 1.0): [60, 62, 90],
        ("merged", 1.0): [180, 190, 270],
        ("dlora", 1.0): [61, 60, 91],
        ("unmerged", 10.0): [60, 64, 96],
        ("merged", 10.0): [66, 70, 99],
        ("dlora", 10.0): [55, 56, 84],
    }
    points = [point(p, s, v[r], r) for (p, s), v in lat.items() for r in range(3)]
    points += [point("vllm", s, 300.0) for s in SKEWS]
    assert [len(run) for run in rep_points(points, 3)] == [8, 8, 8]
    medians = {
        (p["policy"], p["skew"]): p["metrics"]["avg_latency_per_output_token_ms"]
        for p in median_points(rep_points(points, 3))
    }
    assert medians[("dlora", 10.0)] == 56 and medians[("unmerged", 1.0)] == 62 and medians[("vllm", 10.0)] == 300
    s = summarize_reps(points, SKEWS, 3, None)
    assert s["dlora_vs_better_baseline_min"] == pytest.approx(min(62 / 61, 64 / 56))
    assert s["dlora_vs_vllm_server_max_skew"] == pytest.approx(300 / 56)
    own = s["median_of_rep_ratios"]["per_skew"]["1.0"]["dlora_vs_better_baseline"]
    assert own == pytest.approx(sorted([60 / 61, 62 / 60, 90 / 91])[1])
    assert len(s["per_rep_summary"]) == 3
