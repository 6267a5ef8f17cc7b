"""The batch gate: batch lines take the engines' places and the completions online requests leave free."""

from __future__ import annotations

import asyncio

from dlora.batch.gate import BatchGate, batch_room, choice_room


def test_each_online_request_takes_one_batch_place():
    assert batch_room(limit=8, online_in_flight=0, batch_choices=0) == 8
    assert batch_room(limit=8, online_in_flight=3, batch_choices=2) == 3
    assert batch_room(limit=8, online_in_flight=10, batch_choices=0) == 0
    assert batch_room(limit=8, online_in_flight=0, batch_choices=8) == 0


def test_each_completion_of_a_line_takes_one_engine_place():
    assert batch_room(limit=8, online_in_flight=0, batch_choices=0, choices=3) == 2
    assert batch_room(limit=8, online_in_flight=2, batch_choices=3, choices=3) == 1
    assert batch_room(limit=8, online_in_flight=3, batch_choices=3, choices=3) == 0
    # Wider than every place: alone, once neither batch nor online work holds any.
    assert batch_room(limit=8, online_in_flight=0, batch_choices=0, choices=256) == 1
    assert batch_room(limit=8, online_in_flight=1, batch_choices=0, choices=256) == 0
    assert batch_room(limit=8, online_in_flight=0, batch_choices=1, choices=256) == 0


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


def test_batch_completions_take_at_most_half_the_limit():
    # server.max_pending_requests = 8: batch work holds at most 4 completions.
    assert batch_room(100, 0, 0, choices=3, max_choices=8) == 1
    assert batch_room(100, 0, 3, choices=3, max_choices=8) == 0
    assert batch_room(100, 0, 0, choices=1, max_choices=8) == 4
    assert batch_room(100, 0, 2, choices=2, max_choices=8) == 1  # to exactly half
    assert batch_room(100, 0, 4, choices=1, max_choices=8) == 0  # at exactly half
    assert batch_room(100, 0, 0, choices=1, max_choices=9) == 4  # half rounds down


def test_batch_completions_fit_only_the_room_online_leaves():
    assert batch_room(100, 1, 0, choices=3, max_choices=8, online_choices=5) == 1  # 5 + 3 = 8
    assert batch_room(100, 1, 0, choices=3, max_choices=8, online_choices=6) == 0
    assert batch_room(100, 1, 1, choices=1, max_choices=8, online_choices=6) == 1
    assert batch_room(100, 1, 0, choices=1, max_choices=8, online_choices=8) == 0  # online full
    # Online admission may fill the limit while batch work holds its half: no more batch work starts.
    assert batch_room(100, 1, 4, choices=1, max_choices=8, online_choices=8) == 0


def test_the_engine_places_still_bound_the_lines():
    assert batch_room(2, 0, 2, choices=1, max_choices=100) == 0
    assert batch_room(2, 1, 0, choices=1, max_choices=100, online_choices=1) == 1
    assert batch_room(8, 0, 0, choices=4) == 2  # no completion limit (`dlora batch run`)


def test_a_line_wider_than_half_runs_alone_when_online_leaves_it_room():
    assert choice_room(6, 8, online_choices=0, batch_choices=0) == 1
    assert choice_room(6, 8, online_choices=2, batch_choices=0) == 1
    assert choice_room(6, 8, online_choices=3, batch_choices=0) == 0  # online room too small
    assert choice_room(6, 8, online_choices=0, batch_choices=1) == 0  # other batch work in flight
    assert choice_room(5, 9, online_choices=0, batch_choices=0) == 1  # 5 > 9 // 2
    # Wider than the whole limit: it needs the limit free.
    assert choice_room(20, 8, online_choices=0, batch_choices=0) == 1
    assert choice_room(20, 8, online_choices=1, batch_choices=0) == 0


def test_acquire_counts_completions_and_a_wide_line_is_not_passed_by_narrow_ones():
    online_choices = [0]
    gate = BatchGate(lambda: 100, lambda: 0, lambda: 8, lambda: online_choices[0])

    async def run():
        assert await gate.acquire(choices=2) is True
        assert (gate.in_flight, gate.choices_in_flight) == (1, 2)
        wide = asyncio.ensure_future(gate.acquire(choices=6))
        await asyncio.sleep(0.1)
        narrow = asyncio.ensure_future(gate.acquire(choices=1))  # would fit, but came after the wide one
        await asyncio.sleep(0.2)
        assert not wide.done() and not narrow.done()
        online_choices[0] = 3
        gate.release(2)
        await asyncio.sleep(0.2)
        assert not wide.done() and not narrow.done()  # 3 online + 6 > 8
        online_choices[0] = 2
        assert await asyncio.wait_for(wide, 1.0) is True
        assert (gate.in_flight, gate.choices_in_flight) == (1, 6)
        await asyncio.sleep(0.1)
        assert not narrow.done()  # the wide line runs alone
        gate.release(6)
        assert await asyncio.wait_for(narrow, 1.0) is True
        assert (gate.in_flight, gate.choices_in_flight) == (1, 1)
        gate.release(1)
        assert (gate.in_flight, gate.choices_in_flight) == (0, 0)

    asyncio.run(run())
