"""Which weight state each prefix-cached KV block was computed in (pure; no vLLM import).

Runs inside vLLM's EngineCore process.

While adapter X is merged, X's requests run on W + dW with no LoRA applied; unmerged they run on W
with the LoRA term. That is the same function, but not the same floating-point computation, and
vLLM's block hash names the adapter, not the weight state. `DloraScheduler` therefore records, after
every step, the state each newly completed block was computed in, and lets a new request reuse a
cached block only if it was computed in the state the request will run in.

States: `UNMERGED` (""), the merged adapter's name, or `MIXED` (never usable): a block's KV depends
on the KV of every earlier token of the request that computed it, so a block is recorded in state S
only if that whole request prefix was computed in S (its *lineage*), else `MIXED`.

Records are keyed by the physical block id, with the block hash it held when recorded:
- vLLM keeps several cached blocks under one hash (it never deduplicates, see `BlockHashToBlockMap`)
  and its lookup returns the oldest. After X's prompt was computed unmerged and again merged, the
  hash has one block of each state, so a per-hash record cannot tell them apart; per block id it
  can, and `usable_prefix` picks, per hash, a block computed in the wanted state.
- The ledger is bounded by the KV cache's block count (one record per block id), so nothing is
  ever evicted from it; a record whose hash differs from the block's current hash is stale (the
  block was evicted and reused) and ignored.
- A cached block with no valid record counts as `UNMERGED`. Every step's completed blocks are
  recorded right after the step, so an unrecorded block was cached during the step being scheduled
  (vLLM caches a block when it allocates it, and a later request of the same step may hit it).
  In an unmerged step that is exact; in a merged step it only costs a recomputation of blocks that
  another request computes in the same step (never a wrong reuse).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Final


class _Mixed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MIXED"


UNMERGED: Final = ""
MIXED: Final = _Mixed()
State = str | _Mixed


def combine(lineage: State | None, state: State) -> State:
    """The lineage of a request prefix extended by tokens computed in `state` (None: empty prefix)."""
    if lineage is None or lineage == state:
        return state
    return MIXED


class PrefixStates:
    """block id -> (block hash, state), with the reverse index block hash -> {block id: state}."""

    def __init__(self) -> None:
        self._by_block: dict[int, tuple[Hashable, State]] = {}
        self._by_hash: dict[Hashable, dict[int, State]] = {}
        self._num_not_unmerged = 0

    def __len__(self) -> int:
        return len(self._by_block)

    @property
    def any_not_unmerged(self) -> bool:
        """Some record is merged or mixed (else every cached block is usable unmerged)."""
        return self._num_not_unmerged > 0

    def record(self, block_id: int, block_hash: Hashable, state: State) -> None:
        old = self._by_block.get(block_id)
        if old is not None:
            if old == (block_hash, state):
                return
            self._forget(block_id, old)
        self._by_block[block_id] = (block_hash, state)
        self._by_hash.setdefault(block_hash, {})[block_id] = state
        if state != UNMERGED:
            self._num_not_unmerged += 1

    def _forget(self, block_id: int, old: tuple[Hashable, State]) -> None:
        old_hash, old_state = old
        ids = self._by_hash[old_hash]
        del ids[block_id]
        if not ids:
            del self._by_hash[old_hash]
        if old_state != UNMERGED:
            self._num_not_unmerged -= 1

    def state_of(self, block_id: int, block_hash: Hashable) -> State:
        rec = self._by_block.get(block_id)
        if rec is None or rec[0] != block_hash:
            return UNMERGED  # not recorded yet: cached during the current step (module docstring)
        return rec[1]

    def find(self, block_hash: Hashable, state: State, current_hash: Callable[[int], Hashable | None]) -> int | None:
        """A block recorded with `block_hash` in `state` that still holds that hash, if any."""
        for block_id, s in self._by_hash.get(block_hash, {}).items():
            if s == state and current_hash(block_id) == block_hash:
                return block_id
        return None

    def usable_prefix(
        self, hit: Sequence[tuple[int, Hashable]], state: State, current_hash: Callable[[int], Hashable | None]
    ) -> list[int]:
        """The longest prefix of a cache hit that `state` may reuse, as block ids.

        `hit`: (block id, block hash) of the leading cached blocks vLLM found for a request; a block
        not computed in `state` is replaced by another cached block of the same hash that was (vLLM
        found only one of them), and the prefix ends at the first hash with no such block.
        `current_hash(block_id)`: the hash the block holds now (None if evicted).
        """
        out: list[int] = []
        for block_id, block_hash in hit:
            if self.state_of(block_id, block_hash) != state:
                found = self.find(block_hash, state, current_hash)
                if found is None:
                    break
                block_id = found
            out.append(block_id)
        return out
