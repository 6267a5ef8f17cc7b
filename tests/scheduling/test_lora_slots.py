"""Batch-slot aging (dlora/scheduling/lora_slots.py) over plain request views."""

from __future__ import annotations

from dlora.scheduling.lora_slots import LoraSlotAging, remaining_work, slot_blocked
from dlora.scheduling.types import RequestView


def req(rid, adapter, t, running, out=0, max_tokens=32):
    return RequestView(rid, adapter, t, 8, 8 + out, out, running, max_tokens)


# a0 and a1 hold both slots of max_loras 2; a0 has 30 tokens left, a1 has 4; c waits since t=1
BUSY = [
    req("a0-1", "a0", 0.0, True, out=2),
    req("a1-1", "a1", 0.0, True, out=28),
    req("c-1", "c", 1.0, False),
    req("a0-2", "a0", 0.5, False),
    req("a1-2", "a1", 0.5, False),
    req("a1-3", "a1", 2.0, False),
    req("base", None, 2.5, True),
    req("a0-3", "a0", 3.0, False),
]


def test_remaining_work_counts_running_requests_to_their_caps():
    assert remaining_work(BUSY, "a0") == 30
    assert remaining_work(BUSY, "a1") == 4
    assert remaining_work(BUSY, "c") == 0  # waiting only


def test_a_request_is_slot_blocked_only_when_other_adapters_hold_every_slot():
    assert slot_blocked(BUSY, 2).req_id == "c-1"
    assert slot_blocked(BUSY, 3) is None  # a slot is free: vLLM admits it
    # the base model takes no slot, and a waiting a0 request fits a0's slot
    assert slot_blocked([v for v in BUSY if v.adapter != "c"], 2) is None


def test_nothing_is_held_back_before_the_wait_reaches_starve_s():
    aging = LoraSlotAging(max_loras=2, starve_s=2.0)
    assert aging.held_back(BUSY, now=2.9) == frozenset()
    assert aging.draining is None and aging.drains == 0


def test_the_adapter_with_least_work_left_is_drained_of_newer_arrivals_only():
    aging = LoraSlotAging(max_loras=2, starve_s=2.0)
    # a1 has 4 tokens left against a0's 30; a1-2 arrived before c-1 and keeps its FCFS turn
    assert aging.held_back(BUSY, now=3.0) == {"a1-3"}
    assert aging.draining == "a1" and aging.drains == 1


def test_the_drained_adapter_stays_until_the_blocked_request_is_admitted():
    aging = LoraSlotAging(max_loras=2, starve_s=2.0)
    aging.held_back(BUSY, now=3.0)
    # a1's request advanced while a0's finished tokens: a0 now has less left, a1 stays drained
    later = [
        req("a0-1", "a0", 0.0, True, out=31),
        req("a1-1", "a1", 0.0, True, out=29),
        *(v for v in BUSY if not v.running),
    ]
    assert aging.held_back(later, now=3.5) == {"a1-3"}
    assert aging.drains == 1
    # a1's last request finished: a slot is free, c-1 is admitted, nothing is held any more
    freed = [v for v in later if v.adapter != "a1" or not v.running]
    assert aging.held_back(freed, now=3.6) == frozenset()
    assert aging.draining is None
    # c runs now; d's starvation starts a new drain, of a0 (1 token left against c's 32)
    after = [
        req("a0-1", "a0", 0.0, True, out=31),
        req("c-1", "c", 1.0, True),
        req("d-1", "d", 3.0, False),
        req("c-2", "c", 4.0, False),
        req("a0-4", "a0", 4.0, False),
    ]
    assert aging.held_back(after, now=5.5) == {"a0-4"}
    assert (aging.draining, aging.drains) == ("a0", 2)
