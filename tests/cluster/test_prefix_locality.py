"""The router's record of which prompt prefixes each replica's KV cache holds, and dispatch pricing
the prefill a cached prefix saves against a replica's backlog."""

from __future__ import annotations

import dataclasses

import pytest

from dlora.cluster.dispatch import ProactiveDispatch, estimate
from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.problem import MigrationConfig, build_problem
from dlora.cluster.policy_views import ClusterView, ReplicaView, RequestLoad
from dlora.cluster.prefix_locality import PrefixLocality, prompt_blocks, weight_state

BLOCK = 16
PROMPT = tuple(range(100, 100 + 5 * BLOCK + 7))  # 5 full blocks and a partial one


def blocks(tokens=PROMPT, adapter="a", digest="d1"):
    return prompt_blocks(tokens, adapter, digest, BLOCK)


def test_a_prompt_counts_its_full_blocks_only_and_a_shared_prefix_matches_up_to_where_it_ends():
    idx = PrefixLocality()
    idx.record(0, blocks(), "", capacity_tokens=10_000)
    assert idx.cached_tokens(0, blocks(), "") == 5 * BLOCK  # the partial block is never cached
    longer = PROMPT[: 3 * BLOCK] + tuple(range(9000, 9000 + 4 * BLOCK))  # the same first 3 blocks, then others
    assert idx.cached_tokens(0, blocks(longer), "") == 3 * BLOCK
    changed_first = (7,) + PROMPT[1:]  # one token differs in the first block: nothing after it matches
    assert idx.cached_tokens(0, blocks(changed_first), "") == 0
    assert idx.cached_tokens(1, blocks(), "") == 0  # another replica holds nothing


@pytest.mark.parametrize(
    "adapter, digest",
    [("b", "d1"), ("a", "d2"), (None, "")],
    ids=["another adapter", "another version of the adapter", "the base model"],
)
def test_the_same_text_under_another_adapter_or_version_gets_no_credit(adapter, digest):
    idx = PrefixLocality()
    idx.record(0, blocks(), "", capacity_tokens=10_000)
    assert idx.cached_tokens(0, blocks(adapter=adapter, digest=digest), "") == 0


def test_blocks_computed_in_one_weight_state_do_not_count_in_another():
    idx = PrefixLocality()
    idx.record(0, blocks(), weight_state(None), capacity_tokens=10_000)
    assert idx.cached_tokens(0, blocks(), weight_state("a")) == 0  # now merged: recomputed
    idx.record(0, blocks(), weight_state("a"), capacity_tokens=10_000)
    assert idx.cached_tokens(0, blocks(), weight_state("a")) == 5 * BLOCK
    assert idx.cached_tokens(0, blocks(), weight_state(None)) == 5 * BLOCK  # both kept, as vLLM keeps both


def test_a_replica_keeps_its_kv_capacity_of_the_most_recently_used_blocks():
    idx = PrefixLocality()
    capacity = 8 * BLOCK
    old = blocks(tuple(range(0, 5 * BLOCK + 1)))
    new = blocks(tuple(range(5000, 5000 + 5 * BLOCK + 1)))
    idx.record(0, old, "", capacity)
    idx.record(0, new, "", capacity)  # 10 blocks recorded into room for 8: old's first two go
    assert idx.recorded_blocks(0) == 8
    assert idx.cached_tokens(0, new, "") == 5 * BLOCK
    assert idx.cached_tokens(0, old, "") == 0  # its first block went, so no prefix of it is usable
    idx.record(0, blocks(tuple(range(0, 2 * BLOCK + 1))), "", capacity)  # old's first two blocks computed again
    # ... which evicts the two least recently used, old's blocks 3 and 4: two usable blocks
    assert idx.cached_tokens(0, old, "") == 2 * BLOCK
    assert idx.cached_tokens(0, new, "") == 5 * BLOCK
    idx.forget(0)
    assert idx.cached_tokens(0, new, "") == 0


P = CostParams(per_iteration_s=0.01, per_decode_token_s=0.002, per_prefill_token_s=0.001, max_batch=8)


def backlog(rid: int, n: int) -> ReplicaView:
    """A replica running `n` requests of 100 more output tokens each."""
    reqs = tuple(RequestLoad(f"q{rid}-{i}", None, 10, 0, 100.0, running=True) for i in range(n)) if n else ()
    return ReplicaView(replica_id=rid, requests=reqs)


def conversation_turn(cached_on_0: int) -> RequestLoad:
    return RequestLoad("turn", None, 1024, 0, 64.0, running=False, cached_prefix=((0, cached_on_0),))


def test_estimate_takes_the_saved_prefill_off_the_request_s_own_work():
    plain = RequestLoad("turn", None, 1024, 0, 64.0, running=False)
    saved = estimate(backlog(0, 0), plain, P) - estimate(backlog(0, 0), conversation_turn(896), P)
    assert saved == pytest.approx(896 * P.per_prefill_token_s)
    assert estimate(backlog(1, 0), conversation_turn(896), P) == estimate(backlog(1, 0), plain, P)  # not there


def test_a_cached_history_wins_over_a_shorter_queue_until_the_queue_costs_more_than_the_prefill():
    """Hand-worked: the turn's 896 cached tokens save 0.896 s of prefill on replica 0. One request
    of 100 tokens there costs 100 x (0.002 + 0.01 / 8) = 0.325 s of backlog: the turn stays. Four
    cost 1.3 s: it spills to the idle replica 1 and pays the prefill there."""
    dispatch = ProactiveDispatch()
    params = {0: P, 1: P}
    turn = conversation_turn(896)
    assert dispatch.choose([backlog(0, 1), backlog(1, 0)], turn, params).replica_id == 0
    assert dispatch.choose([backlog(0, 4), backlog(1, 0)], turn, params).replica_id == 1
    blind = RequestLoad("turn", None, 1024, 0, 64.0, running=False)
    assert dispatch.choose([backlog(0, 1), backlog(1, 0)], blind, params).replica_id == 1


def test_a_move_away_from_a_cached_history_costs_its_prefill_in_the_migration_problem():
    """The co-migration problem prices a queued request's work on each replica less the prefix
    that replica probably has cached, so moving a turn off its history costs the prefill there; a
    running request's rebuild on a target is cheaper by what that target has cached."""
    queued = RequestLoad("turn", None, 1024, 0, 64.0, running=False, cached_prefix=((0, 896),))
    running = RequestLoad("long", None, 1024, 10, 64.0, running=True, cached_prefix=((1, 512),))
    busy = ReplicaView(replica_id=0, requests=(queued, running, *backlog(0, 6).requests))
    problem = build_problem(ClusterView((busy, backlog(1, 0))), {0: P, 1: P}, MigrationConfig(top_k=1))
    assert problem is not None and problem.senders == [0] and problem.receivers == [1]
    group = problem.groups[0]
    at = {r.request_id: i for i, r in enumerate(group.requests)}
    q, r = at["turn"], at["long"]
    assert group.work[1][q] - group.work[0][q] == pytest.approx(896 * P.per_prefill_token_s)
    assert group.recompute[1][r] == pytest.approx((1034 - 512) * P.per_prefill_token_s)


def test_a_prompt_ending_on_a_block_boundary_reuses_one_block_less():
    """vLLM computes at least a prompt's last token, so its last full block is computed again."""
    idx = PrefixLocality()
    exact = PROMPT[: 5 * BLOCK]
    idx.record(0, blocks(exact), "", capacity_tokens=10_000)
    assert idx.cached_tokens(0, blocks(exact), "") == 4 * BLOCK
    assert idx.cached_tokens(0, blocks(exact + (1,)), "") == 5 * BLOCK  # one token more: all five


def test_the_start_slack_keeps_a_busy_replica_holding_the_history():
    """With the start slack, replicas that would start a request later than the soonest by more
    than the slack are not compared at all; the holder of the turn's history is mid-step (0.4 s
    left) while replica 1 is idle, but the 0.896 s of prefill it saves gives the first token sooner,
    so it stays among those compared, and wins."""
    dispatch = ProactiveDispatch(start_slack_s=0.05)
    holder = dataclasses.replace(backlog(0, 1), step_left_s=0.4)
    params = {0: P, 1: P}
    assert dispatch.choose([holder, backlog(1, 0)], conversation_turn(896), params).replica_id == 0
    blind = RequestLoad("turn", None, 1024, 0, 64.0, running=False)
    assert dispatch.choose([holder, backlog(1, 0)], blind, params).replica_id == 1
