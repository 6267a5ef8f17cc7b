"""Algorithm 3: credits transfer the documented amounts, starving/normal hysteresis, the merge gate."""

from __future__ import annotations

import pytest

from dlora.scheduling import BatchingConfig, DLoRAPolicy, Mode, Switch
from dlora.scheduling.credits import CreditLedger, Transfer, transfer_for
from tests.scheduling.simlib import req


def test_transfer_for_pays_skipped_adapters_of_b_fcfs():
    fcfs = [req("a1", "A", 0), req("x1", "X", 1), req("a2", "A", 2), req("b1", None, 3)]
    merged = [req("a1", "A", 0), req("a2", "A", 2), req("a3", "A", 5)]
    t = transfer_for(merged, fcfs)
    assert t == Transfer({"A": 3}, frozenset({"X", None}))  # the base model is compensated too
    assert transfer_for(fcfs, fcfs) is None  # the FCFS batch ran: nobody held back
    assert transfer_for([req("a1", "A", 0)], [req("a1", "A", 0), req("a2", "A", 1)]) is None


def test_settle_moves_seconds_per_receiver_from_payers_by_share():
    ledger = CreditLedger(initial=1.0, t_starve=2.0, t_normal=1.0, relax_per_s=0.0)
    ledger.ensure(["A", "B", "X", "Y"])
    paid = ledger.settle(
        Transfer({"A": 3, "B": 1}, frozenset({"X", "Y", "Z"})), 0.2, present={"A", "B", "X", "Y"}
    )  # Z's requests are gone: not paid
    assert sorted(paid) == ["X", "Y"]
    assert ledger.credits == pytest.approx({"A": 0.7, "B": 0.9, "X": 1.2, "Y": 1.2})
    assert sum(ledger.credits.values()) == pytest.approx(4.0)  # conserved


def test_starving_hysteresis_between_t_starve_and_t_normal():
    ledger = CreditLedger(initial=1.0, t_starve=2.0, t_normal=1.0, relax_per_s=0.0)
    ledger.ensure(["X"])
    trace = []
    for c in [1.5, 2.0, 2.01, 1.5, 1.0, 0.99, 1.5, 2.5]:
        ledger.credits["X"] = c
        trace.append("X" in ledger.update_states())
    assert trace == [False, False, True, True, True, False, False, True]


def test_relaxation_toward_initial_spares_held_back_adapters():
    ledger = CreditLedger(initial=1.0, t_starve=2.0, t_normal=1.0, relax_per_s=0.5)
    ledger.credits.update({"A": 0.2, "B": 0.9, "X": 1.6, "Y": 1.6, "Z": 1.1})
    ledger.relax(1.0, held_back=["Y"])
    assert ledger.credits == pytest.approx({"A": 0.7, "B": 1.0, "X": 1.1, "Y": 1.6, "Z": 1.0})


def cfg(**kw) -> BatchingConfig:
    """The paper's merged steps (only the merged adapter runs): the others are held back and paid.
    The merge planner is off: these tests check Alg. 3 as the paper has it."""
    base = dict(
        merge_planner=False,
        max_batch=4,
        alpha=0.5,
        beta=0.3,
        initial_credit=1.0,
        t_starve=2.0,
        t_normal=1.5,
        credit_relax_per_s=0.0,
        mixed_merged=False,
    )
    return BatchingConfig(**{**base, **kw})


# B_fcfs (max_bs 4) = a0, a1, x0, a2: A's ratio 3/4 > alpha, so A merges and X is held back.
HOT = [req("a0", "A", 0.0), req("a1", "A", 1.0), req("x0", "X", 1.5), req("a2", "A", 2.0)]


def test_policy_transfers_step_duration_from_merged_adapter_to_skipped():
    p = DLoRAPolicy(cfg())
    d = p.decide(HOT, now=10.0)
    assert d.switch is Switch.MERGE and "x0" not in d.allowed_req_ids
    assert p.ledger.credits == {"A": 1.0, "X": 1.0}  # owed, settled when the step's length is known
    p.decide(HOT, now=10.25)
    assert p.ledger.credits == pytest.approx({"A": 0.75, "X": 1.25})
    p.decide(HOT, now=10.35)
    assert p.ledger.credits == pytest.approx({"A": 0.65, "X": 1.35})


def test_mixed_merged_steps_hold_nobody_back_so_credits_never_move():
    p = DLoRAPolicy(cfg(mixed_merged=True))
    d = p.decide(HOT, now=10.0)
    assert d.switch is Switch.MERGE and d.allowed_req_ids == ("a0", "a1", "x0", "a2")
    for t in (10.25, 10.35, 12.0):
        assert p.decide(HOT, now=t).mode is Mode.MERGED
    assert p.ledger.credits == {"A": 1.0, "X": 1.0} and not p.ledger.starving


def test_mixed_merging_costs_no_credit_at_the_gate():
    # Line 17's cost is what merging holds back; mixed, that is nobody, so a spent adapter whose
    # credit still meets min_credit_to_merge may merge (unmixed: cost 0.1 s x X > 0.05 - 0).
    for mixed, merges in ((False, False), (True, True)):
        p = DLoRAPolicy(cfg(alpha=0.9, mixed_merged=mixed))
        p.decide(HOT, now=0.0)  # unmerged (3/4 not > 0.9); the step lasts 0.1 s
        p.thresholds.alpha = 0.5
        p.ledger.credits["A"] = 0.05
        assert (p.decide(HOT, now=0.1).switch is Switch.MERGE) is merges


def test_fcfs_steps_transfer_nothing():
    p = DLoRAPolicy(cfg(alpha=0.9))
    for t in (0.0, 1.0, 2.0):
        assert p.decide(HOT, now=t).mode is Mode.UNMERGED
    assert p.ledger.credits == {"A": 1.0, "X": 1.0}


def test_adapter_lacking_credit_may_not_merge_and_unmerges():
    p = DLoRAPolicy(cfg())
    p.decide(HOT, now=0.0)  # merged on A
    p.ledger.credits["A"] = 0.05
    # The last step lasted 0.1 s and merging A holds back one adapter: cost 0.1 > credit 0.05.
    d = p.decide(HOT, now=0.1)
    assert d.switch is Switch.UNMERGE and d.mode is Mode.UNMERGED
    assert set(d.allowed_req_ids) == {"a0", "a1", "x0", "a2"}
    p.ledger.credits["A"] = 0.05
    assert p.decide(HOT, now=0.2).mode is Mode.UNMERGED  # still not eligible
    p.ledger.credits["A"] = 0.2
    assert p.decide(HOT, now=0.3).switch is Switch.MERGE  # 0.2 - 0.1 >= min_credit_to_merge 0


def test_starving_adapter_is_served_first_and_pays_for_priority():
    rs = [req(f"a{i}", "A", float(i)) for i in range(6)] + [req("x0", "X", 10.0)]
    p = DLoRAPolicy(cfg())
    p.ledger.ensure(["A", "X"])
    p.ledger.credits["X"] = 2.5  # > t_starve
    d = p.decide(rs, now=0.0)
    # A fills B_fcfs, so Alg. 1 would run A merged: A waits rather than running unmerged behind X.
    assert d.mode is Mode.UNMERGED and d.allowed_req_ids == ("x0",)
    p.decide(rs, now=0.5)  # X paid 0.5 s to A (the adapter of B_fcfs it was put ahead of)
    assert p.ledger.credits == pytest.approx({"A": 1.5, "X": 2.0})
    assert "X" in p.ledger.starving  # 2.0 is not < t_normal
    p.decide(rs, now=1.6)  # X pays 1.1 more -> 0.9 < t_normal: normal again
    assert p.ledger.credits["X"] == pytest.approx(0.9) and "X" not in p.ledger.starving


def test_starvation_step_fills_with_requests_that_would_run_unmerged_anyway():
    # No adapter is hot enough to merge (ratio 2/4 <= alpha): the batch is filled FCFS.
    rs = [req("a0", "A", 0.0), req("b0", "B", 1.0), req("a1", "A", 2.0), req("c0", "C", 3.0), req("x0", "X", 10.0)]
    p = DLoRAPolicy(cfg())
    p.ledger.ensure(["A", "B", "C", "X"])
    p.ledger.credits["X"] = 2.5
    assert p.decide(rs, now=0.0).allowed_req_ids == ("x0", "a0", "b0", "a1")
    # Merged on A with another adapter starving: the others fill, A's requests wait.
    rs = [req(f"a{i}", "A", float(i)) for i in range(3)] + [req("b0", "B", 3.0), req("x0", "X", 10.0)]
    p = DLoRAPolicy(cfg())
    p.ledger.ensure(["A", "B", "X"])
    p.mode, p.merged = Mode.MERGED, "A"
    p.ledger.credits["X"] = 2.5
    d = p.decide(rs, now=0.0)
    assert d.switch is Switch.UNMERGE and d.allowed_req_ids == ("x0", "b0")


def test_new_adapters_get_the_initial_credit_when_first_seen():
    p = DLoRAPolicy(cfg(initial_credit=0.7))
    p.decide([req("a0", "A", 0.0)], now=0.0)
    assert p.ledger.credits == {"A": 0.7}
    p.decide([req("a0", "A", 0.0), req("b0", None, 1.0)], now=1.0)
    assert p.ledger.credits == {"A": 0.7, None: 0.7}


def test_idle_adapters_back_at_initial_credit_are_forgotten():
    p = DLoRAPolicy(cfg(credit_relax_per_s=1.0))
    p.decide(HOT, now=0.0)  # A merged, X held back
    p.decide(HOT, now=0.25)  # X paid 0.25
    only_a = [req("a0", "A", 0.0)]
    p.decide(only_a, now=0.375)  # X gone: not paid for the last step, relaxes 1.25 -> 1.125
    assert p.ledger.credits["X"] == 1.125
    p.decide(only_a, now=0.75)  # back at the initial credit: forgotten
    assert "X" not in p.ledger.credits and p.ledger.credit("X") == 1.0


def test_base_model_requests_can_starve_and_are_served_first():
    p = DLoRAPolicy(cfg(min_credit_to_merge=-5.0))  # A may run into debt: the gate stays open
    rs = HOT[:2] + [req("n0", None, 1.5)] + HOT[3:]
    assert p.decide(rs, now=0.0).merged_adapter == "A"  # the base request is held back
    t, d = 0.0, None
    while d is None or d.mode is Mode.MERGED:
        t += 0.125
        d = p.decide(rs, now=t)
    assert d.switch is Switch.UNMERGE and d.allowed_req_ids[0] == "n0"
    assert t == 1.125  # credit 1.0 + 1.0 is not > t_starve 2.0; one more step is


def test_closed_ledger_keeps_a_spent_adapter_unmerged_relaxation_restores_it():
    # Same start, no debt allowed: A's credit runs out at 1.0 s and it unmerges (the gate). With the
    # paper's closed ledger (relax 0) nobody is held back under FCFS, so A never merges again.
    for relax, merges_again in ((0.0, False), (0.5, True)):
        p = DLoRAPolicy(cfg(credit_relax_per_s=relax))
        rs = HOT[:2] + [req("n0", None, 1.5)] + HOT[3:]
        modes = [p.decide(rs, now=i * 0.125).mode for i in range(40)]
        after_gate = modes[modes.index(Mode.UNMERGED) :]
        assert (Mode.MERGED in after_gate) is merges_again
