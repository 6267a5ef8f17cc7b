"""Waiting for an asyncio.Event with a timeout, without losing a cancellation.

On Python 3.11, `asyncio.wait_for(event.wait(), t)` returns normally when the task is cancelled in
the same loop iteration as the event is set: the cancellation is swallowed. A loop that waits that
way (the balancer's, the batch gate's) then never stops, and whoever awaits it at shutdown hangs.
`asyncio.timeout` keeps the two apart.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True when `event` is set within `timeout_s` (at once if it already is), False after it."""
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return False
    return True
