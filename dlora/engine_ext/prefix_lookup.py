"""vLLM's prefix cache within one weight state: the scheduler's hook on its KV cache manager.

Runs inside vLLM's EngineCore process. With prefix caching on, `DloraScheduler` (`scheduler.py`)
builds one `PrefixLookup` over its `KVCacheManager`, which replaces the manager's
`get_computed_blocks` on that instance (a vLLM seam, `engine_ext/__init__.py`): a cache hit must
come from blocks computed in the weight state the step runs in (`state`, set by the scheduler for
each step). After each step the scheduler has it record the weight state each newly completed
block was computed in. What is kept and recorded is decided by the pure `prefix_filter.py` over
the `PrefixStates` ledger (`prefix_states.py`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request

from dlora.engine_ext import prefix_filter
from dlora.engine_ext.prefix_states import UNMERGED, PrefixStates, State
from dlora.engine_ext.weight_state import Weights


class PrefixLookup:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kvm = kv_cache_manager
        self.ledger = PrefixStates()  # the weight state of the cached KV blocks
        self.state: State = UNMERGED  # the state this step's cache hits must have
        self.lineage: prefix_filter.Lineages = {}
        self._vllm_computed_blocks = kv_cache_manager.get_computed_blocks
        # Replacing the method on the instance is deliberate (hence the ignore).
        kv_cache_manager.get_computed_blocks = self.computed_blocks  # type: ignore[method-assign]

    def computed_blocks(self, request: Request):
        """vLLM's `KVCacheManager.get_computed_blocks`, hits limited to this step's weight state.

        Returns vLLM's (blocks, num_computed_tokens, shared_prefix_boundary). Nothing is ref-counted
        yet (`allocate_slots` touches the blocks the scheduler finally adopts), so a shorter or
        substituted block list is as valid as vLLM's own.
        """
        found = self._vllm_computed_blocks(request)
        blocks, num_tokens, _ = found
        kvm = self.kvm
        pool = kvm.block_pool.blocks
        kept = prefix_filter.usable_hit(
            blocks.blocks, num_tokens, self.state, self.ledger, lambda block_id: pool[block_id].block_hash
        )
        if kept is None:
            return found
        ids, tokens = kept
        if not ids:
            return kvm.empty_kv_cache_blocks, 0, 0
        # A single group has no shared-prefix junction (the boundary is 0).
        return kvm.create_kv_cache_blocks(([pool[i] for i in ids],)), tokens, 0

    def record_step(self, scheduler_output, requests: Mapping[str, Request], planned: Weights, ran: Weights) -> None:
        """The state of every block the step completed (`prefix_filter.record_step`): `planned`
        the weights it was scheduled for, `ran` those it ran on. Called before vLLM frees the
        blocks of the requests that finish in the step."""
        managers = [m for m in self.kvm.coordinator.single_type_managers if m.kv_cache_spec.prefix_cacheable]
        scheduled = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            r = requests.get(rid)
            if r is not None and n > 0:
                end = r.num_computed_tokens
                scheduled.append(prefix_filter.Scheduled(rid, end - n, end, r.num_preemptions))
        prefix_filter.record_step(
            self.ledger,
            self.lineage,
            scheduled,
            planned,
            ran,
            lambda rid: [(m.req_to_blocks.get(rid, ()), m.block_size) for m in managers],
        )

    def prune(self, live: Collection[str]) -> None:
        """Forget the lineages of requests that are gone."""
        prefix_filter.prune(self.lineage, live)
