"""bench/migration_bound/run.py's traces, and the modelled capacity its loads are fractions of (the
replica model itself: tests/sim)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.migration_bound.run import REGIMES, draw_lengths, homes, parse_args, trace
from dlora.bench.cluster_bench import make_workload, parse_settings
from dlora.sim.migration_bound import ReplicaModel, TraceRequest, capacity_rps
from dlora.sim.step_costs import StepCosts


def test_sharegpt_lengths_match_what_the_real_benchmark_measured():
    args = parse_args([])
    n = draw_lengths(20_000, 0, args)
    assert abs(np.mean(n == 256) - 0.68) < 0.02
    short = n[n < 256]
    assert short.min() >= 1 and short.max() <= 205
    assert abs(n.mean() - 207) < 4  # the measured greedy mean (~207 tokens)
    assert (draw_lengths(50, 3, args) == draw_lengths(50, 3, args)).all()


def test_fixed_trace_is_the_cluster_benchmarks_own_workload():
    fixed = next(r for r in REGIMES if r.name == "fixed-8")
    jobs = trace(fixed, 2.0, 1, parse_args(["--num-prompts", "20"]), tokenizer=None)
    bench = make_workload(parse_settings(["--workload", "fixed"]), 2.0, 1, 20, None)
    assert [(j.arrival, j.adapter, j.output_len) for j in jobs] == [
        (r.arrival_time, r.adapter, r.output_len) for r in bench
    ]
    assert {j.prompt_len for j in jobs} == {48} and {j.max_tokens for j in jobs} == {32}


def test_capacity_is_full_batches_of_the_mean_output_plus_prefill():
    costs = StepCosts(
        fixed_s=1.0,
        per_seq_s=0.0,
        per_prefill_token_s=0.25,
        lora_fixed_s=0.0,
        lora_per_seq_s=0.0,
        lora_per_prefill_token_s=0.0,
    )
    jobs = [TraceRequest(0, "x", 4, 3, 8), TraceRequest(0, "x", 4, 5, 8)]
    # a batch of 2: 4 steps of 1 s for the mean output, plus 2 prompts x 4 tokens x 0.25 s = 6 s per 2 requests
    assert capacity_rps(ReplicaModel(max_running=2, costs=costs), 3, jobs) == pytest.approx(3 * 2 / 6)


def test_bad_flags_are_refused_by_name(capsys):
    for argv, needle in (
        (["--regimes", "nope"], "unknown regime 'nope'"),
        (["--p-cap", "2"], "--p-cap 2.0"),
        (["--short-max", "300"], "--short-max 300"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert needle in capsys.readouterr().err


def test_static_homes_follow_the_benchmarks_registration_order():
    regime = next(r for r in REGIMES if r.name == "sharegpt-eos-32")
    got = homes(regime, 2)
    assert len(got) == 32 and got["a0"] == 1 and got["a1"] == 0 and got["a31"] == 0
