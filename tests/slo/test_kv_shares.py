"""MuxServe's per-adapter KV quotas: shares by rate, lending, reclaiming, borrowers refused first,
periodic re-adaptation and the fairness gap."""

from __future__ import annotations

import math

import pytest

from dlora.slo.kv_shares import (
    Admission,
    KvQuotas,
    admit,
    blocks_for,
    fairness_gap,
    plan_admissions,
    quota_shares,
)


def test_blocks_for_rounds_up():
    assert [blocks_for(t, 16) for t in (0, 1, 16, 17, 33)] == [0, 1, 1, 2, 3]
    with pytest.raises(ValueError):
        blocks_for(10, 0)


def test_quota_shares_follow_the_rates_and_sum_to_the_total():
    # 100 blocks by rates 1:2:3 -> 16.67, 33.33, 50 -> floors 16 + 33 + 50 = 99; the largest
    # remainder (a's .67) takes the last block
    assert quota_shares(100, {"a": 1.0, "b": 2.0, "c": 3.0}) == {"a": 17, "b": 33, "c": 50}
    # 10 by 1:1:1 -> 3.33 each; the remainders and rates tie, the name decides
    assert quota_shares(10, {"c": 1.0, "b": 1.0, "a": 1.0}) == {"a": 4, "b": 3, "c": 3}
    assert quota_shares(9, {"a": 0.0, "b": 0.0, None: 0.0}) == {"a": 3, "b": 3, None: 3}  # no rates yet: equal
    assert quota_shares(8, {"a": 3.0, "idle": 0.0}) == {"a": 8, "idle": 0}
    assert quota_shares(100, {}) == {}


@pytest.mark.parametrize("rate", [-1.0, math.nan, math.inf])
def test_quota_shares_reject_bad_rates(rate):
    with pytest.raises(ValueError, match="'a'"):
        quota_shares(100, {"a": rate})


def test_fairness_gap_is_the_spread_of_blocks_per_unit_rate():
    rates = {"a": 2.0, "b": 1.0}
    assert fairness_gap({"a": 40, "b": 10}, rates) == pytest.approx(40 / 2 - 10 / 1)  # 20 - 10 = 10
    assert fairness_gap({"a": 40, "b": 20}, rates) == 0.0  # usage in proportion to rates: fair
    assert fairness_gap({"a": 40}, {"a": 2.0, "idle": 0.0}) == 0.0  # a rate of 0 is not normalized


QUOTAS = {"a": 60, "b": 40}  # of 100 blocks


def test_within_quota_and_borrowing_free_blocks():
    used = {"a": 50, "b": 10}  # 40 free
    assert admit("a", 10, used, QUOTAS, 100) == Admission(True, borrowed=0, reason="within quota")
    ans = admit("a", 20, used, QUOTAS, 100)  # 10 of its own quota left: borrows 10 of b's unused 30
    assert (ans.admit, ans.borrowed, dict(ans.reclaim)) == (True, 10, {})
    over = {"a": 80, "b": 10}  # a already borrows 20; 10 free
    assert (admit("a", 5, over, QUOTAS, 100).admit, admit("a", 5, over, QUOTAS, 100).borrowed) == (True, 5)
    assert not admit("a", 15, over, QUOTAS, 100).admit  # over its quota and only 10 free


def test_owner_reclaims_lent_blocks_and_never_beyond_its_quota():
    used = {"a": 80, "b": 10}  # a borrows 20; 10 free
    ans = admit("b", 20, used, QUOTAS, 100)  # b within its 40: needs 20, 10 free, takes 10 back from a
    assert (ans.admit, dict(ans.reclaim), ans.borrowed) == (True, {"a": 10}, 0)
    assert not admit("b", 31, used, QUOTAS, 100).admit  # 10 + 31 > 40: b would borrow, nothing free


def test_reclaim_takes_from_the_most_over_quota_first_and_leaves_borrowers_at_their_quota():
    quotas = {"a": 40, "b": 30, "c": 30}
    used = {"a": 50, "b": 35, "c": 10}  # a over by 10, b by 5; 5 free
    assert dict(admit("c", 15, used, quotas, 100).reclaim) == {"a": 10}  # need 10: all from a
    assert dict(admit("c", 20, used, quotas, 100).reclaim) == {"a": 10, "b": 5}  # need 15: a to 40, b to 30


def test_an_owner_within_its_quota_is_always_served_when_quotas_sum_to_the_total():
    quotas = {"a": 5, "b": 3, "c": 2}
    for ua in range(0, 11):
        for ub in range(0, 11 - ua):
            uc = min(2, 10 - ua - ub)  # c within its quota
            used = {"a": ua, "b": ub, "c": uc}
            for blocks in range(1, 2 - uc + 1):
                ans = admit("c", blocks, used, quotas, 10)
                assert ans.admit, (used, blocks)
                assert all(used[x] - n >= quotas[x] for x, n in ans.reclaim.items())


def test_borrowers_are_refused_first():
    quotas = {"a": 50, "b": 50}
    used = {"a": 45, "b": 30}  # 25 free
    waiting = [("a1", "a", 20), ("b1", "b", 15), ("a2", "a", 5)]  # in priority order
    plan = plan_admissions(waiting, used, quotas, 100)
    # b1 (15 of b's 20 left) and a2 (a's last 5) are within quota and start; a1 would borrow 15
    # and only 5 blocks remain, so it waits, though in plain priority order it came first
    assert plan.admitted == ("b1", "a2")
    assert (dict(plan.reclaim), plan.borrowed) == ({}, 0)
    roomy = plan_admissions(waiting, {"a": 45, "b": 0}, quotas, 100)  # 55 free: room to lend too
    assert roomy.admitted == ("b1", "a2", "a1") and roomy.borrowed == 20


def test_plan_reclaims_for_owners_then_lends_what_is_left():
    quotas = {"a": 50, "b": 50}
    used = {"a": 90, "b": 0}  # a borrows 40; 10 free
    plan = plan_admissions([("a1", "a", 5), ("b1", "b", 30)], used, quotas, 100)
    assert plan.admitted == ("b1",)  # b1 takes 20 back from a; a1 would borrow with nothing free
    assert dict(plan.reclaim) == {"a": 20}


def test_quotas_readapt_every_period_from_measured_rates():
    q = KvQuotas(total_blocks=100, period_s=10.0, start=0.0)
    assert q.admit("a", 10, {}).borrowed == 10  # no quotas yet: every block is lent
    q.arrived("a", 30)
    q.arrived("b", 10)
    assert not q.adapt(5.0)  # the period is not over
    assert q.adapt(10.0, active=["c"])  # rates 3/s and 1/s; c holds blocks but saw no arrival
    assert q.rates == {"a": 3.0, "b": 1.0, "c": 0.0}
    assert q.quotas == {"a": 75, "b": 25, "c": 0}
    assert q.fairness_gap({"a": 75, "b": 25}) == 0.0
    assert q.admit("c", 1, {"a": 75, "b": 25}) == Admission(False, reason="over its quota and too few free blocks")
    q.arrived("b", 40)  # the next period only counts its own arrivals
    assert not q.adapt(19.0)
    assert q.adapt(20.0) and q.quotas == {"b": 100}
    with pytest.raises(ValueError):
        KvQuotas(100, 0.0, 0.0)
