"""Which prompt prefixes each replica's KV cache probably holds: the router's own record.

Why a record of its own and not vLLM's KV-cache events: an event names a block by vLLM's hash,
which covers the adapter's name and path but not the weight state the block was computed in, and
a block computed while the adapter was unmerged is not reused while it is merged (or the other
way round: `engine_ext/prefix_states.py`). The router already knows, for every request it sends,
the prompt's tokens, the adapter version and the replica's weights at that moment, so it records
that, and models vLLM's eviction: once freed, cached blocks go least recently used first when new
ones are needed, so a replica keeps about its KV capacity's worth of the most recently used blocks.

A prompt is cut into full blocks of the engine's block size (vLLM caches full blocks only); each
block's key chains the previous one's, seeded by the adapter's name and content digest, so a
prefix matches only under the same adapter version and only from the first token. Blocks are
recorded with the weight state they would be computed in: the replica's merged adapter, or ""
for the base weights. `cached_tokens` is then the longest run of leading blocks recorded on the
replica in the state the request would run in there. Pure: no Ray, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's CPU block size: the router's until a replica reports its own, and the replica model's
DEFAULT_BLOCK_TOKENS = 128


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt's full blocks as chained keys: block i's key covers tokens [0, (i + 1) * block_tokens).
    A lookup uses at most `lookup_blocks` of them: vLLM computes at least the prompt's last token,
    so a prompt that ends on a block boundary reuses one block less."""

    keys: tuple[int, ...]
    block_tokens: int
    lookup_blocks: int


def prompt_blocks(token_ids: Sequence[int], adapter: str | None, digest: str, block_tokens: int) -> PromptBlocks:
    """The chained keys of `token_ids`' full blocks under one adapter version (None: the base model)."""
    key = hash(("prefix", adapter, digest))
    keys = []
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        key = hash((key, tuple(token_ids[start : start + block_tokens])))
        keys.append(key)
    return PromptBlocks(tuple(keys), block_tokens, max(0, len(token_ids) - 1) // block_tokens)


class ReplicaPrefixes:
    """One replica's recorded blocks, (key, weight state) -> None, least recently used first,
    bounded by its KV capacity in blocks."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[tuple[int, str], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, blocks: PromptBlocks, state: str) -> int:
        """Leading blocks of the prompt recorded here in `state`."""
        n = 0
        for key in blocks.keys[: blocks.lookup_blocks]:
            if (key, state) not in self._blocks:
                break
            n += 1
        return n

    def record(self, blocks: PromptBlocks, state: str, capacity_blocks: int) -> None:
        """The prompt's blocks were computed (or reused) here in `state`: most recently used now;
        the least recently used go beyond `capacity_blocks`."""
        for key in blocks.keys:
            entry = (key, state)
            self._blocks[entry] = None
            self._blocks.move_to_end(entry)
        while len(self._blocks) > max(0, capacity_blocks):
            self._blocks.popitem(last=False)


class PrefixLocality:
    """Every replica's `ReplicaPrefixes`, by replica id."""

    def __init__(self) -> None:
        self._replicas: dict[int, ReplicaPrefixes] = {}

    def cached_tokens(self, replica_id: int, blocks: PromptBlocks, state: str) -> int:
        """Prompt tokens the replica would probably find in its prefix cache."""
        replica = self._replicas.get(replica_id)
        return 0 if replica is None else replica.cached_blocks(blocks, state) * blocks.block_tokens

    def record(self, replica_id: int, blocks: PromptBlocks, state: str, capacity_tokens: int) -> None:
        capacity = capacity_tokens // blocks.block_tokens
        self._replicas.setdefault(replica_id, ReplicaPrefixes()).record(blocks, state, capacity)

    def forget(self, replica_id: int) -> None:
        """The replica is gone or restarted: its cache with it."""
        self._replicas.pop(replica_id, None)

    def recorded_blocks(self, replica_id: int) -> int:
        replica = self._replicas.get(replica_id)
        return 0 if replica is None else len(replica)


def weight_state(merged_adapter: str | None) -> str:
    """The state a step runs in on a replica with `merged_adapter` (engine_ext/prefix_states.py:
    the merged adapter's name, or "" for the base weights)."""
    return merged_adapter or ""
