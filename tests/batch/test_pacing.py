"""Batch bookkeeping waits, while online requests are in flight, three times as long as it worked."""

from __future__ import annotations

from dlora.batch.pacing import MAX_WAIT_S, Pacer


def test_it_waits_only_while_online_requests_are_in_flight():
    now, online = [0.0], [False]
    pacer = Pacer(lambda: online[0], share=0.25, clock=lambda: now[0])
    now[0] = 0.02
    assert pacer.wait_s() == 0.0  # no online request: full speed
    online[0] = True
    now[0] = 0.04
    assert abs(pacer.wait_s() - 0.06) < 1e-9  # 20 ms of work -> 60 ms of waiting: a quarter of the time
    now[0] = 1.04
    assert pacer.wait_s() == MAX_WAIT_S  # a slice that stalled a second does not hold batch work for three


def test_pause_measures_the_next_slice_from_the_end_of_its_wait():
    now = [0.0]
    pacer = Pacer(lambda: True, share=0.5, clock=lambda: now[0])
    now[0] = 0.001
    pacer.pause()  # waits 1 ms (a real sleep), then starts the next slice at the clock's reading
    now[0] = 0.003
    assert abs(pacer.wait_s() - 0.002) < 1e-9


def test_a_step_pauses_once_every_slice_of_items():
    pauses = []
    pacer = Pacer(lambda: False, every=3)
    pacer.pause = lambda: pauses.append(pacer._items)  # type: ignore[method-assign]
    for _ in range(7):
        pacer.step()
    assert pauses == [3, 6]
