"""Aladdin's constraints (b)-(e), each true and false at its boundary, and the two choosers."""

from __future__ import annotations

import pytest

from dlora.cluster.dispatch import NoEligibleReplica, estimate
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.feasible_dispatch import (
    Check,
    SloReplica,
    choose,
    decode_bound,
    feasibility,
    kv_peak,
    kv_peak_tokens,
    prefill_slack,
    ttft_bound,
)
from dlora.cluster.policy_views import LoadTotals, ReplicaView, RequestLoad
from dlora.slo.config import AdapterSlo

# a step: 10 ms fixed + 5 ms per sequence; a prefill: 10 ms + 1 ms per token; adapter load 20 ms
P = CostParams(per_iteration_s=0.01, per_decode_token_s=0.005, per_prefill_token_s=0.001, adapter_load_s=0.02)
NOW = 10.0


def rq(rid, adapter="a", *, prompt=100, output=0, expected=100, running=False, arrival=NOW):
    return RequestLoad(rid, adapter, prompt, output, expected, running, arrival, arrival)


def replica(requests=(), rid=0, resident=("a",), elapsed=None, k2=0.0, **kw):
    view = ReplicaView(replica_id=rid, requests=tuple(requests), resident_adapters=frozenset(resident), **kw)
    return SloReplica(view, P, elapsed or {}, k2)


def slos(table):
    return lambda r: table[r.adapter]


LOOSE = slos({"a": AdapterSlo(ttft_s=100.0, tpot_s=100.0), "strict": AdapterSlo(ttft_s=100.0, tpot_s=0.025)})


# (b) decode bound ----------------------------------------------------------------------------


def test_decode_bound_at_the_tpot_target():
    running = [rq(f"r{i}", running=True, output=5) for i in range(3)]
    new = rq("new")
    # n = 4 sequences: 0.01 + 0.005 * 4 = 0.030 s per step
    at = decode_bound(replica(running), new, slos({"a": AdapterSlo(1.0, 0.030)}), gamma=0.5, theta=0.9)
    assert (at.lhs, at.rhs, at.ok) == (pytest.approx(0.030), 0.030, True)
    under = decode_bound(replica(running), new, slos({"a": AdapterSlo(1.0, 0.029)}), gamma=0.5, theta=0.9)
    assert not under.ok


def test_decode_bound_uses_the_tightest_target_on_the_replica():
    running = [rq("s", "strict", running=True, output=5), rq("r1", running=True), rq("r2", running=True)]
    check = decode_bound(replica(running), rq("new"), LOOSE, gamma=0.5, theta=0.9)
    # the new request's own target is 100 s, but "strict" (0.025 s) shares the batch: 0.030 > 0.025
    assert (check.lhs, check.rhs, check.ok) == (pytest.approx(0.030), 0.025, False)


def test_decode_bound_with_a_context_term_is_aladdins_eq4():
    # k2 = 1e-5 s per context token; each request counts prompt 100 + gamma * predicted 200
    running = [rq(f"r{i}", running=True, output=5, expected=200) for i in range(3)]
    new = rq("new", expected=200)
    rep = replica(running, k2=1e-5)
    # gamma 0.5: W = 4 * (100 + 100) = 800; theta 0.5: 1e-5 * 800 / 0.5 = 0.016; step 0.030 + 0.016
    assert decode_bound(rep, new, LOOSE, gamma=0.5, theta=0.5).lhs == pytest.approx(0.046)
    assert decode_bound(rep, new, slos({"a": AdapterSlo(1, 0.046)}), gamma=0.5, theta=0.5).ok
    assert not decode_bound(rep, new, slos({"a": AdapterSlo(1, 0.045)}), gamma=0.5, theta=0.5).ok
    # gamma 0: only prompts count, W = 400 -> 0.008; theta 1: no margin
    assert decode_bound(rep, new, LOOSE, gamma=0.0, theta=1.0).lhs == pytest.approx(0.030 + 0.004)


# (c) TTFT ------------------------------------------------------------------------------------


def test_ttft_bound_protects_the_queued_requests_deadline():
    # queued q (290 tokens) + new (200): one prefill of 490 tokens = 0.01 + 0.49 = 0.5 s
    new = rq("new", prompt=200, arrival=NOW)
    table = slos({"a": AdapterSlo(ttft_s=1.0, tpot_s=1.0)})
    q_on_time = rq("q", prompt=290, arrival=9.5)  # deadline 10.5: 0.5 s left
    check = ttft_bound(replica([q_on_time]), new, table, NOW)
    assert (check.lhs, check.rhs, check.ok) == (pytest.approx(0.5), 0.5, True)
    q_tight = rq("q", prompt=290, arrival=9.4)  # deadline 10.4: 0.4 s left, the new prefill makes it miss
    check = ttft_bound(replica([q_tight]), new, table, NOW)
    assert (check.lhs, check.rhs, check.ok) == (pytest.approx(0.5), pytest.approx(0.4), False)


def test_ttft_bound_skips_requests_already_late_and_charges_the_new_ones_adapter_load():
    table = slos({"a": AdapterSlo(ttft_s=0.5, tpot_s=1.0)})
    late = rq("q", prompt=290, arrival=8.0)  # deadline 8.5 passed: no dispatch can save it
    new = rq("new", prompt=200)
    check = ttft_bound(replica([late]), new, table, NOW)
    assert (check.lhs, check.rhs, check.ok) == (pytest.approx(0.5), 0.5, True)  # the new one's own deadline
    absent = ttft_bound(replica([late], resident=()), new, table, NOW)
    assert (absent.lhs, absent.ok) == (pytest.approx(0.5 + 0.02), False)  # + adapter load 20 ms


# (d) prefill slack ---------------------------------------------------------------------------


def test_prefill_slack_against_the_decodes_banked_time():
    # r1: 11 tokens, target 0.05 s/token, 0.3 s decoding so far -> slack 0.55 - 0.3 = 0.25; theta 0.8 -> 0.2
    r1 = rq("r1", running=True, output=11)
    prefilling = rq("r2", running=True, output=0)  # admitted, no token yet: not decoding
    table = slos({"a": AdapterSlo(ttft_s=1.0, tpot_s=0.05)})
    rep = replica([r1, prefilling], elapsed={"r1": 0.3})
    at = prefill_slack(rep, rq("new", prompt=190), table, theta=0.8)  # 0.01 + 0.19 = 0.2 s
    assert (at.lhs, at.rhs, at.ok) == (pytest.approx(0.2), pytest.approx(0.2), True)
    over = prefill_slack(rep, rq("new", prompt=200), table, theta=0.8)  # 0.21 s
    assert not over.ok


def test_prefill_slack_without_elapsed_time_assumes_on_target_and_is_free_without_decodes():
    table = slos({"a": AdapterSlo(ttft_s=1.0, tpot_s=0.05)})
    # missing elapsed: 0.05 * (11 - 1) = 0.5 s -> slack one token's 0.05 s; theta 0.8 -> 0.04
    check = prefill_slack(replica([rq("r1", running=True, output=11)]), rq("new", prompt=20), table, theta=0.8)
    assert (check.lhs, check.rhs, check.ok) == (pytest.approx(0.03), pytest.approx(0.04), True)
    idle = prefill_slack(replica([]), rq("new", prompt=5000), table, theta=0.8)
    assert idle.ok and idle.headroom == 1.0


# (e) KV peak ---------------------------------------------------------------------------------

# A: context 300, 100 tokens to come; B: context 200, 400 to come; new C: prompt 100, 50 to come.
KV_RUNNING = [
    rq("A", prompt=250, output=50, expected=150, running=True),
    rq("B", prompt=150, output=50, expected=450, running=True),
]
KV_NEW = rq("C", prompt=100, expected=50)


def test_kv_peak_is_at_a_future_finish_not_now():
    # step 0: 300 + 200 + 100 = 600; step 50 (C finishes): 350 + 250 + 150 = 750;
    # step 100 (A finishes, C gone): 400 + 300 = 700; step 400: B alone, 600
    assert kv_peak_tokens([(300, 100), (200, 400), (100, 50)]) == 750
    assert kv_peak(replica(KV_RUNNING, kv_capacity_tokens=750), KV_NEW).ok
    short = kv_peak(replica(KV_RUNNING, kv_capacity_tokens=749), KV_NEW)
    assert (short.lhs, short.rhs, short.ok) == (750, 749, False)  # although only 600 are needed now
    assert not kv_peak(replica(KV_RUNNING, kv_capacity_tokens=800), KV_NEW, kv_limit=0.9).ok  # 720 < 750


@pytest.mark.parametrize(
    "footprints",
    [[(300, 100), (200, 400), (100, 50)], [(10, 0), (5, 5), (1, 20), (50, 3)], [(7, 7), (7, 7), (0, 1)], []],
)
def test_kv_peak_sweep_matches_every_step(footprints):
    horizon = max((left for _, left in footprints), default=0)
    brute = max((sum(c + k for c, left in footprints if left >= k) for k in range(horizon + 1)), default=0)
    assert kv_peak_tokens(footprints) == brute


# choosers ------------------------------------------------------------------------------------


def chooser_replicas(tpot_on_r2=0.1):
    """Empty, 4 and 12 decoding requests; each decoding request banked 0.5 s of slack."""
    fill = {n: [rq(f"r{n}_{i}", running=True, output=10, expected=50) for i in range(n)] for n in (0, 4, 12)}
    elapsed = {r.request_id: 0.5 for rs in fill.values() for r in rs}  # slack 0.1 * 10 - 0.5 = 0.5
    reps = [replica(fill[n], rid=i, elapsed=elapsed, kv_capacity_tokens=100_000) for i, n in enumerate((0, 4, 12))]
    return reps, slos({"a": AdapterSlo(ttft_s=2.0, tpot_s=0.1)})


def test_feasible_chooses_least_pending_and_best_fit_the_least_slack():
    reps, table = chooser_replicas()
    new = rq("new", expected=50)
    # decode steps with the new request: n = 1, 5, 13 -> 0.015, 0.035, 0.075 s of a 0.1 s target:
    # headroom 0.85, 0.65, 0.25; the others are looser (TTFT 0.11 of 2 s; prefill 0.11 of 0.45 s)
    slack = [feasibility(r, new, table, NOW).slack for r in reps]
    assert slack == pytest.approx([0.85, 0.65, 0.25])
    least = choose(reps, new, table, NOW, mode="slo_feasible")
    assert (least.replica_id, least.feasible, least.load_adapter) == (0, True, False)
    assert least.pending_s == pytest.approx(estimate(reps[0].view, new, P))
    packed = choose(reps, new, table, NOW, mode="best_fit")
    assert (packed.replica_id, packed.feasible, packed.slack) == (2, True, pytest.approx(0.25))


def test_best_fit_skips_a_fuller_replica_that_would_break_an_slo():
    reps, _ = chooser_replicas()
    tight = slos({"a": AdapterSlo(ttft_s=2.0, tpot_s=0.07)})  # replica 2's 0.075 s step is too slow
    new = rq("new", expected=50)
    assert not feasibility(reps[2], new, tight, NOW).feasible
    assert choose(reps, new, tight, NOW, mode="best_fit").replica_id == 1


def test_nothing_feasible_falls_back_to_least_pending_time_flagged():
    reps, _ = chooser_replicas()
    impossible = slos({"a": AdapterSlo(ttft_s=2.0, tpot_s=0.01)})  # even a step of one (0.015 s) is too slow
    d = choose(list(reversed(reps)), rq("new"), impossible, NOW, mode="best_fit")
    assert (d.replica_id, d.feasible) == (0, False)
    assert d.slack < 0 and any(not c.ok for c in d.checks)


def test_feasible_ties_go_to_the_lower_replica_id():
    reps = [replica([], rid=3, kv_capacity_tokens=1000), replica([], rid=1, kv_capacity_tokens=1000)]
    for mode in ("slo_feasible", "best_fit"):
        assert choose(reps, rq("new"), LOOSE, NOW, mode=mode).replica_id == 1


def test_chooser_errors():
    reps, table = chooser_replicas()
    with pytest.raises(ValueError, match="lifo"):
        choose(reps, rq("new"), table, NOW, mode="lifo")
    full = replica([rq("b0", "b", running=True)], resident=("b",), adapter_slots=1)
    with pytest.raises(NoEligibleReplica):
        choose([full], rq("new", "a"), table, NOW)
    totals_only = SloReplica(ReplicaView(0, totals=LoadTotals.of([rq("x", running=True)])), P)
    with pytest.raises(ValueError, match="per-request"):
        choose([totals_only], rq("new"), table, NOW)


def test_check_headroom_and_boundary():
    assert Check("x", 0.5, 0.5).ok and Check("x", 0.5, 0.5).headroom == 0.0
    assert Check("x", 0.1 + 0.2, 0.3).ok  # float rounding at the boundary still holds
    assert not Check("x", 0.31, 0.3).ok and Check("x", 0.6, 0.3).headroom == pytest.approx(-1.0)
    assert Check("x", 1e9, float("inf")).headroom == 1.0
    assert not Check("x", 0.1, -0.2).ok and Check("x", 0.0, 0.0).headroom == 0.0


@pytest.mark.parametrize(("gamma", "theta"), [(1.5, 0.9), (-0.1, 0.9), (0.5, 0.0), (0.5, 1.1)])
def test_feasibility_rejects_gamma_and_theta_out_of_range(gamma, theta):
    with pytest.raises(ValueError, match="gamma" if theta == 0.9 else "theta"):
        feasibility(replica([]), rq("new"), LOOSE, NOW, gamma=gamma, theta=theta)
