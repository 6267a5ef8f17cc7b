"""wait_event: a loop that waits on an event stops when cancelled, even when the cancellation
arrives in the same loop iteration as the event (asyncio.wait_for on Python 3.11 loses it there,
and the balancer's loop then ran on after the server asked it to stop)."""

from __future__ import annotations

import asyncio

import pytest

from dlora.waits import wait_event


def test_a_cancellation_that_meets_the_event_is_not_lost():
    async def run():
        event = asyncio.Event()
        woken = []

        async def loop():
            while True:
                if await wait_event(event, 10.0):
                    event.clear()
                    woken.append(1)

        for _ in range(50):
            task = asyncio.ensure_future(loop())
            await asyncio.sleep(0)  # the loop is waiting
            event.set()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            assert done, "the cancelled loop kept running"
            with pytest.raises(asyncio.CancelledError):
                task.result()

    asyncio.run(run())


def test_it_says_whether_the_event_came_in_time():
    async def run():
        event = asyncio.Event()
        assert await wait_event(event, 0.01) is False
        event.set()
        assert await wait_event(event, 0.0) is True  # already set: True at once, even with no time left
        assert await wait_event(event, -5) is True

    asyncio.run(run())
