"""Cold adapter loads off the engine step: read and build a LoRA in a thread, insert it between steps.

Runs inside vLLM's worker process.

vLLM's `add_lora` is a utility call that the engine core runs between two steps, and it does the
whole load there: `WorkerLoRAManager._load_adapter` reads the safetensors and builds the LoRA's
tensors, then the LRU manager packs the model into its host cache and gives it a device slot.
Every running stream of the replica waits for the read (hundreds of milliseconds for a large
adapter). dlora splits the load in two:

1. `LoraPrefetcher.start` (the `dlora_prefetch_lora` RPC) runs vLLM's own `_load_adapter` for the
   request in a background thread of this process, then packs the model as the cache would
   (`_create_merged_loras_inplace`: q/k/v and gate/up stacked, the scaling folded into B), and
   returns at once, so the next step is not held up; the host polls `dlora_prefetch_done` with
   small sleeps until the thread finished;
2. vLLM's `add_lora` then calls `_load_adapter`, which is wrapped on the worker's LoRA manager
   instance (`install`): it hands back the prefetched `LoRAModel` when there is one for that
   request (or raises the thread's exception, in the very place vLLM's own read would have raised
   it, so a bad adapter is refused exactly as before) and reads from disk only when nothing was
   prefetched. What is left inside the step is vLLM's insertion into its cache and the copy into
   a device slot; the cache packs the model again, which finds it packed and changes nothing
   (a packed module's parts are gone, its scaling is 1). MoE models are packed by the cache
   alone: their packing reshapes expert tensors and is not safe to repeat.

A second prefetch of an adapter that is loading or loaded and not yet taken reuses the first one:
concurrent loads of one adapter on one replica read it once. Loaded models not taken (a host that
gave up between the two calls) are dropped oldest first beyond `MAX_UNTAKEN`.

Thread safety: `_load_adapter` and the packing only read the managers' configuration (supported
and packed modules, model attributes) and build or change the new model's own CPU tensors, so they
may run beside a step; everything that changes the managers' state (the cache, the slots) stays on
the engine loop in step 2.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

MAX_UNTAKEN = 8  # prefetched adapters kept for an add_lora that has not come yet
_THREADS = 1  # one read at a time: a replica's loads queue, and the step keeps the rest of the CPU


@dataclass(frozen=True)
class _Key:
    lora_int_id: int
    path: str

    @classmethod
    def of(cls, req: LoRARequest) -> _Key:
        return cls(req.lora_int_id, req.lora_path)


class LoraPrefetcher:
    """Background loads of LoRA models, keyed by (int id, path), until `take` hands them over."""

    def __init__(self, load) -> None:
        self._load = load  # vLLM's own `_load_adapter` of the worker's LoRA manager
        self._pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="dlora-lora-prefetch")
        self._lock = threading.Lock()
        self._loads: OrderedDict[_Key, Future] = OrderedDict()

    def start(self, req: LoRARequest) -> bool:
        """Begin loading `req` in the background; False if a load of it is already there."""
        key = _Key.of(req)
        with self._lock:
            if key in self._loads:
                return False
            self._loads[key] = self._pool.submit(self._load, req)
            self._drop_untaken()
        return True

    def done(self, lora_int_id: int) -> bool:
        """True once no load of adapter `lora_int_id` is still running (finished, failed or none)."""
        with self._lock:
            return all(f.done() for k, f in self._loads.items() if k.lora_int_id == lora_int_id)

    def take(self, req: LoRARequest) -> LoRAModel | None:
        """The prefetched model for `req` (waiting for its thread if need be), None if none was
        prefetched; raises what the background load raised."""
        with self._lock:
            fut = self._loads.pop(_Key.of(req), None)
        return None if fut is None else fut.result()

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def _drop_untaken(self) -> None:
        finished = [k for k, f in self._loads.items() if f.done()]
        for key in finished[: max(0, len(self._loads) - MAX_UNTAKEN)]:
            log.info("dropping the prefetched LoRA %d (%s): its add_lora never came", key.lora_int_id, key.path)
            del self._loads[key]


def _packs_ahead(adapter_manager) -> bool:
    """True if the cache's packing of a model may run ahead of it (no MoE layers, see above)."""
    from vllm.lora.layers import FusedMoE3DWithLoRA, FusedMoEWithLoRA

    modules = getattr(adapter_manager, "modules", {})
    return not any(isinstance(m, (FusedMoEWithLoRA, FusedMoE3DWithLoRA)) for m in modules.values())


def install(lora_manager) -> LoraPrefetcher:
    """Wrap `_load_adapter` on the worker's LoRA manager instance (`model_runner.lora_manager`) so
    that it returns prefetched models; idempotent. Returns the manager's prefetcher."""
    existing = getattr(lora_manager, "_dlora_prefetcher", None)
    if existing is not None:
        return existing
    original = lora_manager._load_adapter
    adapter_manager = lora_manager._adapter_manager
    pack = adapter_manager._create_merged_loras_inplace if _packs_ahead(adapter_manager) else None

    def build(lora_request):
        model = original(lora_request)
        if pack is not None:
            pack(model)
        return model

    prefetcher = LoraPrefetcher(build)

    def _load_adapter(lora_request):
        model = prefetcher.take(lora_request)
        return model if model is not None else original(lora_request)

    lora_manager._load_adapter = _load_adapter
    lora_manager._dlora_prefetcher = prefetcher
    return prefetcher
