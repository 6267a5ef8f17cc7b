"""Prefix-cache blocks reused only in the weight state they were computed in (pure; no vLLM import).

Runs inside vLLM's EngineCore process. X's blocks carry the same hash merged and unmerged (the
same function, but in bf16 not the same rounding), so `scheduler.py`:
- after every step records the state each newly completed block was computed in (`record_step`,
  into the `PrefixStates` ledger): the state that actually ran (a failed merge ran unmerged;
  unknown weights are `MIXED`, never reused), and a request's blocks carry its lineage, the states
  of every earlier token of it (`prefix_states.combine`);
- wraps vLLM's prefix-cache lookup (`KVCacheManager.get_computed_blocks`) and keeps only the
  leading hit blocks computed in the state this step runs in, taking another cached copy of the
  same hash where vLLM found the wrong one (`usable_hit`). Requests admitted with those hits report
  the reduced `num_cached_tokens`.
Blocks are vLLM's `KVCacheBlock`s as far as read here: `block_id`, `block_hash`, `is_null`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from typing import NamedTuple, Protocol

from dlora.engine_ext import prefix_states
from dlora.engine_ext.prefix_states import MIXED, UNMERGED, PrefixStates, State
from dlora.engine_ext.weight_state import Unknown, Weights


class Block(Protocol):
    @property
    def block_id(self) -> int: ...
    @property
    def block_hash(self) -> Hashable | None: ...
    @property
    def is_null(self) -> bool: ...


class Scheduled(NamedTuple):
    """One request's tokens [start, end) computed by the step, and its preemptions so far."""

    req_id: str
    start: int
    end: int
    num_preemptions: int


Lineages = dict[str, tuple[int, State]]  # request -> (num_preemptions, the state of its prefix)


def state_of(weights: Weights) -> State:
    """The prefix state of blocks computed on `weights` (unknown weights: never reused)."""
    return MIXED if isinstance(weights, Unknown) else (weights or UNMERGED)


def usable_hit(
    groups: Sequence[Sequence[Block]],
    num_tokens: int,
    state: State,
    ledger: PrefixStates,
    current_hash: Callable[[int], Hashable | None],
) -> tuple[list[int], int] | None:
    """What a step in `state` may reuse of vLLM's cache hit (`groups`: its blocks per KV cache
    group, holding `num_tokens`): None for all of it as found, else (the block ids, the tokens they
    hold); ([], 0): nothing. `current_hash(block_id)`: the hash a block holds now."""
    if num_tokens == 0 or (state == UNMERGED and not ledger.any_not_unmerged):
        return None  # nothing but unmerged blocks was ever recorded: vLLM's hit as it is
    hit = groups[0] if len(groups) == 1 else ()
    per_block = num_tokens // len(hit) if hit else 0
    if not hit or num_tokens != len(hit) * per_block:
        # Several KV cache groups (hybrid models) or a sub-block hit: all or nothing.
        if state == UNMERGED and all(
            ledger.state_of(b.block_id, b.block_hash) == UNMERGED for g in groups for b in g if not b.is_null
        ):
            return None
        return [], 0
    keep = ledger.usable_prefix([(b.block_id, b.block_hash) for b in hit], state, current_hash)
    if len(keep) == len(hit) and all(i == b.block_id for i, b in zip(keep, hit)):
        return None
    return keep, len(keep) * per_block


def lineage(before: tuple[int, State] | None, step: Scheduled, planned: Weights, ran: Weights) -> State:
    """The state of a request's prefix through this step's tokens. Tokens before `step.start` either
    ran in earlier steps (`before`, kept per request unless it was preempted since) or were cache
    hits at admission, which matched the step's `planned` state."""
    if before is None or before[0] != step.num_preemptions:  # first step since admission
        prev = state_of(planned) if step.start > 0 else None
    else:
        prev = before[1]
    return prefix_states.combine(prev, state_of(ran))


def completed(blocks: Sequence[Block], step: Scheduled, block_size: int) -> list[Block]:
    """The cached blocks the step's tokens completed: vLLM caches (hashes) a request's full blocks
    up to its computed tokens, so those newly cached are the ones tokens [start, end) completed."""
    done = blocks[step.start // block_size : min(step.end // block_size, len(blocks))]
    return [b for b in done if b.block_hash is not None and not b.is_null]


def record_step(
    ledger: PrefixStates,
    lineages: Lineages,
    scheduled: Iterable[Scheduled],
    planned: Weights,
    ran: Weights,
    blocks_of: Callable[[str], Iterable[tuple[Sequence[Block], int]]],
) -> None:
    """Record the state of the blocks each scheduled request completed in this step.
    `blocks_of(req_id)`: the request's blocks and their block size, per prefix-cacheable KV group."""
    for step in scheduled:
        state = lineage(lineages.get(step.req_id), step, planned, ran)
        lineages[step.req_id] = (step.num_preemptions, state)
        for blocks, block_size in blocks_of(step.req_id):
            for b in completed(blocks, step, block_size):
                ledger.record(b.block_id, b.block_hash, state)


def prune(lineages: Lineages, live: Collection[str]) -> None:
    """Forget the lineages of requests that are gone."""
    if len(lineages) > len(live):
        for rid in [rid for rid in lineages if rid not in live]:
            del lineages[rid]
