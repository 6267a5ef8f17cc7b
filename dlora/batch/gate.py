"""How much batch work may be in the engines now: batch work yields to online traffic.

The engines already admit queued batch requests after online ones (a larger engine priority)
and preempt them first when KV runs short; the gate also keeps batch work from crowding online
work out, by two bounds read at each admission:
  * engine places: batch engine requests (a line's completions) at once up to `limit()`, and each
    online request in flight takes one batch place, so batch requests do not hold the engines'
    running slots while online ones wait for one;
  * completions: a line's completions (prompts x n: each is one engine request) count against the
    server's in-flight limit (`server.max_pending_requests`) beside the online requests' admitted
    ones, and batch work holds at most half of that limit. Online admission counts online
    completions only: batch work cannot be taken back at once and online requests must not wait
    for it, so batch work fills only the room online leaves, and online never gets a 429 for it.
With the server busy online, batch work waits; it resumes as online load falls. Lines start in the
order they asked for a place, so a wide line is not passed forever by narrower ones.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from dlora.waits import wait_event

POLL_S = 0.05  # how often a waiting batch request looks at the online load again


def batch_room(
    limit: int,
    online_in_flight: int,
    batch_choices: int,
    choices: int = 1,
    max_choices: int | None = None,
    online_choices: int = 0,
) -> int:
    """How many more batch lines of `choices` completions each may start, with `batch_choices`
    batch completions in flight: the engine places left (`limit` less the online and batch engine
    requests in flight; each completion is one engine request) and, with a completion limit
    `max_choices`, the lines that fit `choice_room`."""
    places = fitting(choices, limit, limit, batch_choices, limit - online_in_flight - batch_choices)
    if max_choices is None:
        return places
    return min(places, choice_room(choices, max_choices, online_choices, batch_choices))


def choice_room(choices: int, max_choices: int, online_choices: int, batch_choices: int) -> int:
    """How many more batch lines of `choices` completions each fit beside `online_choices` and
    `batch_choices` in flight: batch work holds at most half of `max_choices`, and the two together
    at most all of it."""
    free = max_choices - online_choices - batch_choices
    return fitting(choices, max_choices // 2, max_choices, batch_choices, free)


def fitting(choices: int, cap: int, whole: int, held: int, free: int) -> int:
    """Lines of `choices` completions each that may start where batch work may hold `cap` of a
    `whole`, holds `held`, and `free` is left beside all the work in flight. A line wider than `cap`
    (a fan-out the per-request cap allows) runs alone, once no other batch work is in flight and
    `free` holds it (the whole, when it is wider still), so it never waits forever."""
    if choices > cap:
        return int(held == 0 and min(choices, whole) <= free)
    return max(0, min(cap - held, free) // choices)


class BatchGate:
    """Shared by every running batch. `limit()`, `online()` (online requests in the engines),
    `max_choices()` (the completion limit, None for none) and `online_choices()` (online
    completions admitted) are read at each admission."""

    def __init__(
        self,
        limit: Callable[[], int],
        online: Callable[[], int],
        max_choices: Callable[[], int | None] = lambda: None,
        online_choices: Callable[[], int] = lambda: 0,
    ) -> None:
        self.limit = limit
        self.online = online
        self.max_choices = max_choices
        self.online_choices = online_choices
        self.in_flight = 0  # batch lines
        self.choices_in_flight = 0  # their completions
        self._waiting: deque[object] = deque()  # the acquires waiting, in the order they came
        self._changed = asyncio.Event()

    def room(self, choices: int = 1) -> int:
        """How many more lines of `choices` completions each may start now."""
        return batch_room(
            self.limit(),
            self.online(),
            self.choices_in_flight,
            choices,
            self.max_choices(),
            self.online_choices(),
        )

    async def acquire(self, stop: Callable[[], bool] = lambda: False, choices: int = 1) -> bool:
        """Take a place for a line of `choices` completions once it is first in line and there is
        room; False (and no place) if `stop()` turns true first."""
        turn = object()
        self._waiting.append(turn)
        try:
            while self._waiting[0] is not turn or self.room(choices) < 1:
                if stop():
                    return False
                self._changed.clear()
                await wait_event(self._changed, POLL_S)
            if stop():
                return False
            self.in_flight += 1
            self.choices_in_flight += choices
            return True
        finally:
            self._waiting.remove(turn)
            self._changed.set()  # the next in line looks at once

    def release(self, choices: int = 1) -> None:
        self.in_flight -= 1
        self.choices_in_flight -= choices
        self._changed.set()
