"""Estimated queue waits, worked out by hand: one second per token, prefill free, loads free
unless a test says otherwise."""

from dlora.cluster.estimators.replica_cost import CostParams, step_seconds
from dlora.cluster.estimators.wait_estimate import queue_order, start_times, total_wait
from tests.cluster.balancer_factories import make_replica, make_request

P = CostParams(per_iteration_s=1.0, per_decode_token_s=0.0, per_prefill_token_s=0.0, adapter_load_s=0.0)
KV_HIGH = 0.9


def running(rid, left, adapter="a"):
    return make_request(rid, adapter, output=10, expected=10 + left, running=True)


def queued(rid, arrival, expected=10, adapter="a"):
    return make_request(rid, adapter, expected=expected, arrival=arrival, queued_since=arrival)


def test_queued_requests_take_slots_as_they_free_in_first_arrival_order():
    view = make_replica(
        0,
        [
            running("r1", 10),
            running("r2", 4),
            queued("q1", 1.0, expected=3),
            queued("q2", 2.0, expected=5),
            queued("q3", 0.5, expected=3),
        ],
        resident={"a"},
        max_running=2,
    )
    assert [r.request_id for r in queue_order(view)] == ["q3", "q1", "q2"]
    # slots free at 4 and 10; q3 runs 4..7, q1 7..10, q2 takes the first slot free at 10
    assert start_times(view, P, KV_HIGH) == {"q3": 4.0, "q1": 7.0, "q2": 10.0}
    assert total_wait(view, P, KV_HIGH) == 21.0


def test_free_slots_start_requests_now_unless_kv_is_past_kv_high():
    reqs = [running("r", 6), queued("q1", 1.0, expected=2), queued("q2", 2.0, expected=2)]
    roomy = make_replica(0, reqs, resident={"a"}, max_running=4, kv_usage=0.5)
    assert start_times(roomy, P, KV_HIGH) == {"q1": 0.0, "q2": 0.0}
    # KV full: nothing new starts until the running request ends, then one at a time
    full = make_replica(0, reqs, resident={"a"}, max_running=4, kv_usage=0.95)
    assert start_times(full, P, KV_HIGH) == {"q1": 6.0, "q2": 8.0}


def test_an_adapter_waits_for_a_batch_slot_or_its_load():
    # one batch slot, held by "a" for 5 more tokens: "b" cannot join a step before then
    view = make_replica(
        0, [running("r", 5), queued("b1", 1.0, adapter="b")], resident={"a", "b"}, max_running=4, batch_adapter_slots=1
    )
    assert start_times(view, P, KV_HIGH) == {"b1": 5.0}
    slow_load = CostParams(per_iteration_s=1.0, per_decode_token_s=0.0, per_prefill_token_s=0.0, adapter_load_s=0.5)
    absent = make_replica(0, [queued("c1", 1.0, adapter="c")], resident={"a"}, max_running=4)
    assert start_times(absent, slow_load, KV_HIGH) == {"c1": 0.5}


def test_step_time_grows_with_the_batch_and_prefill_counts_in_a_queued_run():
    p = CostParams(per_iteration_s=0.5, per_decode_token_s=0.25, per_prefill_token_s=0.01, max_batch=2)
    assert step_seconds(p, 1) == 0.75 and step_seconds(p, 2) == step_seconds(p, 5) == 1.0
    # one slot -> batches of 1 at 0.75 s per token: r frees its slot at 2.25; q1 holds it for its
    # 100-token prefill (1 s) and 2 tokens (1.5 s)
    reqs = [running("r", 3), queued("q1", 1.0, expected=2), queued("q2", 2.0)]
    assert start_times(make_replica(0, reqs, resident={"a"}, max_running=1), p, KV_HIGH) == {"q1": 2.25, "q2": 4.75}
    # two slots -> batches of 2 at 1 s per token: q1 starts now, q2 when r ends
    assert start_times(make_replica(0, reqs, resident={"a"}, max_running=2), p, KV_HIGH) == {"q1": 0.0, "q2": 3.0}
