"""Workload generation: fixed-seed statistics, determinism, rate independence, JSONL round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from dlora.bench.popularity import popularity_shares
from dlora.bench.workload import (
    Request,
    WorkloadError,
    WorkloadSpec,
    generate_workload,
    load_workload,
    retime,
    save_workload,
)

ADAPTERS = tuple(f"a{i}" for i in range(5))


def _spec(**kw):
    base = dict(num_prompts=4000, adapters=ADAPTERS, distribution="zipf", alpha=1.0, request_rate=20.0, cv=2.0, seed=42)
    return WorkloadSpec(**(base | kw))


@pytest.fixture(scope="module")
def zipf_workload():
    return generate_workload(_spec(), with_prompts=False)


def test_fixed_seed_statistics(zipf_workload):
    reqs = zipf_workload
    # popularity: 4000 draws, share standard error <= 0.008 -> 0.025 tolerance (> 3 sigma)
    shares = np.array([sum(r.adapter == a for r in reqs) for a in ADAPTERS]) / len(reqs)
    assert np.allclose(shares, popularity_shares("zipf", 5, 1.0), atol=0.025)
    # arrivals: rate within 5 %, CV of gaps within 10 % of 2.0
    t = np.array([r.arrival_time for r in reqs])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert len(t) / t[-1] == pytest.approx(20.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.10)
    # lengths: the default sharegpt-like profile, means 161 / 338 within 5 %
    assert np.mean([r.prompt_len for r in reqs]) == pytest.approx(161, rel=0.05)
    assert np.mean([r.output_len for r in reqs]) == pytest.approx(338, rel=0.05)


def test_deterministic_for_a_seed():
    a = generate_workload(_spec(num_prompts=50))
    b = generate_workload(_spec(num_prompts=50))
    c = generate_workload(_spec(num_prompts=50, seed=43))
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_rate_changes_only_arrival_times():
    slow = generate_workload(_spec(num_prompts=300, request_rate=2.0))
    fast = generate_workload(_spec(num_prompts=300, request_rate=8.0))
    assert [(r.adapter, r.prompt, r.output_len) for r in slow] == [(r.adapter, r.prompt, r.output_len) for r in fast]
    assert np.allclose([r.arrival_time / 4 for r in slow], [r.arrival_time for r in fast])


def test_per_adapter_profiles_and_fixed_lengths():
    spec = _spec(num_prompts=2000, length_profiles=("code", "summarization"), max_model_len=100_000)
    reqs = generate_workload(spec, with_prompts=False)
    code = [r for r in reqs if r.adapter in ("a0", "a2", "a4")]
    summ = [r for r in reqs if r.adapter in ("a1", "a3")]
    assert np.mean([r.prompt_len for r in code]) == pytest.approx(156.5, rel=0.1)
    assert np.mean([r.prompt_len for r in summ]) == pytest.approx(13186.8, rel=0.1)
    fixed = generate_workload(_spec(num_prompts=20, input_len=32, output_len=8))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(32, 8)}
    assert all(len(r.prompt.split()) == 32 for r in fixed)


def test_length_scale_and_cap():
    reqs = generate_workload(_spec(num_prompts=500, length_scale=4.0, max_model_len=1024), with_prompts=False)
    assert max(r.prompt_len + r.output_len for r in reqs) <= 1024
    base = generate_workload(_spec(num_prompts=500), with_prompts=False)
    small = [(b, r) for b, r in zip(base, reqs) if 4 * (b.prompt_len + b.output_len) <= 1024]
    assert small and all(r.prompt_len == 4 * b.prompt_len for b, r in small)


def test_base_model_only_and_infinite_rate():
    reqs = generate_workload(WorkloadSpec(num_prompts=10, input_len=8, output_len=4))
    assert all(r.adapter is None and r.arrival_time == 0.0 for r in reqs)


def test_jsonl_round_trip(tmp_path):
    spec = _spec(num_prompts=30, request_rate=math.inf)
    reqs = generate_workload(spec)
    path = tmp_path / "w.jsonl"
    save_workload(path, reqs, spec)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["dlora_workload"] == 1 and header["spec"]["request_rate"] == "inf"
    loaded, loaded_spec = load_workload(path)
    assert loaded == reqs
    assert loaded_spec == spec


def test_retime_keeps_requests():
    reqs = [Request(f"r{i}", 0.0, "a0", "x y", 2, 3) for i in range(100)]
    timed = retime(reqs, 10.0, cv=1.0, seed=1)
    assert [dataclasses.replace(r, arrival_time=0.0) for r in timed] == reqs
    assert timed[-1].arrival_time == pytest.approx(10.0, rel=0.3)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(num_prompts=0), "num_prompts"),
        (dict(request_rate=-1.0), "request_rate"),
        (dict(cv=0.0), "cv"),
        (dict(distribution="nope"), "distribution"),
        (dict(length_profiles=("chat", "poetry")), "length_profiles"),
        (dict(distribution="trace"), "trace_file"),
        (dict(diurnal_amplitude=0.3, request_rate=math.inf), "request_rate"),
        (dict(adapters=("a", "a")), "adapters"),
    ],
)
def test_spec_validation_names_the_field(kw, field):
    with pytest.raises(WorkloadError) as e:
        _spec(**kw)
    assert e.value.field == field
