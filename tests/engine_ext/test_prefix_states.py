"""The prefix-state ledger (pure): which cached blocks a request may reuse in a given weight state."""

from __future__ import annotations

from dlora.engine_ext.prefix_states import MIXED, UNMERGED, PrefixStates, combine

X, Y = "x", "y"


class Pool:
    """Stands in for vLLM's block pool: block id -> the hash it holds now (None: evicted)."""

    def __init__(self, **held):
        self.held = {int(k[1:]): v for k, v in held.items()}

    def __call__(self, block_id):
        return self.held.get(block_id)


def ledger(*records):
    ps = PrefixStates()
    for block_id, block_hash, state in records:
        ps.record(block_id, block_hash, state)
    return ps


def test_all_blocks_in_the_wanted_state_give_the_whole_hit():
    ps = ledger((1, "h0", X), (2, "h1", X), (3, "h2", X))
    pool = Pool(b1="h0", b2="h1", b3="h2")
    assert ps.usable_prefix([(1, "h0"), (2, "h1"), (3, "h2")], X, pool) == [1, 2, 3]
    assert ps.usable_prefix([(1, "h0"), (2, "h1"), (3, "h2")], UNMERGED, pool) == []
    assert ps.usable_prefix([], X, pool) == []


def test_a_mismatch_in_the_middle_ends_the_prefix_there():
    ps = ledger((1, "h0", X), (2, "h1", UNMERGED), (3, "h2", X))
    pool = Pool(b1="h0", b2="h1", b3="h2")
    assert ps.usable_prefix([(1, "h0"), (2, "h1"), (3, "h2")], X, pool) == [1]
    assert ps.usable_prefix([(1, "h0"), (2, "h1"), (3, "h2")], UNMERGED, pool) == []


def test_mixed_blocks_are_never_usable():
    ps = ledger((1, "h0", UNMERGED), (2, "h1", MIXED))
    pool = Pool(b1="h0", b2="h1")
    for state in (UNMERGED, X):
        assert ps.usable_prefix([(1, "h0"), (2, "h1")], state, pool) == ([1] if state == UNMERGED else [])


def test_another_copy_of_the_same_hash_replaces_a_wrong_state_block():
    # vLLM returns the oldest block of a hash (1, computed unmerged); 4 holds the same hash, merged.
    ps = ledger((1, "h0", UNMERGED), (2, "h1", UNMERGED), (4, "h0", X), (5, "h1", X))
    pool = Pool(b1="h0", b2="h1", b4="h0", b5="h1")
    assert ps.usable_prefix([(1, "h0"), (2, "h1")], X, pool) == [4, 5]
    assert ps.usable_prefix([(1, "h0"), (2, "h1")], UNMERGED, pool) == [1, 2]
    assert ps.usable_prefix([(4, "h0"), (2, "h1")], UNMERGED, pool) == [1, 2]
    # A copy that no longer holds the hash (evicted, or reused for another block) is not taken.
    pool.held[5] = None
    assert ps.usable_prefix([(1, "h0"), (2, "h1")], X, pool) == [4]
    pool.held[5] = "other"
    assert ps.usable_prefix([(1, "h0"), (2, "h1")], X, pool) == [4]


def test_unknown_blocks_count_as_unmerged():
    ps = ledger((1, "h0", X))
    pool = Pool(b1="h0", b2="h1")
    # 2 was cached during the step being scheduled (not recorded yet): computed unmerged unless
    # that step is merged, and a merged step only takes recorded merged blocks.
    assert ps.state_of(2, "h1") == UNMERGED
    assert ps.usable_prefix([(2, "h1")], UNMERGED, pool) == [2]
    assert ps.usable_prefix([(1, "h0"), (2, "h1")], X, pool) == [1]
    # A record of another hash is stale (the block was evicted and reused): unknown.
    pool.held[1] = "h9"
    assert ps.state_of(1, "h9") == UNMERGED
    assert ps.usable_prefix([(1, "h9")], X, pool) == []


def test_one_record_per_block_id_overwritten_when_the_block_is_reused():
    ps = ledger((1, "h0", X), (2, "h1", X))
    assert len(ps) == 2 and ps.any_not_unmerged
    ps.record(1, "h5", UNMERGED)  # block 1 evicted, reused for h5
    ps.record(2, "h1", UNMERGED)  # block 2 evicted, recomputed for the same hash unmerged
    assert len(ps) == 2 and not ps.any_not_unmerged
    assert ps.state_of(1, "h0") == UNMERGED and ps.state_of(1, "h5") == UNMERGED
    assert ps.find("h0", X, Pool(b1="h0")) is None  # the reverse index forgot the old hash
    assert ps.find("h1", UNMERGED, Pool(b2="h1")) == 2
    ps.record(2, "h1", MIXED)
    assert ps.any_not_unmerged and ps.state_of(2, "h1") is MIXED
    # bounded by the number of block ids, however many hashes they held
    for i in range(100):
        ps.record(i % 3, f"g{i}", X if i % 2 else UNMERGED)
    assert len(ps) == 3 and sum(len(v) for v in ps._by_hash.values()) == 3


def test_lineage():
    assert combine(None, X) == X
    assert combine(X, X) == X
    assert combine(UNMERGED, UNMERGED) == UNMERGED
    assert combine(UNMERGED, X) is MIXED
    assert combine(X, Y) is MIXED
    assert combine(MIXED, X) is MIXED
    assert combine(MIXED, MIXED) is MIXED
