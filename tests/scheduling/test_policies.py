"""Policy behaviour over simulated steps: baselines, contract, and the starvation bound."""

from __future__ import annotations

import random

import pytest

from dlora.scheduling import (
    BatchingConfig,
    DLoRAPolicy,
    IterationStats,
    MergedPolicy,
    Mode,
    Switch,
    UnmergedPolicy,
    check_decision,
    make_policy,
    policy_names,
)
from tests.scheduling.simlib import StepSim, flat_cost, linear_cost, req, reqs


def test_unmerged_allows_the_fcfs_batch():
    rs = reqs([("A", 3), (None, 2), ("B", 70)])[::-1]
    fcfs = tuple(r.req_id for r in sorted(rs, key=lambda r: r.arrival_time))
    d = UnmergedPolicy().decide(rs, now=0.0, max_batch=4)
    assert d.mode is Mode.UNMERGED and d.switch is Switch.NONE and d.merged_adapter is None
    assert d.allowed_req_ids == fcfs[:4]
    check_decision(d, rs, max_batch=4)  # more requests than max_batch: still within the contract
    assert UnmergedPolicy(BatchingConfig(max_batch=64)).decide(rs, now=0.0).allowed_req_ids == fcfs[:64]


def test_merged_serves_oldest_model_and_never_mixes():
    p = MergedPolicy(BatchingConfig(max_batch=8))
    rs = [req("b0", "B", 0.0), req("a0", "A", 1.0), req("b1", "B", 2.0), req("n0", None, 3.0)]
    d = p.decide(rs, 0.0)
    assert (d.mode, d.merged_adapter, d.switch, d.allowed_req_ids) == (Mode.MERGED, "B", Switch.MERGE, ("b0", "b1"))
    rs = rs[1:3] + rs[3:]  # b0 done: B still has b1, stays merged
    assert p.decide(rs, 1.0).allowed_req_ids == ("b1",)
    rs = [r for r in rs if r.adapter != "B"]  # B's queue empty: oldest is A -> straight from B to A
    d = p.decide(rs, 2.0)
    assert (d.mode, d.merged_adapter, d.switch, d.allowed_req_ids) == (Mode.MERGED, "A", Switch.MERGE, ("a0",))
    d = p.decide(rs, 3.0)
    assert (d.mode, d.merged_adapter, d.switch) == (Mode.MERGED, "A", Switch.NONE)
    rs = [r for r in rs if r.adapter != "A"]  # only base left: unmerge, base requests alone
    d = p.decide(rs, 4.0)
    assert (d.mode, d.switch, d.allowed_req_ids) == (Mode.UNMERGED, Switch.UNMERGE, ("n0",))


def test_merged_moves_on_after_its_bound_while_others_wait():
    p = MergedPolicy(BatchingConfig(max_batch=8, merged_max_iters=3))
    rs = [req("a0", "A", 0.0), req("b0", "B", 1.0)]
    adapters = [p.decide(rs, float(t)).merged_adapter for t in range(8)]
    # 3 steps on A, 3 on B (switched to directly), back to A
    assert adapters == ["A", "A", "A", "B", "B", "B", "A", "A"]
    solo = MergedPolicy(BatchingConfig(max_batch=8, merged_max_iters=3))
    assert {solo.decide([req("a0", "A", 0.0)], float(t)).merged_adapter for t in range(10)} == {"A"}


def random_workload(sim: StepSim, seed: int, n: int = 300, adapters: int = 5) -> None:
    rng = random.Random(seed)
    t = 0.0
    for i in range(n):
        t += rng.expovariate(40.0)
        a = rng.choices([None] + [f"l{k}" for k in range(adapters)], weights=[1, 20, 3, 2, 1, 1])[0]
        sim.add(f"r{i}", a, t, rng.randint(1, 30))


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contract_holds_and_every_request_finishes(name, seed):
    # StepSim checks every decision: never empty while requests exist, merged never mixes, ...
    p = make_policy(name, BatchingConfig(max_batch=8, break_period_iters=8))
    sim = StepSim(p, 8, linear_cost(0.002, 0.001, 0.5))
    random_workload(sim, seed)
    sim.run_to_completion()
    for _, d in sim.decisions:
        if d.mode is Mode.MERGED:
            assert d.merged_adapter is not None
    if name == "dlora":
        assert any(d.mode is Mode.MERGED for _, d in sim.decisions)  # skewed enough to merge
        assert any(d.mode is Mode.UNMERGED for _, d in sim.decisions)


def test_dlora_merges_the_hot_adapter_until_the_cold_one_starves_then_serves_it_first():
    # Alg. 1 and Alg. 3 alone (the merge planner off), worked by hand. max_batch 4, every step
    # 0.5 s, switches free. At t=0: c0 (adapter C, 1 token) and h0..h3 (H, 4 tokens each);
    # c0 sorts first, so B_fcfs = [c0, h0, h1, h2]. Credits start at 1.0, relax 0.25 per step.
    # alpha and beta stay put: Alg. 2 would tune them only at a period's end (32 steps, or a
    # change of mode or candidate among the steps it samples; the starvation step is not one).
    #   t=0.0  H: ratio 4/4 = 1.0 > alpha 0.7, eligible (no step yet: cost 0) -> MERGE H, h0..h3;
    #          c0 is in B_fcfs but left out: H owes C the step.
    #   t=0.5  settle: C 1.0+0.5 = 1.5 (held back: no relax); H 1.0-0.5 = 0.5, relaxed to 0.75.
    #          H eligible: 0.75 - 0.5 x 1 receiver = 0.25 >= 0; ratio 1.0 >= beta 0.3 -> stay.
    #   t=1.0  C 2.0 (not > t_starve 2.0); H 0.75-0.5 = 0.25, relaxed to 0.5; eligible:
    #          0.5 - 0.5 = 0 >= min_credit_to_merge 0 -> stay.
    #   t=1.5  C 2.5 > 2.0: starving; H 0.0 -> 0.25, no longer eligible (0.25 - 0.5 < 0), so
    #          Alg. 1 unmerges and the starvation step runs B_starve = [c0] filled FCFS with
    #          h0..h2 (no hot adapter to leave out); C pays H for h3, now held back. c0 and
    #          h0..h2 finish (h0..h2's fourth token); h3 has 3 of 4.
    #   t=2.0  settle: H 0.25+0.5 = 0.75 (held back: no relax); C 2.5-0.5 = 2.0, relaxed 1.75,
    #          still starving (hysteresis: normal only below t_normal 1.5). Only h3 is left:
    #          ratio 1/1 > alpha, nobody held back -> MERGE H again; h3 finishes at 2.5.
    cfg = BatchingConfig(max_batch=4, alpha=0.7, beta=0.3, merge_planner=False)
    sim = StepSim(DLoRAPolicy(cfg), 4, flat_cost(0.5), switch_time=0.0)
    cold = sim.add("c0", "C", 0.0, 1)
    hot = [sim.add(f"h{i}", "H", 0.0, 4) for i in range(4)]
    sim.run_to_completion()

    h4 = ("h0", "h1", "h2", "h3")
    merged, unmerged = (Mode.MERGED, "H"), (Mode.UNMERGED, None)
    assert [(t, d.mode, d.merged_adapter, d.switch, d.allowed_req_ids) for t, d in sim.decisions] == [
        (0.0, *merged, Switch.MERGE, h4),
        (0.5, *merged, Switch.NONE, h4),
        (1.0, *merged, Switch.NONE, h4),
        (1.5, *unmerged, Switch.UNMERGE, ("c0", "h0", "h1", "h2")),
        (2.0, *merged, Switch.MERGE, ("h3",)),
    ]
    # c0 waited three 0.5 s steps: t_starve - initial_credit plus the step that crossed it.
    assert (cold.held_back_at_first, cold.finished_at) == (1.5, 2.0)
    assert [r.finished_at for r in hot] == [2.0, 2.0, 2.0, 2.5]
    state = sim.policy.snapshot()
    assert (state.num_switches, state.credits, state.starving) == (3, {"C": 1.75, "H": 0.75}, {"C"})


def test_no_requests_gives_an_empty_decision_and_keeps_the_mode():
    p = DLoRAPolicy(BatchingConfig(alpha=0.5, beta=0.3))
    p.decide(reqs([("A", 4)]), 0.0)
    d = p.decide([], 1.0)
    assert d.allowed_req_ids == () and d.mode is Mode.MERGED and d.switch is Switch.NONE


def test_failed_merge_is_adopted_from_observe():
    p = DLoRAPolicy(BatchingConfig(alpha=0.5, beta=0.3))
    rs = reqs([("A", 4)])
    assert p.decide(rs, 0.0).switch is Switch.MERGE
    p.observe(IterationStats(Mode.UNMERGED, None, 4, 0.05))  # the engine could not merge
    assert (p.mode, p.merged) == (Mode.UNMERGED, None)
    d = p.decide(rs, 0.05)
    assert d.switch is Switch.MERGE  # it tries again, from the state the engine is really in
    check_decision(d, rs)


# ---- starvation bound: a flood on one adapter against a cold one ----------------------------

DT = 0.05  # seconds per unmerged step; merged steps take 0.03 s


def flood(config: BatchingConfig, cold: dict[str, float], horizon: float = 30.0) -> StepSim:
    """Adapter A gets 4 new 8-token requests every 0.2 s, more than a step serves, so A always
    has a backlog; each cold adapter sends one 40-token request at the given time."""
    cost = lambda mode, n: 0.03 if mode is Mode.MERGED else DT  # noqa: E731
    sim = StepSim(DLoRAPolicy(config), config.max_batch, cost, switch_time=0.0)
    for i in range(int(horizon / 0.2)):
        for j in range(4):
            sim.add(f"A{i}.{j}", "A", i * 0.2, 8)
    for name, at in cold.items():
        sim.add(name, name, at, 40)
    sim.run_until(horizon)
    return sim


def flood_config(**kw) -> BatchingConfig:
    base = dict(
        max_batch=8,
        alpha=0.6,
        beta=0.3,
        initial_credit=1.0,
        t_starve=2.0,
        t_normal=1.5,
        credit_relax_per_s=0.5,
        mixed_merged=False,
    )
    return BatchingConfig(**{**base, **kw})


def cold_requests(sim: StepSim) -> list:
    return [r for r in sim.requests if r.adapter != "A"]


def test_flood_cannot_hold_a_cold_adapter_back_beyond_t_starve():
    # "Held back" = inside B_fcfs (FCFS would run it) but not allowed. A cold adapter earns one
    # second of credit per second held back and starts at initial_credit; it never pays while
    # normal, and relaxation returns it to initial_credit, so every held-back stretch ends once
    # credit > t_starve: within t_starve - initial_credit plus the step that crosses it.
    cfg = flood_config()
    sim = flood(cfg, {"X": 3.0, "Y": 9.0, "Z": 9.1, "W": 20.0})
    assert sum(d.mode is Mode.MERGED for _, d in sim.decisions) > len(sim.decisions) / 2
    bound = cfg.t_starve - cfg.initial_credit + DT + 1e-9
    for r in cold_requests(sim):
        assert r.finished_at is not None, r.req_id
        assert r.held_back_at_first <= bound, r
        assert r.max_stretch <= bound, r
    assert max(r.max_stretch for r in cold_requests(sim)) > bound - 2 * DT  # the bound is tight


def test_without_starvation_prevention_the_flood_starves_the_cold_adapter():
    # Control: the same flood with t_starve out of reach and credit relaxing faster than A pays
    # (one held-back adapter costs A 1 credit/s): X is held back far longer than the bound above.
    cfg = flood_config(t_starve=1000.0, t_normal=999.0, credit_relax_per_s=2.0)
    x = cold_requests(flood(cfg, {"X": 3.0}))[0]
    assert x.max_stretch > 10.0


def test_mixed_merged_flood_holds_no_cold_request_back():
    # The same flood, mixed: merged steps run B_fcfs, so a cold request runs from its first step.
    sim = flood(flood_config(mixed_merged=True), {"X": 3.0, "Y": 9.0, "Z": 9.1, "W": 20.0})
    assert sum(d.mode is Mode.MERGED for _, d in sim.decisions) > len(sim.decisions) / 2
    for r in cold_requests(sim):
        assert r.finished_at is not None and r.max_stretch == 0.0 and r.held_back_at_first == 0.0, r


@pytest.mark.parametrize("t_starve", [1.6, 2.0, 3.0])
def test_starvation_bound_scales_with_t_starve(t_starve):
    cfg = flood_config(t_starve=t_starve, t_normal=1.1)
    x = cold_requests(flood(cfg, {"X": 3.0}))[0]
    expected = t_starve - cfg.initial_credit
    assert expected - DT <= x.held_back_at_first <= expected + DT + 1e-9


@pytest.mark.parametrize("name", ["merged", "dlora"])
def test_max_batch_per_call_overrides_config_and_must_be_positive(name):
    p = make_policy(name, BatchingConfig(max_batch=8, alpha=0.5, beta=0.3))
    rs = reqs([("A", 20)])
    assert len(p.decide(rs, 0.0, max_batch=3).allowed_req_ids) == 3
    assert len(p.decide(rs, 0.1).allowed_req_ids) == 8
    with pytest.raises(ValueError, match="max_batch=0"):
        p.decide(rs, 0.2, max_batch=0)
