"""The engine's numbered samples (engine_ext/samples.py): a read takes nothing away, so every reader
sees every sample once it asks from the number it last saw."""

from __future__ import annotations

from dlora.engine_ext.samples import QueueWait, SampleLog, StepSample, split, step_sample


def test_two_readers_each_get_every_sample():
    log = SampleLog()
    router_seen = metrics_seen = 0
    log.append(StepSample(1, 6, 0, 0.05, False))
    log.append(QueueWait("r1", 0.2))
    got = log.since(router_seen)
    router_seen = log.seq
    assert got == [(1, 6, 0, 0.05, False), ("r1", 0.2)] and router_seen == 2
    log.append(StepSample(2, 0, 2, 0.04, True))
    assert log.since(router_seen) == [(2, 0, 2, 0.04, True)]
    # Another reader, reading later, still gets all three; the first one's reads took none away.
    assert log.since(metrics_seen) == [(1, 6, 0, 0.05, False), ("r1", 0.2), (2, 0, 2, 0.04, True)]
    assert log.since(log.seq) == []


def test_the_ring_keeps_the_newest_and_a_number_from_a_replaced_engine_reads_all():
    log = SampleLog(max_samples=3)
    for i in range(5):
        log.append(QueueWait(str(i), float(i)))
    assert [w.request_id for w in log.since(0)] == ["2", "3", "4"]  # a reader 5 behind misses 2
    assert [w.request_id for w in log.since(3)] == ["3", "4"]  # numbered 4 and 5
    # A number past the newest was handed out by an engine this one replaced: all it keeps.
    assert [w.request_id for w in log.since(99)] == ["2", "3", "4"]


def test_split_keeps_each_kind_in_order():
    samples = [StepSample(1, 0, 1, 0.01, False), QueueWait("a", 0.5), StepSample(2, 0, 2, 0.02, True)]
    steps, waits = split(samples)
    assert steps == ((1, 0, 1, 0.01, False), (2, 0, 2, 0.02, True)) and waits == (("a", 0.5),)


def test_a_step_sample_counts_one_token_requests_as_decodes():
    assert step_sample({"p": 6, "d1": 1, "d2": 1}, 8, 0.1, True) == (3, 6, 2, 0.1, True)
    assert step_sample({}, 0, 0.1, False) is None
    assert step_sample({"d": 1}, 1, 0.0, False) is None
