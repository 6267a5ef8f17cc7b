"""Azure Functions 2019 trace replay on a small hand-made CSV."""

from __future__ import annotations

import numpy as np
import pytest

from dlora.bench import trace
from dlora.bench.workload import WorkloadSpec, generate_workload

MINUTES = 6


def _write_csv(path, rows):
    header = ["HashOwner", "HashApp", "HashFunction", "Trigger", *[str(m) for m in range(1, 1441)]]
    lines = [",".join(header)]
    for name, counts in rows:
        full = list(counts) + [0] * (1440 - len(counts))
        lines.append(",".join(["own", "app", name, "http", *map(str, full)]))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def small_trace(tmp_path):
    # per-minute invocations, minutes 1..6; totals: f_hot 60, f_mid 30, f_low 12, f_rare 3, f_idle 0
    rows = [
        ("f_low", [2, 2, 2, 2, 2, 2]),
        ("f_hot", [10, 10, 10, 10, 10, 10]),
        ("f_idle", [0, 0, 0, 0, 0, 0]),
        ("f_rare", [0, 0, 0, 1, 1, 1]),
        ("f_mid", [0, 0, 0, 10, 10, 10]),
    ]
    return _write_csv(tmp_path / "invocations_per_function_md.anon.d01.csv", rows)


def test_load_sorts_by_invocations_and_drops_idle(small_trace):
    ft = trace.load_azure_trace(small_trace, 0, MINUTES)
    assert [f.split("/")[-1] for f in ft.function_ids] == ["f_hot", "f_mid", "f_low", "f_rare"]
    assert ft.counts.sum(axis=1).tolist() == [60, 30, 12, 3]


def test_window_selects_minutes(small_trace):
    ft = trace.load_azure_trace(small_trace, 3, 6)  # minutes 4..6
    assert [f.split("/")[-1] for f in ft.function_ids] == ["f_hot", "f_mid", "f_low", "f_rare"]
    assert ft.counts.sum(axis=1).tolist() == [30, 30, 6, 3]


def test_stride_mapping_and_interval_counts(small_trace):
    ft = trace.load_azure_trace(small_trace, 0, MINUTES)
    # stride 1 onto 2 adapters: ranks 0,2 (hot, low) -> adapter 0; ranks 1,3 (mid, rare) -> adapter 1.
    counts = trace.adapter_interval_counts(ft, num_adapters=2, stride=1, interval_minutes=3)
    assert counts.tolist() == [[36, 0], [36, 33]]
    # stride 2: ranks 0,1 (hot, mid) -> adapter 0; ranks 2,3 (low, rare) -> adapter 1.
    counts = trace.adapter_interval_counts(ft, num_adapters=2, stride=2, interval_minutes=3)
    assert counts.tolist() == [[30, 6], [60, 9]]
    rates = trace.interval_rates(counts, total_rate=10.0)
    assert np.allclose(rates, [[10 * 30 / 36, 10 * 6 / 36], [10 * 60 / 69, 10 * 9 / 69]])


def test_too_few_functions(small_trace):
    ft = trace.load_azure_trace(small_trace, 0, MINUTES)
    with pytest.raises(ValueError, match="fewer than 5 adapters"):
        trace.adapter_interval_counts(ft, num_adapters=5)


def test_replay_follows_per_interval_mix(small_trace):
    # Interval 1: adapter 1 silent; interval 2: adapter 1 gets 33/69 = 47.8 %. 2 x 3000 requests.
    ft = trace.load_azure_trace(small_trace, 0, MINUTES)
    rates = trace.interval_rates(trace.adapter_interval_counts(ft, 2, 1, 3), total_rate=20.0)
    times, idx = trace.replay_arrivals(rates, 6000, np.random.default_rng(0), cv=1.0)
    assert np.all(np.diff(times) >= 0)
    first, second = idx[:3000], idx[3000:]
    assert np.all(first == 0)
    assert np.mean(second == 1) == pytest.approx(33 / 69, abs=0.03)
    assert len(times) / times[-1] == pytest.approx(20.0, rel=0.05)


def test_trace_workload_end_to_end(small_trace):
    spec = WorkloadSpec(
        num_prompts=200,
        adapters=("x", "y"),
        distribution="trace",
        trace_file=str(small_trace),
        trace_window=(0, MINUTES),
        trace_interval=3,
        request_rate=5.0,
        seed=3,
    )
    reqs = generate_workload(spec)
    assert len(reqs) == 200
    assert {r.adapter for r in reqs[:100]} == {"x"}  # the first interval only has adapter 0's functions
    assert {r.adapter for r in reqs[100:]} == {"x", "y"}


def test_bad_trace_file(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(ValueError, match="missing column"):
        trace.load_azure_trace(p)
