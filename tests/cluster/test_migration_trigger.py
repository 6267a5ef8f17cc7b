from dlora.cluster.migration.trigger import TriggerConfig, check_trigger
from tests.cluster.balancer_factories import make_replica, make_request, many

CFG = TriggerConfig(interval_s=10.0, kv_high=0.90, count_imbalance=16, queue_delay_s=2.0)


def fire(replicas, now=100.0, last_run=None):
    t = check_trigger(replicas, now, last_run, CFG)
    return None if t is None else (t.reason, t.overloaded)


def test_kv_fires_at_exactly_90_percent_while_another_replica_is_below():
    assert fire([make_replica(0, kv_usage=0.90), make_replica(1, kv_usage=0.10)]) == ("kv", 0)
    assert fire([make_replica(0, kv_usage=0.8999), make_replica(1, kv_usage=0.10)]) is None
    assert fire([make_replica(0, kv_usage=0.95), make_replica(1, kv_usage=0.90)]) is None  # nowhere to go


def test_count_imbalance_fires_above_16_not_at_16():
    assert fire([make_replica(0, many("r", 17, running=True)), make_replica(1)]) == ("count", 0)
    assert fire([make_replica(0, many("r", 16, running=True)), make_replica(1)]) is None
    assert fire([make_replica(0, many("r", 20, running=True)), make_replica(1, many("s", 4, running=True))]) is None


def test_queue_delay_fires_at_the_threshold_while_another_replica_is_not_waiting():
    waiting = [make_request("q", queued_since=98.0)]  # waited exactly 2.0 s at now=100
    assert fire([make_replica(0), make_replica(1, waiting)]) == ("queue_delay", 1)
    assert fire([make_replica(0), make_replica(1, [make_request("q", queued_since=98.001)])]) is None
    running_long = [make_request("r", queued_since=0.0, running=True)]  # running requests do not queue
    assert fire([make_replica(0), make_replica(1, running_long)]) is None
    both = [make_replica(0, [make_request("q0", queued_since=90.0)]), make_replica(1, waiting)]
    assert fire(both) is None


def test_interval_and_health_gate_every_trigger():
    hot = [make_replica(0, kv_usage=0.99), make_replica(1, kv_usage=0.0)]
    assert fire(hot, now=100.0, last_run=90.001) is None
    assert fire(hot, now=100.0, last_run=90.0) == ("kv", 0)
    assert fire([hot[0], make_replica(1, kv_usage=0.0, healthy=False)]) is None
    assert fire([hot[0]]) is None
