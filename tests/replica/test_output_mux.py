"""The replica's one output stream: every ready delta crosses in one batch, each reaches its own
request, errors arrive as data, and a broken stream fails exactly the requests it carried."""

from __future__ import annotations

import asyncio

import pytest

from dlora.replica.errors import ReplicaFailure, RequestRejected
from dlora.replica.messages import Delta
from dlora.replica.output_mux import OutputDemux, OutputMux, StreamError


def delta(tok: int, finished: bool = False) -> Delta:
    return Delta(token_ids=[tok], text=str(tok), finished=finished)


def test_everything_ready_crosses_in_one_batch_in_order():
    async def main():
        mux = OutputMux()
        batches = mux.batches()
        mux.put("a", delta(1))
        mux.put("b", delta(2))
        mux.put("a", delta(3))
        first = await anext(batches)
        mux.put("b", delta(4, finished=True))
        second = await anext(batches)
        return first, second

    first, second = asyncio.run(main())
    assert [(rid, d.token_ids) for rid, d in first] == [("a", [1]), ("b", [2]), ("a", [3])]
    assert [(rid, d.token_ids, d.finished) for rid, d in second] == [("b", [4], True)]


def test_a_reader_waits_for_items():
    async def main():
        mux = OutputMux()
        batches = mux.batches()
        waiting = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        mux.put("a", delta(1))
        return await asyncio.wait_for(waiting, 1)

    assert [rid for rid, _ in asyncio.run(main())] == ["a"]


def test_a_newer_reader_takes_over_and_the_older_one_ends():
    async def main():
        mux = OutputMux()
        old = mux.batches()
        old_next = asyncio.ensure_future(anext(old))
        await asyncio.sleep(0)
        new = mux.batches()
        new_next = asyncio.ensure_future(anext(new))
        await asyncio.sleep(0)
        mux.put("a", delta(1))
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(old_next, 1)
        return await asyncio.wait_for(new_next, 1)

    assert [rid for rid, _ in asyncio.run(main())] == ["a"]


def test_demux_routes_items_and_drops_those_of_closed_requests():
    async def main():
        demux = OutputDemux()
        qa, qb = demux.open("a"), demux.open("b")
        demux.close("b")
        demux.deliver([("a", delta(1)), ("b", delta(2)), ("gone", delta(3)), ("a", delta(4))])
        return [qa.get_nowait().token_ids, qa.get_nowait().token_ids], qb.qsize(), len(demux)

    got_a, b_size, open_count = asyncio.run(main())
    assert got_a == [[1], [4]]
    assert b_size == 0
    assert open_count == 1


def test_a_failed_stream_fails_only_the_requests_opened_under_it():
    async def main():
        demux = OutputDemux()
        old = demux.open("old")
        demux.epoch += 1  # the stream was replaced
        new = demux.open("new")
        demux.fail_epoch(0, ReplicaFailure("replica 0: stream broke"))
        return old.get_nowait(), new.qsize()

    failure, new_size = asyncio.run(main())
    assert isinstance(failure, ReplicaFailure)
    assert new_size == 0


def test_stream_errors_become_the_router_side_exceptions():
    dead = StreamError("replica_failure", "EngineDeadError: gone").exception(1)
    assert isinstance(dead, ReplicaFailure) and "replica 1" in str(dead)
    bad = StreamError("rejected", "max_tokens must be at least 1", "max_tokens").exception(1)
    assert isinstance(bad, RequestRejected) and bad.param == "max_tokens"
    assert bad.message == "max_tokens must be at least 1"  # no replica-side traceback or prefix
    other = StreamError("error", "RuntimeError: boom").exception(1)
    assert type(other) is RuntimeError and not isinstance(other, ReplicaFailure)
