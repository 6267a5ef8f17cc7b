"""The batch gate: batch lines take the engines' places online requests leave free."""

from __future__ import annotations

import asyncio

from dlora.batch.gate import BatchGate, batch_room


def test_each_online_request_takes_one_batch_place():
    assert batch_room(limit=8, online_in_flight=0, batch_in_flight=0) == 8
    assert batch_room(limit=8, online_in_flight=3, batch_in_flight=2) == 3
    assert batch_room(limit=8, online_in_flight=10, batch_in_flight=0) == 0
    assert batch_room(limit=8, online_in_flight=0, batch_in_flight=8) == 0


def test_acquire_waits_for_online_load_to_fall_and_gives_up_when_told():
    online = [2]
    gate = BatchGate(lambda: 2, lambda: online[0])

    async def run():
        waiting = asyncio.ensure_future(gate.acquire())
        await asyncio.sleep(0.2)
        assert not waiting.done() and gate.in_flight == 0
        online[0] = 1
        assert await asyncio.wait_for(waiting, 1.0) is True
        assert gate.in_flight == 1
        stop = [False]
        blocked = asyncio.ensure_future(gate.acquire(lambda: stop[0]))
        await asyncio.sleep(0.1)
        stop[0] = True
        assert await asyncio.wait_for(blocked, 1.0) is False
        assert gate.in_flight == 1
        gate.release()
        assert gate.in_flight == 0

    asyncio.run(run())
