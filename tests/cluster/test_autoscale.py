"""The autoscaler's decisions, worked by hand: the fitted line, the rate window, hysteresis,
cool-downs, drains. Heartbeats are 10 s apart, each sample covering the 10 s before it."""

from __future__ import annotations

import pytest

from dlora.cluster.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    CapacityLine,
    DrainCost,
    LoadSample,
    drain_choice,
)

W = 10.0


def sample(
    now, replicas, arrivals, *, completions=None, tokens=0, finished_tokens=0, saturated=False, slo=None, wait=None
):
    done = arrivals if completions is None else completions
    return LoadSample(now, W, replicas, arrivals, done, tokens, finished_tokens, saturated, slo, wait)


def scaler(**kw) -> Autoscaler:
    kw = {"heartbeat_s": W, "rate_window_s": W, "max_replicas": 8, "target_utilization": 1.0, **kw}
    return Autoscaler(AutoscaleConfig(**kw))


def test_line_through_the_origin_with_one_replica_count_seen():
    line = CapacityLine(8, prior_rps=None)
    assert line.coefficients() is None and line.replicas_for(5.0, 1.0) is None
    line.observe(4.0, 2)  # two replicas serve 4 req/s: 0.5 replica per req/s
    line.observe(4.0, 2)
    assert line.coefficients() == pytest.approx((0.5, 0.0))
    assert line.replicas_for(10.0, 1.0) == 5
    assert line.replicas_for(10.0, 0.8) == 7  # ceil(6.25) with 80% headroom


def test_line_least_squares_through_the_origin_plus_the_extra_replicas():
    line = CapacityLine(8, prior_rps=None, extra=1)
    for rate, n in [(2.0, 1), (4.0, 2), (8.0, 3)]:  # k = (2 + 8 + 24) / (4 + 16 + 64)
        line.observe(rate, n)
    k, c = line.coefficients()
    assert k == pytest.approx(34 / 84) and c == 1.0
    assert line.replicas_for(21.0, 1.0) == 10  # 8.5 + 1


def test_prior_stands_in_until_measured():
    line = CapacityLine(8, prior_rps=2.0)
    assert line.replicas_for(5.0, 1.0) == 3
    line.observe(8.0, 2)  # measured: 4 req/s per replica
    assert line.replicas_for(5.0, 1.0) == 2


def test_scales_out_on_rate_then_waits_out_the_cooldown():
    a = scaler(capacity_rps_prior=2.0, scale_out_cooldown_s=15.0)
    d = a.decide(sample(10.0, 1, 60))  # 6 req/s, 2 req/s a replica
    assert (d.replicas, d.reason, d.planned) == (3, "rate", 3)
    d = a.decide(sample(20.0, 3, 100))  # 10 req/s wants 5, but 10 s < the 15 s cool-down
    assert d.replicas == 3 and d.reason == "" and d.planned == 5
    d = a.decide(sample(30.0, 3, 100))
    assert (d.replicas, d.reason) == (5, "rate")


def test_rate_is_measured_over_the_rate_window():
    a = scaler(capacity_rps_prior=1.0, rate_window_s=30.0, scale_out_cooldown_s=0.0)
    assert a.decide(sample(10.0, 1, 0)).planned is None  # no arrivals yet: under the floor
    assert a.decide(sample(20.0, 1, 30)).planned == 2  # 30 in 20 s: 1.5 req/s
    assert a.decide(sample(30.0, 2, 60)).planned == 3  # 90 in 30 s
    assert a.decide(sample(40.0, 3, 0)).planned == 3  # 90 in 30 s (the first window fell out)
    assert a.decide(sample(50.0, 3, 0)).planned == 2  # 60 in 30 s


def test_capped_at_max_and_raised_to_min():
    a = scaler(min_replicas=2, max_replicas=4, capacity_rps_prior=1.0)
    assert (a.decide(sample(10.0, 1, 0)).replicas, a.decide(sample(10.0, 1, 0)).reason) == (2, "min")
    d = a.decide(sample(100.0, 2, 500))
    assert (d.replicas, d.reason) == (4, "rate")


def test_too_few_arrivals_do_not_drive_the_rule():
    a = scaler(capacity_rps_prior=0.1, min_arrivals=20)
    d = a.decide(sample(10.0, 1, 19))  # 1.9 req/s would want 19 replicas by the prior
    assert d.replicas == 1 and d.planned is None


def test_slo_pressure_adds_one_replica_whatever_the_rule_says():
    a = scaler(capacity_rps_prior=100.0, scale_out_cooldown_s=15.0)
    d = a.decide(sample(10.0, 2, 30, slo=0.80))
    assert (d.replicas, d.reason) == (3, "slo")
    d = a.decide(sample(30.0, 3, 30, wait=5.0))
    assert (d.replicas, d.reason) == (4, "queue")


def test_scale_in_waits_for_quiet_and_goes_one_at_a_time():
    a = scaler(capacity_rps_prior=2.0, hysteresis=0.2, scale_in_cooldown_s=60.0)
    assert a.decide(sample(10.0, 1, 100)).replicas == 5  # 10 req/s
    assert a.decide(sample(40.0, 5, 30)).replicas == 5  # 3 req/s needs 2, but the change was 30 s ago
    d = a.decide(sample(70.0, 5, 30))
    assert (d.replicas, d.reason) == (4, "rate")  # one at a time
    assert a.decide(sample(100.0, 4, 30)).replicas == 4  # the cool-down counts from that change too
    assert a.decide(sample(130.0, 4, 30)).replicas == 3


def test_hysteresis_keeps_a_replica_that_a_little_more_load_would_need():
    a = scaler(capacity_rps_prior=2.0, hysteresis=0.2, scale_in_cooldown_s=0.0)
    # 3.6 req/s fits 2 replicas (1.8), but 20% more (4.32 req/s) needs 3: stay at 3
    assert a.decide(sample(100.0, 3, 36)).replicas == 3
    # 3.2 req/s: 20% more is 3.84, fits 2
    assert a.decide(sample(200.0, 3, 32)).replicas == 2


def test_below_the_floor_scale_in_plans_for_the_floor_rate():
    a = scaler(capacity_rps_prior=0.5, min_arrivals=20, hysteresis=0.0, scale_in_cooldown_s=0.0)
    # 5 arrivals in 10 s is under the floor: planned as 20 in 10 s (2 req/s), which needs 4
    assert a.decide(sample(100.0, 5, 5)).replicas == 4
    assert a.decide(sample(200.0, 4, 5)).replicas == 4


def test_an_idle_window_scales_in_even_where_the_floor_rate_needs_every_replica():
    a = scaler(capacity_rps_prior=0.5, min_arrivals=20, hysteresis=0.0, scale_in_cooldown_s=0.0)
    assert a.decide(sample(100.0, 4, 5)).replicas == 4  # the floor (2 req/s) needs the 4
    d = a.decide(sample(200.0, 4, 0))  # nothing arrived over the rate window
    assert (d.replicas, d.reason) == (3, "idle")
    assert a.decide(sample(300.0, 3, 0)).replicas == 2  # one at a time
    assert a.decide(sample(400.0, 2, 0, saturated=True)).replicas == 2  # still busy with what it has


def test_nothing_measured_scales_in_only_when_nothing_arrives():
    a = scaler(scale_in_cooldown_s=0.0)
    assert a.decide(sample(100.0, 3, 5)).replicas == 3
    d = a.decide(sample(200.0, 3, 0))
    assert (d.replicas, d.reason) == (2, "idle")


def test_no_scale_in_right_after_pressure_or_while_saturated():
    a = scaler(capacity_rps_prior=2.0, scale_in_cooldown_s=60.0)
    a.decide(sample(10.0, 4, 0, slo=0.5))  # pressure at t=10 (and one replica more)
    assert a.decide(sample(60.0, 5, 0)).replicas == 5  # 50 s after the pressure
    assert a.decide(sample(110.0, 5, 0, saturated=True)).replicas == 5
    assert a.decide(sample(120.0, 5, 0)).replicas == 4


def test_the_line_is_fitted_from_saturated_heartbeats_in_requests_their_tokens_make():
    a = scaler(max_replicas=16, min_finished=8)
    # full, but nothing finished yet: the tokens cannot be turned into requests
    a.decide(sample(10.0, 2, 100, completions=0, tokens=800, saturated=True))
    assert a.line.coefficients() is None
    # 10 finished with 100 tokens each: 800 tokens in 10 s on 2 full replicas = 0.8 req/s
    a.decide(sample(20.0, 2, 100, completions=10, tokens=800, finished_tokens=1000, saturated=True))
    assert a.line.coefficients() == pytest.approx((2.5, 0.0))
    a.decide(sample(30.0, 2, 100, completions=10, tokens=100, finished_tokens=1000))  # not full: no point
    assert a.line.coefficients() == pytest.approx((2.5, 0.0))


def test_config_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscaleConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="target_utilization"):
        AutoscaleConfig(target_utilization=0.0)


def test_drain_choice_moves_the_least_context():
    costs = [DrainCost(0, 0, 900), DrainCost(1, 5, 100), DrainCost(2, 1, 100), DrainCost(3, 1, 100)]
    assert drain_choice(costs) == 3  # least recompute, then fewest queued, then the newest
    with pytest.raises(ValueError):
        drain_choice([])
