"""Per-request queueing delay: the replicas' measurements summed per request, observed once."""

from __future__ import annotations

import pytest

from dlora.cluster.queue_time import QueueTimes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(expiry_s: float = 60.0):
    clock, seen = Clock(), []
    q = QueueTimes(clock, expiry_s=expiry_s)
    q.observer = lambda adapter, s: seen.append((adapter, s))
    return q, clock, seen


def test_router_wait_plus_the_replicas_measurement_observed_at_finish():
    q, clock, seen = make()
    q.start("r", "a")
    q.router_wait("r", 0.25)
    q.sent("r", "r")
    q.report([("r", 1.5), ("unknown", 9.0)])  # ids the router never sent are ignored
    q.stream_ended("r")
    assert seen == []  # not finished yet
    q.finish("r")
    assert seen == [("a", pytest.approx(1.75))] and q.pending == 0


def test_a_measurement_after_the_finish_is_awaited_then_observed_once():
    q, clock, seen = make()
    q.start("r", None)
    q.sent("r", "r")
    clock.t += 3.0
    q.first_token("r")
    q.stream_ended("r")
    q.finish("r")
    assert seen == []  # parked: the bound (3 s, includes the prefill) is not the measurement
    q.report([("r", 0.4)])
    q.report([("r", 0.4)])
    assert seen == [(None, pytest.approx(0.4))]


def test_a_migrated_request_waits_again_on_its_new_replica():
    q, clock, seen = make()
    q.start("m", "a")
    q.sent("m", "m")
    q.report([("m", 2.0)])
    q.stream_ended("m")  # migrated
    q.router_wait("m", 0.01)
    q.sent("m", "m-r1")
    q.report([("m-r1", 0.5)])
    q.finish("m")
    assert seen == [("a", pytest.approx(2.51))]


def test_a_failed_replica_is_replaced_by_the_routers_bound_up_to_the_first_token():
    q, clock, seen = make()
    q.start("f", "a")
    q.sent("f", "f")
    clock.t += 2.0
    q.first_token("f")
    clock.t += 5.0
    q.stream_ended("f", lost=True)  # died mid-stream: its measurement will not come
    q.sent("f", "f-r1")
    q.report([("f-r1", 1.0)])
    q.finish("f")
    assert seen == [("a", pytest.approx(3.0))]


def test_missing_measurements_expire_with_the_routers_bound():
    q, clock, seen = make(expiry_s=30.0)
    q.start("x", "a")
    q.sent("x", "x")
    clock.t += 4.0
    q.stream_ended("x")  # no token: aborted while queued, and the replica never reported
    q.finish("x")
    clock.t += 29.0
    q.expire()
    assert seen == []
    clock.t += 1.0
    q.expire()
    assert seen == [("a", pytest.approx(4.0))] and q.pending == 0
    q.report([("x", 1.0)])  # too late: nothing is observed twice
    assert len(seen) == 1


def test_a_request_that_never_reached_a_replica_has_only_its_router_wait():
    q, clock, seen = make()
    q.start("n", "a")
    q.router_wait("n", 7.0)
    q.finish("n")
    assert seen == [("a", pytest.approx(7.0))]
