"""Prefix-cache hits by weight state (engine_ext/prefix_filter.py), on stand-ins for vLLM's blocks:
what a lookup keeps of vLLM's hit, and which blocks a step records in which state."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.engine_ext.prefix_filter import Scheduled, completed, lineage, record_step, state_of, usable_hit
from dlora.engine_ext.prefix_states import MIXED, UNMERGED, PrefixStates
from dlora.engine_ext.weight_state import UNKNOWN


@dataclass(frozen=True)
class Block:
    block_id: int
    block_hash: str | None
    is_null: bool = False


def hashes(*blocks: Block):
    held = {b.block_id: b.block_hash for b in blocks}
    return held.get


H = [Block(i, f"h{i}") for i in range(4)]


def test_a_hit_is_kept_whole_while_only_unmerged_blocks_were_ever_recorded():
    ledger = PrefixStates()
    ledger.record(0, "h0", UNMERGED)
    assert usable_hit([H[:3]], 48, UNMERGED, ledger, hashes(*H)) is None
    assert usable_hit([H[:3]], 0, "a0", ledger, hashes(*H)) is None  # no hit: nothing to filter


def test_a_hit_ends_at_the_first_block_of_another_state_unless_a_copy_of_its_hash_was_computed_in_it():
    ledger = PrefixStates()
    for b in H[:3]:
        ledger.record(b.block_id, b.block_hash, "a0")
    ledger.record(1, "h1", UNMERGED)  # block 1 recomputed unmerged
    assert usable_hit([H[:3]], 48, "a0", ledger, hashes(*H)) == ([0], 16)
    copy = Block(9, "h1")
    ledger.record(9, "h1", "a0")  # another cached copy of h1, computed merged
    assert usable_hit([H[:3]], 48, "a0", ledger, hashes(*H, copy)) == ([0, 9, 2], 48)
    assert usable_hit([H[:3]], 48, MIXED, ledger, hashes(*H, copy)) == ([], 0)


def test_several_groups_or_a_partial_block_are_all_or_nothing():
    ledger = PrefixStates()
    ledger.record(0, "h0", "a0")
    two_groups = [H[:2], H[2:4]]
    assert usable_hit(two_groups, 32, UNMERGED, ledger, hashes(*H)) == ([], 0)  # h0 is a0's
    ledger.record(0, "h0", UNMERGED)
    ledger.record(3, "h3", "a1")  # keeps some record not unmerged
    assert usable_hit([H[:2]], 31, UNMERGED, ledger, hashes(*H)) is None  # every block unmerged
    assert usable_hit([H[:2]], 31, "a0", ledger, hashes(*H)) == ([], 0)


def test_a_requests_blocks_carry_its_lineage():
    fresh = Scheduled("r", 0, 32, 0)
    assert lineage(None, fresh, "a0", "a0") == "a0"
    assert lineage(None, fresh, "a0", None) == UNMERGED  # the merge failed: it ran unmerged
    assert lineage(None, fresh, "a0", UNKNOWN) is MIXED
    later = Scheduled("r", 32, 33, 0)
    assert lineage((0, "a0"), later, None, None) is MIXED  # prefix merged, this token unmerged
    assert lineage((1, "a0"), later, None, None) == UNMERGED  # preempted since: its hits matched the plan
    assert state_of(UNKNOWN) is MIXED and state_of(None) == UNMERGED and state_of("a1") == "a1"


def test_a_step_records_the_blocks_its_tokens_completed():
    blocks = [Block(i, f"h{i}") for i in range(3)] + [Block(3, None)]  # block 3 not full yet
    step = Scheduled("r", 10, 50, 0)  # tokens 10..49 with 16-token blocks: blocks 0 (from 10), 1, 2
    assert [b.block_id for b in completed(blocks, step, 16)] == [0, 1, 2]
    assert completed(blocks, Scheduled("r", 16, 20, 0), 16) == []  # completes no block
    ledger, lineages = PrefixStates(), {}
    record_step(ledger, lineages, [step], "a0", "a0", lambda rid: [(blocks, 16)])
    assert [ledger.state_of(i, f"h{i}") for i in range(3)] == ["a0"] * 3 and lineages == {"r": (0, "a0")}
