"""The engine-side queue-wait ledger, and the mapping of vLLM's engine ids back to dlora's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dlora.engine_ext.queue_waits import QueueWaits
from dlora.replica.engine import external_request_id


def test_a_wait_ends_at_the_first_scheduling_only():
    w = QueueWaits()
    w.queued("a", 10.0)
    w.queued("b", 10.5)
    assert w.end(["a"], 11.25) == [("a", 1.25)]
    assert w.end(["a", "b"], 12.0) == [("b", 1.5)]  # a again (resumed after a preemption): no second wait


def test_a_request_aborted_while_queued_waited_until_the_abort():
    w = QueueWaits()
    w.queued("q", 3.0)
    assert w.end(["q"], 7.5) == [("q", 4.5)]  # finish_requests(abort) before any step admitted it
    assert w.end(["q"], 9.0) == []  # and a later step cannot count it again


def test_adding_a_known_request_again_keeps_its_first_queue_time():
    w = QueueWaits()
    w.queued("s", 1.0)
    w.queued("s", 2.0)
    assert w.end(["s"], 4.0) == [("s", 3.0)]


def test_engine_ids_map_back_to_the_ids_dlora_sent():
    pytest.importorskip("vllm")
    from vllm.v1.engine.input_processor import InputProcessor

    for sent in ("cmpl-4f2a-0", "cmpl-4f2a-0-r2", "chatcmpl-1-3"):
        req = SimpleNamespace(request_id=sent, external_req_id=None)
        InputProcessor.assign_request_id(req)  # what vLLM does to every request it is given
        assert req.request_id != sent
        assert external_request_id(req.request_id) == sent
    assert external_request_id("cmpl-4f2a-0-r2", randomized=False) == "cmpl-4f2a-0-r2"
