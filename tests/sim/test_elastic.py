"""The elastic cluster in the replica model: scale-out on a burst, drains that lose nothing,
billing, and the same answers as the fixed model when nothing scales."""

from __future__ import annotations

import pytest

from dlora.cluster.autoscale import AutoscaleConfig
from dlora.sim.elastic import simulate_elastic
from dlora.sim.migration_bound import ReplicaModel, TraceRequest, simulate


def burst_then_lull(n_burst: int = 120, gap_s: float = 0.05) -> list[TraceRequest]:
    """A burst of `n_burst` requests, then one request a minute for ten minutes."""
    burst = [TraceRequest(i * gap_s, f"a{i % 4}", 64, 32, 32) for i in range(n_burst)]
    lull = [TraceRequest(n_burst * gap_s + 60.0 * (k + 1), "a0", 64, 32, 32) for k in range(10)]
    return burst + lull


MODEL = ReplicaModel(max_running=8)


def cfg(**kw) -> AutoscaleConfig:
    base = {"min_replicas": 1, "max_replicas": 4, "heartbeat_s": 1.0, "rate_window_s": 5.0, "min_arrivals": 5}
    return AutoscaleConfig(**{**base, **kw})


def test_a_burst_scales_out_and_the_lull_drains_back_to_the_minimum():
    jobs = burst_then_lull()
    got = simulate_elastic(jobs, MODEL, cfg(scale_in_cooldown_s=10.0), initial=1, startup_s=2.0)
    out = got.outcome
    assert len(out.latency_s) == len(jobs) and all(x > 0 for x in out.latency_s)  # every request finished
    ups = [e for e in got.events if e.replicas_to > e.replicas_from]
    downs = [e for e in got.events if e.replicas_to < e.replicas_from]
    assert ups and ups[0].at < 10.0  # the burst is seen within a few heartbeats
    assert max(e.replicas_to for e in got.events) > 1
    assert downs and got.replicas_over_time[-1][1] == 1  # back to the minimum in the lull
    # billed less than four replicas all along, more than one
    assert got.span_s < got.replica_seconds < 4 * got.span_s


def test_drains_move_running_requests_which_then_finish_whole():
    # a long burst keeps every replica busy when the scale-in comes
    jobs = [TraceRequest(i * 0.01, f"a{i % 2}", 32, 400, 400) for i in range(40)] + [
        TraceRequest(200.0, "a0", 32, 4, 4)
    ]
    got = simulate_elastic(
        jobs, MODEL, cfg(max_replicas=3, scale_in_cooldown_s=5.0, capacity_rps_prior=100.0), initial=3, startup_s=0.0
    )
    assert got.drained_requests > 0
    assert len(got.outcome.latency_s) == len(jobs)
    # a request of 400 tokens at one token a step takes at least 400 steps wherever it ran
    step = MODEL.costs.step(1, 0, 1, 0, 1)
    assert min(got.outcome.latency_s[:40]) >= 400 * step


def test_without_scaling_it_is_the_fixed_model():
    jobs = burst_then_lull(40, 0.5)
    fixed = simulate(jobs, 2, MODEL, "soonest_start")
    same = simulate_elastic(jobs, MODEL, cfg(min_replicas=2, max_replicas=2), initial=2, startup_s=0.0)
    assert same.events == []
    assert same.outcome.latency_s == pytest.approx(fixed.latency_s)
    assert same.replica_seconds == pytest.approx(2 * same.span_s)


def test_initial_outside_the_bounds_is_refused():
    with pytest.raises(ValueError, match="initial replicas 5"):
        simulate_elastic(burst_then_lull(), MODEL, cfg(), initial=5)
