"""The queued-request planner: which waiting requests go where, worked out by hand."""

from dlora.cluster.migration.queued import QueuedConfig, plan_queued, queued_trigger
from tests.cluster.balancer_factories import make_replica, make_request, many

NOW = 10.0
CFG = QueuedConfig(min_wait_s=1.0, kv_high=0.90)


def waiting(rid, adapter="a", since=0.0, **kw):
    return make_request(rid, adapter, running=False, queued_since=since, **kw)


def busy(rid: int, n_running: int, queued=(), adapter="a", **kw):
    """A replica running `n_running` requests of `adapter` (all its slots when max_running = n_running)."""
    return make_replica(rid, [*many(f"run{rid}-", n_running, adapter, running=True), *queued], resident={adapter}, **kw)


def plan(*views, now=NOW, cfg=CFG):
    return plan_queued(views, now, cfg)


def moved(p):
    return [rid for rid, _, _ in p.moves]


def test_nothing_moves_when_no_replica_could_start_a_request():
    full = busy(1, 2, max_running=2)
    assert plan(busy(0, 2, [waiting("q0"), waiting("q1")], max_running=2), full).moves == ()
    # nothing waits long enough: the youngest may just not have met a step or a stats read yet
    young = busy(0, 2, [waiting("q0", since=NOW - 0.5)], max_running=2)
    assert plan(young, make_replica(1, max_running=2)).moves == ()


def test_the_oldest_fill_the_free_running_slots():
    src = busy(0, 2, [waiting("q0", since=5.0), waiting("q1", since=1.0), waiting("q2", since=3.0)], max_running=2)
    idle = make_replica(1, many("r", 1, "a", running=True), resident={"a"}, max_running=3)  # 2 free
    p = plan(src, idle)
    assert p.moves == (("q1", 0, 1), ("q2", 0, 1)) and p.loads == ()
    assert p.oldest_wait_s == 9.0
    t = queued_trigger(p, CFG)
    assert (t.reason, t.overloaded) == ("queued", 0)


def test_running_and_young_requests_stay():
    src = busy(0, 2, [waiting("young", since=NOW - 0.2), waiting("old", since=NOW - 1.0)], max_running=2)
    assert moved(plan(src, make_replica(1, resident={"a"}))) == ["old"]


def test_kv_room_up_to_kv_high_bounds_the_moves():
    # receiver: 1000 tokens, half used -> room for 400 more; each request needs its context's KV
    src = busy(
        0, 1, [waiting(f"q{i}", since=float(i), prompt=p) for i, p in enumerate((150, 150, 150, 50))], max_running=1
    )
    recv = make_replica(1, resident={"a"}, kv_capacity_tokens=1000, kv_usage=0.5)
    assert moved(plan(src, recv)) == ["q0", "q1", "q3"]  # q2 (150) no longer fits, q3 (50) does
    assert plan(src, make_replica(1, resident={"a"}, kv_capacity_tokens=1000, kv_usage=0.9)).moves == ()
    # a moved request's context (prompt + what it generated elsewhere) is what needs room
    grown = busy(0, 1, [waiting("m", prompt=100, output=350, expected=400)], max_running=1)
    assert plan(grown, recv).moves == ()


def test_a_new_adapter_needs_a_free_batch_slot_and_a_load():
    src = busy(
        0,
        4,
        [waiting("b0", "b", 1.0), waiting("c0", "c", 2.0), waiting("a0", "a", 3.0), waiting("b1", "b", 4.0)],
        max_running=4,
    )
    recv = make_replica(1, many("r", 1, "a", running=True), resident={"a", "c"}, batch_adapter_slots=2)
    p = plan(src, recv)
    # b takes the last batch slot (a load: it is absent), so c, though resident, cannot start there
    assert moved(p) == ["b0", "a0", "b1"] and p.loads == (("b", 1),)


def test_no_load_without_a_free_adapter_slot():
    src = busy(0, 1, [waiting("b0", "b", 1.0), waiting("a0", "a", 2.0)], max_running=1)
    recv = make_replica(1, many("r", 1, "a", running=True), resident={"a"}, adapter_slots=1)
    p = plan(src, recv)
    assert moved(p) == ["a0"] and p.loads == ()


def test_a_merged_receiver_takes_only_its_merged_adapters_requests():
    src = busy(0, 1, [waiting("a0", "a", 1.0), waiting("base", None, 2.0), waiting("m0", "m", 3.0)], max_running=1)
    merged = make_replica(1, many("r", 2, "m", running=True), resident={"a", "m"}, merged_adapter="m")
    assert moved(plan(src, merged)) == ["m0"]


def test_a_replica_with_its_own_backlog_receives_nothing_and_young_arrivals_use_up_starts():
    src = busy(0, 2, [waiting("q0", since=1.0), waiting("q1", since=2.0)], max_running=2)
    backlogged = make_replica(1, [waiting("own", since=5.0)], resident={"a"}, max_running=4)
    assert plan(src, backlogged).moves == ()
    fresh = make_replica(1, [waiting("new", since=NOW - 0.1)], resident={"a"}, max_running=2)
    assert moved(plan(src, fresh)) == ["q0"]  # "new" starts there first: one start left


def test_each_request_goes_where_its_adapter_runs_else_is_held_else_to_the_roomiest():
    src = busy(
        0,
        1,
        [waiting("b0", "b", 1.0), waiting("base", None, 2.0), waiting("c0", "c", 3.0), waiting("d0", "d", 4.0)],
        max_running=1,
    )
    runs_b = make_replica(1, many("r", 1, "b", running=True), resident={"b"}, max_running=5)  # 4 starts
    holds_c = make_replica(2, resident={"c"}, max_running=3)  # 3 starts
    p = plan(src, runs_b, holds_c)
    # b0 joins b; base then finds 3 starts on both (ties to the lower id); c0 goes where c is
    # resident; d is nowhere, and replica 1 has 2 starts left against replica 2's 2: lower id
    assert p.moves == (("b0", 0, 1), ("base", 0, 1), ("c0", 0, 2), ("d0", 0, 1)) and p.loads == (("d", 1),)
    roomier = plan(src, runs_b, make_replica(2, resident={"c"}, max_running=5))  # 5 starts
    # base: 3 starts left on replica 1, 5 on replica 2; d0: 3 left on each after c0
    assert roomier.moves == (("b0", 0, 1), ("base", 0, 2), ("c0", 0, 2), ("d0", 0, 1))


def test_unhealthy_replicas_neither_send_nor_receive():
    src = busy(0, 1, [waiting("q0")], max_running=1)
    assert plan(src, make_replica(1, resident={"a"}, healthy=False)).moves == ()
    down = busy(0, 1, [waiting("q0")], max_running=1, healthy=False)
    assert plan(down, make_replica(1, resident={"a"})).moves == ()


def test_only_the_given_receivers_take_moves():
    src = busy(0, 2, [waiting("q0", since=1.0), waiting("q1", since=2.0)], max_running=2)
    one, two = make_replica(1, max_running=1), make_replica(2, max_running=1)
    assert plan_queued((src, one, two), NOW, CFG, receivers_from={2}).moves == (("q0", 0, 2),)
    assert plan_queued((src, one, two), NOW, CFG, receivers_from=set()).moves == ()
    assert len(plan_queued((src, one, two), NOW, CFG).moves) == 2  # None: any replica
