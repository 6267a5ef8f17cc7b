"""The host LoRA cache in bytes: hand-worked sequences of loads, uses, pins and requests in flight."""

from __future__ import annotations

import pytest

from dlora.cluster.host_cache import MIB, AdapterTooLarge, HostCache, HostCacheFull


def test_loads_fit_until_the_budget_then_the_least_recently_used_goes():
    cache = HostCache(budget_bytes=100)
    assert cache.admit(1, 40, pinned=False) == []
    assert cache.admit(2, 30, pinned=False) == []
    assert cache.admit(3, 30, pinned=False) == []  # exactly full: 100 of 100
    assert (cache.used_bytes, cache.free_bytes) == (100, 0)
    # 1 is the oldest use: 10 more bytes evict it alone (40 freed)
    assert cache.admit(4, 10, pinned=False) == [1]
    assert cache.ids() == [2, 3, 4] and cache.used_bytes == 70


def test_a_use_makes_an_adapter_the_most_recent():
    cache = HostCache(budget_bytes=100)
    for aid in (1, 2, 3):
        cache.admit(aid, 30, pinned=False)
    cache.touch(1)  # order now 2, 3, 1
    assert cache.admit(4, 30, pinned=False) == [2]
    assert cache.ids() == [3, 1, 4]
    cache.touch(99)  # not held: nothing happens
    assert cache.ids() == [3, 1, 4]


def test_as_many_victims_as_the_new_adapter_needs_oldest_first():
    cache = HostCache(budget_bytes=100)
    for aid in (1, 2, 3, 4):
        cache.admit(aid, 25, pinned=False)
    assert cache.admit(5, 60, pinned=False) == [1, 2, 3]  # 25, 50 not enough; 75 freed >= 60
    assert cache.ids() == [4, 5] and cache.used_bytes == 85


def test_pinned_adapters_are_never_evicted():
    cache = HostCache(budget_bytes=100)
    cache.admit(1, 50, pinned=True)
    cache.admit(2, 30, pinned=False)
    assert cache.admit(3, 40, pinned=False) == [2]  # 1 is older but pinned
    assert cache.ids() == [1, 3]
    with pytest.raises(HostCacheFull, match="pinned adapters or adapters with requests in flight"):
        cache.admit(4, 60, pinned=False)  # only 3 (40) may go: 10 + 40 < 60
    assert cache.ids() == [1, 3]  # a refused load records nothing and evicts nothing


def test_adapters_with_requests_in_flight_are_never_evicted():
    cache = HostCache(budget_bytes=100)
    for aid in (1, 2, 3):
        cache.admit(aid, 30, pinned=False)
    assert cache.admit(4, 30, pinned=False, in_use={1}) == [2]  # 1 is oldest but busy
    assert cache.ids() == [1, 3, 4]
    with pytest.raises(HostCacheFull):
        cache.admit(5, 30, pinned=False, in_use={1, 3, 4})
    assert cache.admit(5, 30, pinned=False, in_use={1, 4}) == [3]  # once 3's requests ended


def test_an_adapter_larger_than_the_budget_is_refused_with_its_size_and_the_budget():
    cache = HostCache(budget_bytes=MIB // 2)
    with pytest.raises(AdapterTooLarge, match=r"1\.000 MiB.*engine\.max_cpu_lora_mib = 0\.500 MiB"):
        cache.admit(1, MIB, pinned=False)
    with pytest.raises(AdapterTooLarge):
        cache.check_fits(MIB // 2 + 1)
    cache.check_fits(MIB // 2)  # exactly the budget fits an empty cache
    assert len(cache) == 0


def test_vllms_count_bound_evicts_too():
    cache = HostCache(budget_bytes=1000, max_entries=2)
    cache.admit(1, 10, pinned=False)
    cache.admit(2, 10, pinned=False)
    assert cache.admit(3, 10, pinned=False) == [1]  # bytes fit; the count does not
    assert cache.ids() == [2, 3]
    # Nothing may go: the count is vLLM's to enforce then (it evicts by itself, as with no budget)
    assert cache.admit(4, 10, pinned=False, in_use={2, 3}) == []
    assert len(cache) == 3


def test_a_held_adapter_is_admitted_again_as_a_use():
    cache = HostCache(budget_bytes=100)
    cache.admit(1, 60, pinned=False)
    cache.admit(2, 40, pinned=False)
    assert cache.admit(1, 60, pinned=False) == []  # no eviction of itself; now the most recent
    assert cache.ids() == [2, 1]


def test_discard_and_clear_free_their_bytes():
    cache = HostCache(budget_bytes=100)
    cache.admit(1, 60, pinned=True)
    cache.admit(2, 40, pinned=False)
    cache.discard(1)  # unloaded: pinned or not, it leaves
    assert cache.ids() == [2] and cache.free_bytes == 60
    cache.discard(7)  # unknown: nothing happens
    cache.clear()
    assert len(cache) == 0 and cache.free_bytes == 100


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        HostCache(budget_bytes=0)


def test_room_counts_what_admit_could_free():
    cache = HostCache(budget_bytes=100)
    cache.admit(1, 30, pinned=True)
    cache.admit(2, 20, pinned=False)
    cache.admit(3, 10, pinned=False)
    assert cache.room() == 70  # 2 and 3 may be unloaded, 1 is pinned
    assert cache.room(in_use={2}) == 50
    assert cache.room(in_use={2, 3}) == 40 == cache.free_bytes
