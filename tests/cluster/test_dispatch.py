import pytest

from dlora.cluster.dispatch import (
    DISPATCH_POLICIES,
    NoEligibleReplica,
    ProactiveDispatch,
    make_dispatch_policy,
)
from dlora.cluster.estimators.replica_cost import CostParams, merge_disruption, pending_time, request_work, step_left
from tests.cluster.balancer_factories import make_replica, make_request, many

P = CostParams(adapter_load_s=0.02)
PARAMS = {0: P, 1: P, 2: P}
NEW = make_request("new", "a", prompt=50, expected=50)


def choose(replicas, req=NEW, params=PARAMS):
    return ProactiveDispatch().choose(replicas, req, params)


def soonest(replicas, req=NEW, params=PARAMS, slack=0.05):
    return ProactiveDispatch(start_slack_s=slack).choose(replicas, req, params)


def test_holder_wins_when_loads_are_equal():
    d = choose([make_replica(0, resident={"a"}), make_replica(1)])
    assert (d.replica_id, d.load_adapter) == (0, False)


def test_holder_wins_while_its_extra_backlog_is_below_the_adapter_load_time():
    small = make_request("x", "a", prompt=0, expected=10, running=True)  # ~10 ms of work
    assert request_work(P, small) < P.adapter_load_s
    d = choose([make_replica(0, [small], resident={"a"}), make_replica(1)])
    assert (d.replica_id, d.load_adapter) == (0, False)


def test_overloaded_holder_sends_the_request_elsewhere_with_an_adapter_load():
    backlog = many("h", 20, "a", running=True, expected=200)
    other = make_replica(1, many("o", 2, "b", running=True), resident={"b"})
    d = choose([make_replica(0, backlog, resident={"a"}), other])
    assert (d.replica_id, d.load_adapter) == (1, True)
    assert d.pending_s > P.adapter_load_s


def test_holder_at_the_kv_threshold_is_skipped_even_with_less_work():
    d = choose([make_replica(0, resident={"a"}, kv_usage=0.90), make_replica(1, many("o", 3, "b", running=True))])
    assert (d.replica_id, d.load_adapter) == (1, True)
    d = choose([make_replica(0, resident={"a"}, kv_usage=0.8999), make_replica(1, many("o", 3, "b", running=True))])
    assert d.replica_id == 0


def test_every_replica_overloaded_falls_back_to_the_shortest_pending_time():
    d = choose([make_replica(0, many("h", 5), resident={"a"}, kv_usage=0.95), make_replica(1, kv_usage=0.97)])
    assert d.replica_id == 1


def test_non_holder_without_a_free_adapter_slot_cannot_take_it():
    full = make_replica(1, [make_request("b0", "b", running=True)], resident={"b"}, adapter_slots=1)
    d = choose([make_replica(0, many("h", 20, "a", running=True, expected=200), resident={"a"}), full])
    assert d.replica_id == 0
    with pytest.raises(NoEligibleReplica):
        choose([full])


def test_merged_holder_is_cheaper_and_base_requests_need_no_load():
    backlog = many("h", 4, "b", running=True)
    plain = make_replica(0, backlog, resident={"a", "b"})
    merged = make_replica(1, backlog, resident={"a", "b"}, merged_adapter="a")
    assert choose([plain, merged]).replica_id == 1
    base = make_request("base", None)
    d = choose([make_replica(0, backlog), make_replica(1, backlog + many("x", 1, "b"))], req=base)
    assert (d.replica_id, d.load_adapter) == (0, False)


def test_other_adapters_avoid_a_merged_replica_until_the_unmerged_one_is_far_busier():
    # Replica 0 runs "a" merged (at 0.4 of unmerged cost); replica 1 serves a mix unmerged. A "b"
    # request would make replica 0 unmerge, so its 8 "a" requests would run at full cost.
    p = CostParams(merged_ratio=0.4)
    params = {0: p, 1: p}
    hot = many("h", 8, "a", running=True, expected=100)
    merged = make_replica(0, hot, resident={"a", "b"}, merged_adapter="a")
    cold = make_request("cold", "b", prompt=50, expected=50)
    assert merge_disruption(p, merged, "b") == pytest.approx(sum(request_work(p, r) * 0.6 for r in hot))
    assert merge_disruption(p, merged, "a") == 0.0
    assert merge_disruption(p, make_replica(1, hot, resident={"a"}), "b") == 0.0  # nothing merged
    mixed = make_replica(1, many("m", 5, "c", running=True, expected=100), resident={"b", "c"})
    # Replica 0's backlog is smaller (8 x 0.4 < 5 x 1), but breaking its merge costs more.
    assert choose([merged, mixed], cold, params).replica_id == 1
    # The merged adapter's own requests still go where they are cheap.
    assert choose([merged, mixed], make_request("hot", "a"), params).replica_id == 0
    # Once the unmerged replica is far busier, the merged one takes the cold request after all.
    swamped = make_replica(1, many("m", 30, "c", running=True, expected=100), resident={"b", "c"})
    assert choose([merged, swamped], cold, params).replica_id == 0


def test_a_cold_adapter_goes_where_a_batch_slot_is_free_not_where_four_others_hold_them():
    # Replica 0 is lightly loaded but runs four other adapters (max_loras 4); replica 1 has more
    # work but only "b". A request for "a" would wait on replica 0 until one of the four drains.
    four = [make_request(f"x{k}", k, output=0, expected=100, running=True) for k in "bcde"]
    busy = many("b", 8, "b", running=True, expected=100)
    resident = {"a", "b", "c", "d", "e"}
    few_slots = [
        make_replica(0, four, resident=resident, batch_adapter_slots=4),
        make_replica(1, busy, resident=resident, batch_adapter_slots=4),
    ]
    assert pending_time(P, few_slots[0]) < pending_time(P, few_slots[1])
    assert choose(few_slots).replica_id == 1
    # An adapter already running on replica 0 joins it there, and without the limit the lighter
    # replica wins as before.
    assert choose(few_slots, make_request("c1", "c")).replica_id == 0
    no_limit = [make_replica(0, four, resident=resident), make_replica(1, busy, resident=resident)]
    assert choose(no_limit).replica_id == 0


def test_unhealthy_replicas_are_never_chosen():
    d = choose([make_replica(0, resident={"a"}, healthy=False), make_replica(1)])
    assert (d.replica_id, d.load_adapter) == (1, True)


def test_round_robin_cycles_over_holders_and_least_loaded_ignores_adapters():
    replicas = [make_replica(0, resident={"a"}), make_replica(1), make_replica(2, resident={"a"})]
    rr = make_dispatch_policy("round_robin")
    assert [rr.choose(replicas, NEW, PARAMS).replica_id for _ in range(4)] == [0, 2, 0, 2]
    replicas[0] = make_replica(0, many("h", 3), resident={"a"})
    d = make_dispatch_policy("least_loaded").choose(replicas, NEW, PARAMS)
    assert (d.replica_id, d.load_adapter) == (1, True)


def test_registry_names_and_unknown_name_error():
    assert set(DISPATCH_POLICIES) == {"proactive", "round_robin", "least_loaded"}
    with pytest.raises(ValueError, match="supported are proactive, round_robin, least_loaded"):
        make_dispatch_policy("random")


def test_non_holder_without_host_cache_room_for_the_adapter_bytes_cannot_take_it():
    # Replica 1 has slots free but only 30 MB it could free (pinned and busy adapters keep the
    # rest); a 40 MB adapter goes to the busier holder, a 20 MB one may go to replica 1.
    import dataclasses

    holder = make_replica(0, many("h", 20, "a", running=True, expected=200), resident={"a"})
    tight = make_replica(1, adapter_bytes_free=30 * 2**20)
    big = dataclasses.replace(NEW, adapter_bytes=40 * 2**20)
    assert choose([holder, tight], big).replica_id == 0
    small = dataclasses.replace(NEW, adapter_bytes=20 * 2**20)
    assert (choose([holder, tight], small).replica_id, choose([holder, tight], small).load_adapter) == (1, True)
    with pytest.raises(NoEligibleReplica, match="retry later") as err:
        choose([tight], big)
    assert err.value.http_status == 503
    # a replica that holds the adapter takes it whatever its cache room
    assert choose([make_replica(1, resident={"a"}, adapter_bytes_free=0)], big).replica_id == 1


# ---- the start slack: the replica whose step under way ends soonest


def decoding(rid: int, step_left_s: float, **kw):
    """Four long decodes under way (much pending work), adapter `a` resident."""
    return make_replica(
        rid, many(f"d{rid}-", 4, "a", running=True, expected=200), resident={"a"}, step_left_s=step_left_s, **kw
    )


def test_with_a_start_slack_the_replica_ending_its_step_first_takes_it_over_less_pending_work():
    prefilling = make_replica(
        0, [make_request("p", "a", prompt=2000, expected=5, running=True)], resident={"a"}, step_left_s=0.6
    )
    assert choose([prefilling, decoding(1, 0.01)]).replica_id == 0  # pending time alone: the light one
    assert soonest([prefilling, decoding(1, 0.01)]).replica_id == 1  # there it would wait out 0.6 s


def test_replicas_within_the_slack_of_the_soonest_are_compared_by_pending_time():
    light = make_replica(0, [make_request("x", "a", expected=10, running=True)], resident={"a"}, step_left_s=0.04)
    assert soonest([light, decoding(1, 0.0)]).replica_id == 0  # 0.04 s is within 0.05 s of 0
    assert soonest([light, decoding(1, 0.0)], slack=0.03).replica_id == 1


def test_only_a_free_running_and_batch_slot_counts_as_starting_soon():
    full = make_replica(0, many("f", 2, "a", running=True, expected=5), resident={"a"}, max_running=2)
    assert full.step_left_s == 0.0 and not full.has_free_slot("a")
    assert soonest([full, decoding(1, 0.5)]).replica_id == 1
    queued = make_replica(0, many("q", 2, "a", expected=5), resident={"a"}, max_running=2)  # queued ones take the slots
    assert soonest([queued, decoding(1, 0.5)]).replica_id == 1
    other = make_replica(
        0, [make_request("b0", "b", running=True, expected=5)], resident={"a", "b"}, batch_adapter_slots=1
    )
    assert soonest([other, decoding(1, 0.5)]).replica_id == 1  # max_loras: b holds the one batch slot
    assert soonest([other, decoding(1, 0.5)], req=make_request("nb", "b", prompt=50, expected=50)).replica_id == 0


def test_a_replica_without_kv_room_for_the_prompt_does_not_count_as_starting_soon():
    # 1,000 KV tokens, 86% in use: 40 tokens below the 90% mark, short of the new request's 50
    tight = make_replica(0, resident={"a"}, kv_capacity_tokens=1000, kv_usage=0.86)
    assert soonest([tight, decoding(1, 0.5)]).replica_id == 1
    roomy = make_replica(0, resident={"a"}, kv_capacity_tokens=1000, kv_usage=0.85)  # 50 tokens: it fits
    assert soonest([roomy, decoding(1, 0.5)]).replica_id == 0


def test_with_no_free_slot_anywhere_pending_time_alone_decides():
    full = make_replica(0, many("f", 2, "a", running=True, expected=5), resident={"a"}, max_running=2)
    also_full = decoding(1, 0.0, max_running=4)
    assert soonest([full, also_full]).replica_id == choose([full, also_full]).replica_id == 0


def test_an_adapter_load_counts_in_when_a_replica_would_start_the_request():
    params = {0: P, 1: CostParams(adapter_load_s=0.5)}
    idle_without_it = make_replica(1)
    assert choose([decoding(0, 0.01), idle_without_it], params=params).replica_id == 1  # less pending work
    assert soonest([decoding(0, 0.01), idle_without_it], params=params).replica_id == 0  # starts 0.49 s sooner


def test_make_dispatch_policy_passes_the_slack_to_proactive_dispatch_only():
    assert make_dispatch_policy("proactive", 0.2).start_slack_s == 0.2
    assert make_dispatch_policy("proactive").start_slack_s is None
    assert make_dispatch_policy("round_robin", 0.2).name == "round_robin"


def test_step_left_prices_the_step_under_way_from_its_start():
    p = CostParams(per_iteration_s=0.01, per_decode_token_s=0.002, per_prefill_token_s=0.001)
    # 4 decoding sequences and 100 prompt tokens: 0.01 + 4 * 0.002 + 100 * 0.001 = 0.118 s from t=10
    assert step_left(p, 10.0, 10.05, 4, 100) == pytest.approx(0.068)
    assert step_left(p, 10.0, 11.0, 4, 100) == 0.0  # overdue
    assert step_left(p, None, 10.0, 4, 100) == 0.0  # no step seen yet
    assert step_left(p, 10.0, 10.0, 0, 0) == 0.0  # nothing to run
