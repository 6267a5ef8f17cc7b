"""The queued-request rebalancer: which waiting requests move between busy replicas, by hand.

One second per token (CostParams below), so waits are token counts. Every replica runs two
requests with 10 tokens left on two slots unless a test says otherwise: no replica can start a
request now, which is when the queued-request planner (migration/queued.py) gives up.
"""

import dataclasses

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.queued import QueuedConfig, plan_queued
from dlora.cluster.migration.rebalance import RebalanceConfig, plan_rebalance, rebalance_trigger
from tests.cluster.balancer_factories import make_replica, make_request

P = CostParams(per_iteration_s=1.0, per_decode_token_s=0.0, per_prefill_token_s=0.0, adapter_load_s=0.0)
NOW = 100.0
CFG = RebalanceConfig(min_wait_s=1.0, kv_high=0.9, min_gain_s=1.0, max_moves=4)


def queued(rid, arrival, adapter="a", expected=10, since=None):
    return make_request(
        rid, adapter, expected=expected, arrival=arrival, queued_since=arrival if since is None else since
    )


def busy(rid, queue=(), adapter="a", left=(10, 10), resident=None, **kw):
    runs = [make_request(f"run{rid}-{i}", adapter, output=5, expected=5 + n, running=True) for i, n in enumerate(left)]
    return make_replica(rid, [*runs, *queue], resident=resident or {"a", "b"}, max_running=len(left), **kw)


def plan(*views, cfg=CFG):
    return plan_rebalance(views, {v.replica_id: P for v in views}, NOW, cfg)


def test_the_newest_move_while_the_summed_wait_drops():
    src = busy(0, [queued(f"q{i}", float(i)) for i in range(4)])  # waits 10, 10, 20, 20
    dst = busy(1)
    assert plan_queued([src, dst], NOW, QueuedConfig()).moves == ()  # nobody can start one now
    p = plan(src, dst)
    # q3 (saves 10), then q2 (saves 10); q1 would cost 10 more on replica 1 than it saves
    assert p.moves == (("q3", 0, 1), ("q2", 0, 1)) and p.loads == ()
    assert p.oldest_wait_s == NOW - 2.0
    t = rebalance_trigger(p, CFG)
    assert (t.reason, t.overloaded) == ("rebalance", 0)


def test_even_queues_and_small_gains_stay():
    even = [busy(0, [queued("a0", 0.0), queued("a1", 1.0)]), busy(1, [queued("b0", 0.5), queued("b1", 1.5)])]
    assert plan(*even).moves == ()
    lopsided = [busy(0, [queued(f"q{i}", float(i)) for i in range(4)]), busy(1)]
    assert plan(*lopsided, cfg=dataclasses.replace(CFG, min_gain_s=10.5)).moves == ()  # each saves 10
    assert len(plan(*lopsided, cfg=dataclasses.replace(CFG, max_moves=1)).moves) == 1


def test_young_and_running_requests_stay():
    src = busy(
        0,
        [
            queued("old0", 0.0),
            queued("old1", 1.0),
            queued("young0", 98.0, since=NOW - 0.5),
            queued("young1", 99.0, since=NOW - 0.5),
        ],
    )
    moved = [rid for rid, _, _ in plan(src, busy(1)).moves]
    assert moved and set(moved) <= {"old0", "old1"}


def test_a_request_whose_adapter_runs_on_the_receiver_goes_before_a_newer_one():
    # replica 1 runs "b" on its only batch slot (4 and 20 tokens left): an "a" request would wait
    # for "b" to drain (20), a "b" request only for the first free slot (4)
    src = busy(0, [queued("q0", 0.0), queued("qb", 1.0, adapter="b"), queued("q2", 2.0), queued("q3", 3.0)])
    dst = busy(1, adapter="b", left=(4, 20), batch_adapter_slots=1)
    assert plan(src, dst, cfg=dataclasses.replace(CFG, max_moves=1)).moves == (("qb", 0, 1),)


def test_receivers_must_be_able_to_run_the_adapter():
    src = busy(0, [queued(f"q{i}", float(i)) for i in range(4)])
    merged_other = busy(1, merged_adapter="b")
    assert plan(src, merged_other).moves == ()
    # an absent adapter is loaded first, if a slot without requests is left for it
    absent = busy(1, adapter="b", resident={"b"}, adapter_slots=2)
    p = plan(src, absent)
    assert p.moves and p.loads == (("a", 1),)
    assert plan(src, busy(1, adapter="b", resident={"b"}, adapter_slots=1)).moves == ()
    assert plan(src, dataclasses.replace(busy(1), healthy=False)).moves == ()
