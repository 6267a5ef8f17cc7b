"""Algorithm 2: thresholds move by the documented amounts in the documented direction."""

from __future__ import annotations

import pytest

from dlora.scheduling import BatchingConfig, DLoRAPolicy, IterationStats, Mode
from dlora.scheduling.iteration_time import IterationTimeModel
from dlora.scheduling.thresholds import AdaptiveThresholds, PeriodSample, period_throughputs
from tests.scheduling.simlib import StepSim, flat_cost

U, M = Mode.UNMERGED, Mode.MERGED


def cost_with(mode: Mode, per_req: float) -> IterationTimeModel:
    """A cost model that has only seen `mode`, at batch size 10 taking 10 * `per_req` seconds."""
    cost = IterationTimeModel(merged_cost_ratio=0.6)
    for _ in range(3):
        cost.observe(mode, 10, 10 * per_req)
    return cost


def test_cost_model_fits_affine_and_scales_the_unseen_mode():
    cost = IterationTimeModel(merged_cost_ratio=0.5)
    assert cost.estimate(U, 4) is None
    for n in (2, 4, 8, 2, 4, 8):
        cost.observe(U, n, 0.01 + 0.002 * n)
    assert cost.estimate(U, 6) == pytest.approx(0.022)
    assert cost.estimate(M, 6) == pytest.approx(0.011)  # unseen mode: prior ratio
    assert cost.estimate(U, 0) == 0.0


def test_one_cold_sample_borrows_the_other_modes_shape_not_proportional():
    # Scaling one lone merged request (n=1, 0.03 s) proportionally would predict 10 x 0.03 = 0.3 s for
    # n=10, slower than unmerged, and Alg. 2 would never merge again. Unmerged: t = 0.05 + 0.004 n.
    cost = IterationTimeModel(merged_cost_ratio=0.6)
    for n in (4, 8, 12, 16):
        cost.observe(U, n, 0.05 + 0.004 * n)
    cost.observe(M, 1, 0.03)
    # Merged borrows the line through its own point: 0.03 * U(10) / U(1) = 0.03 * 0.09 / 0.054.
    assert cost.estimate(M, 10) == pytest.approx(0.03 * 0.09 / 0.054)
    assert cost.estimate(M, 10) < cost.estimate(U, 10)
    assert cost.estimate(M, 1) == pytest.approx(0.03)


def test_one_batch_size_and_no_shape_anywhere_assumes_half_fixed_cost():
    cost = IterationTimeModel(merged_cost_ratio=0.6)
    cost.observe(M, 2, 0.04)
    assert cost.estimate(M, 2) == pytest.approx(0.04)
    assert cost.estimate(M, 6) == pytest.approx(0.04 * (0.5 + 0.25 * 6))  # 0.02 fixed + 0.01 per request
    assert cost.estimate(U, 6) == pytest.approx(0.04 * 2.0 / 0.6)  # unseen mode: prior ratio


def test_period_throughputs_hand_worked_unmerged_period():
    # Unmerged seen at n=10 only (0.1 s): half fixed, half per request -> U(6) = 0.1 * (0.5 + 0.5 * 0.6)
    # = 0.08; merged estimate 0.6 x that = 0.048. 4 steps of |B'|=10 in 0.1 s, hypothetical |B|=6:
    # T_unmerge = 40/0.4 = 100; T_merge = 24/(4*0.048 + 0.02) = 113.2.
    cost = cost_with(U, 0.01)
    samples = [PeriodSample(U, 10, 0.1, 6)] * 4
    t_merge, t_unmerge = period_throughputs(samples, U, cost, switch_cost=0.02)
    assert t_unmerge == pytest.approx(100.0)
    assert t_merge == pytest.approx(24 / 0.212)


def tuner(cost, **kw) -> AdaptiveThresholds:
    cfg = BatchingConfig(**{"alpha": 0.9, "beta": 0.6, "break_period_iters": 4, **kw})
    return AdaptiveThresholds(cfg, cost)


def test_alpha_decreases_by_gamma_dec_when_merging_would_have_won():
    t = tuner(cost_with(U, 0.01))
    results = [t.record(PeriodSample(U, 10, 0.1, 6), "A", 0.02) for _ in range(4)]
    assert results[:3] == [None] * 3  # break point after N = 4 iterations
    assert results[3].threshold == "alpha" and results[3].t_merge > results[3].t_unmerge
    assert t.alpha == pytest.approx(0.85) and t.beta == 0.6
    assert t.samples == []  # a new period starts


def test_alpha_multiplies_by_gamma_mul_when_switch_cost_makes_merging_lose():
    t = tuner(cost_with(U, 0.01))
    for _ in range(4):  # T_merge = 24 / (0.144 + 1.0) = 21 < 100
        t.record(PeriodSample(U, 10, 0.1, 6), "A", switch_cost=1.0)
    assert t.alpha == pytest.approx(0.99)
    for _ in range(4):
        t.record(PeriodSample(U, 10, 0.1, 6), "A", switch_cost=1.0)
    assert t.alpha == 1.0  # capped: 0.99 * 1.1 > 1


def test_beta_moves_the_same_way_in_merged_periods():
    # Merged fit 0.006 s/request -> unmerged estimate 0.01 s/request. 4 merged steps of 6 in
    # 0.036 s vs FCFS 10: T_merge = 24/(0.144 + t_M), T_unmerge = 40/0.4 = 100.
    won = tuner(cost_with(M, 0.006))
    for _ in range(4):
        won.record(PeriodSample(M, 6, 0.036, 10), "A", 0.02)
    assert won.beta == pytest.approx(0.55) and won.alpha == 0.9
    lost = tuner(cost_with(M, 0.006))
    for _ in range(4):
        lost.record(PeriodSample(M, 6, 0.036, 10), "A", 1.0)
    assert lost.beta == pytest.approx(0.66)


@pytest.mark.parametrize("switch_cost", [0.02, 1.0])
def test_merged_steps_that_held_nobody_back_do_not_tune_beta(switch_cost):
    # Nobody waited (the FCFS batch was the merged batch): whatever the throughputs, beta stays.
    t = tuner(cost_with(M, 0.006))
    for _ in range(8):
        t.record(PeriodSample(M, 6, 0.036, 6), "A", switch_cost)
    assert t.beta == 0.6 and t.history == []
    # One step that held 4 requests back decides the period: T_merge 6/(0.036 + 1.0) < 10/0.1.
    for s in (PeriodSample(M, 6, 0.036, 6), PeriodSample(M, 6, 0.036, 10), PeriodSample(M, 6, 0.036, 6)):
        t.record(s, "A", 1.0)
    t.break_point(1.0)
    assert t.beta == pytest.approx(0.66)
    assert t.history[-1].t_merge == pytest.approx(6 / 1.036)


def test_with_mixing_every_merged_step_tunes_beta():
    # Mixed merged steps run B_fcfs: the same batch in both modes, and it is the question beta asks.
    t = AdaptiveThresholds(
        BatchingConfig(alpha=0.9, beta=0.6, break_period_iters=4, mixed_merged=True), cost_with(M, 0.006)
    )
    for _ in range(4):
        t.record(PeriodSample(M, 10, 0.06, 10), "A", 0.02)
    assert t.beta == pytest.approx(0.55)


def test_thresholds_keep_their_gap():
    t = tuner(cost_with(M, 0.006), alpha=0.7, beta=0.64)
    for _ in range(4):
        t.record(PeriodSample(M, 6, 0.036, 10), "A", 1.0)  # beta * 1.1 = 0.704 -> capped
    assert t.beta == pytest.approx(0.65)  # alpha - gap
    t2 = tuner(cost_with(U, 0.01), alpha=0.7, beta=0.64)
    for _ in range(4):
        t2.record(PeriodSample(U, 10, 0.1, 6), "A", 0.02)  # alpha - 0.05 = 0.65 < beta + gap
    assert t2.alpha == pytest.approx(0.69)


def test_mode_switch_and_candidate_change_are_break_points():
    t = tuner(cost_with(U, 0.01), break_period_iters=100)
    t.record(PeriodSample(U, 10, 0.1, 6), "A", 0.02)
    t.record(PeriodSample(U, 10, 0.1, 6), "A", 0.02)
    r = t.record(PeriodSample(U, 10, 0.1, 6), "B", 0.02)  # R_merge changed: tune on 2 samples
    assert r.iterations == 2 and t.alpha == pytest.approx(0.85)
    r = t.record(PeriodSample(M, 6, 0.06, 10), "B", 0.02)  # switch: tune alpha on the B sample
    assert r.threshold == "alpha" and r.iterations == 1
    assert len(t.samples) == 1 and t.mode is M


def test_samples_without_a_merge_candidate_do_not_tune():
    t = tuner(cost_with(U, 0.01))
    for _ in range(4):
        assert t.record(PeriodSample(U, 10, 0.1, 0), None, 0.02) is None
    assert t.alpha == 0.9


def test_policy_feeds_measured_switch_time_into_t_m():
    p = DLoRAPolicy(BatchingConfig())
    assert p.switch_cost == 0.02
    p.observe(IterationStats(U, None, 4, 0.5, switch_time=0.3))
    assert p.switch_cost == pytest.approx(0.3)  # first measurement replaces the prior
    p.observe(IterationStats(U, None, 4, 0.5, switch_time=0.1))
    assert p.switch_cost == pytest.approx(0.2)  # then an EMA


def _one_hot_adapter_sim(switch_time: float, **cfg) -> DLoRAPolicy:
    """A steady 9 A + 1 other long requests: ratio 0.9, not > alpha 0.9 at first."""
    config = BatchingConfig(
        max_batch=10,
        break_period_iters=8,
        initial_credit=50.0,
        t_starve=100.0,
        t_normal=60.0,
        merge_planner=False,  # Alg. 2 alone
        **cfg,
    )
    p = DLoRAPolicy(config)
    sim = StepSim(p, 10, flat_cost(0.05), switch_time=switch_time)
    for i in range(9):
        sim.add(f"A{i}", "A", at=0.0, output_len=10_000)
    sim.add("O", "o", at=0.0, output_len=10_000)
    sim.run_until(2.0)
    return p


@pytest.mark.parametrize("mixed, t_merge", [(False, 72 / 0.248), (True, 80 / 0.26)])
def test_policy_lowers_alpha_until_it_merges_when_merged_steps_are_cheaper(mixed, t_merge):
    # 0.05 s per unmerged step of 10 (half fixed) -> U(9) = 0.0475, merged estimate 0.6 * that =
    # 0.0285: T_merge = 72 / (8 * 0.0285 + 0.02) = 290 > T_unmerge = 80 / 0.4 = 200. Mixed, merging
    # would run all 10: T_merge = 80 / (8 * 0.6 * 0.05 + 0.02) = 308. alpha falls from 0.9 to 0.85
    # at the first break point (8 steps), and the next step merges A.
    p = _one_hot_adapter_sim(switch_time=0.02, mixed_merged=mixed)
    first = p.thresholds.history[0]
    assert (first.threshold, first.iterations, first.old) == ("alpha", 8, 0.9)
    assert first.new == pytest.approx(0.85)
    assert first.t_merge == pytest.approx(t_merge) and first.t_unmerge == pytest.approx(200)
    assert p.num_switches == 1 and p.mode is Mode.MERGED


def test_policy_raises_alpha_when_switching_is_too_expensive():
    p = _one_hot_adapter_sim(switch_time=0.02, switch_cost_s=5.0)
    assert p.thresholds.alpha > 0.9 and p.num_switches == 0
