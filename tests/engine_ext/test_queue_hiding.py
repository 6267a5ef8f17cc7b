"""Which requests vLLM's scheduler sees, and in which order (engine_ext/queue_hiding.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.engine_ext.queue_hiding import in_rank_order, running_after, service_order, split


@dataclass(eq=False)
class Req:
    request_id: str
    adapter: str | None = None


def ids(requests):
    return [r.request_id for r in requests]


def test_hidden_requests_go_back_in_their_places_and_vllms_changes_stay():
    a, b, c, d = (Req(i) for i in "abcd")
    shown, hidden = split([a, b, c], {"a", "c"})
    assert ids(shown) == ["a", "c"] and ids(hidden) == ["b"]
    # vLLM preempted c and admitted d among the visible requests; b was hidden the whole time.
    assert ids(running_after([a, b, c], [a, d], {"a", "c"})) == ["a", "b", "d"]
    assert ids(running_after([a, b], [a, b], {"a", "b"})) == ["a", "b"]


def test_visible_waiting_requests_queue_in_the_plans_order():
    reqs = [Req("x"), Req("y"), Req("z")]
    assert ids(in_rank_order(reqs, ["z", "x", "y"])) == ["z", "x", "y"]


def test_the_service_order_is_client_priority_then_quota_borrowers_last_then_the_plan():
    reqs = [Req("hot1", "hot"), Req("cold", "cold"), Req("vip", "hot"), Req("hidden", "cold"), Req("hot2", "hot")]
    client = {"vip": -1}
    order = service_order(reqs, client, {"hot"}, lambda r: r.adapter, ["hot2", "hot1", "cold", "vip"])
    assert ids(order) == ["vip", "cold", "hidden", "hot2", "hot1"]
    order = service_order(reqs, client, set(), lambda r: r.adapter, ["hot2", "hot1", "cold", "vip"])
    assert ids(order) == ["vip", "hot2", "hot1", "cold", "hidden"]
