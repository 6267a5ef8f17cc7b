"""Zero the LoRA slots no adapter occupies.

Runs inside vLLM's worker process.

vLLM's `remove_lora` (and its LRU deactivation) only forgets which adapter a slot held: the slot's
lora_a/lora_b stacks keep the old weights until another adapter is activated into it. Kernels that
multiply every token by every slot's weights and mask afterwards (dlora's einsum form) then still
read them, and 0 * NaN is NaN, so one bad adapter would outlive its unload and poison every request
of the replica. After an unload the worker zeroes every free slot and drops the LoRA backend's
packed copies of the stacks, so nothing of a removed adapter can reach a later step.
"""

from __future__ import annotations

import math

import torch

# The punica wrapper's caches of packed stacks (punica_wrapper.DloraLinearMixin).
PACKED_CACHES = ("_dlora_pack_cache", "_dlora_calls_cache")


def _manager(runner):
    return runner.lora_manager._adapter_manager


def free_slots(manager) -> list[int]:
    return [i for i, lora_id in enumerate(manager.lora_index_to_id) if lora_id is None]


def device_lora_ids(runner) -> list[int]:
    """Adapter ids that hold a slot now: what the next step can run without copying weights in."""
    return [lora_id for lora_id in _manager(runner).lora_index_to_id if lora_id is not None]


def clear_free_slots(runner) -> list[int]:
    """Zero every free slot of every LoRA module and drop packed copies; return the slots cleared.
    Between steps only (a utility call): a step in flight may read the stacks."""
    manager = _manager(runner)
    free = free_slots(manager)
    # inference_mode: the stacks may be inference tensors, which refuse in-place writes outside it.
    with torch.inference_mode():
        for module in manager.modules.values():
            for index in free:
                module.reset_lora(index)
    for wrapper in manager.punica_wrapper_mapping.values():
        for cache in PACKED_CACHES:
            wrapper.__dict__.pop(cache, None)
    return free


def slot_contents(runner) -> list[dict]:
    """Per slot: the adapter id holding it (None: free) and the largest |weight| any module keeps
    there (0.0: zeroed). For tests and diagnostics."""
    manager = _manager(runner)
    out = []
    for index, lora_id in enumerate(manager.lora_index_to_id):
        peaks = [float(stack[index].abs().max()) for stack in _stacks(manager) if stack.shape[0] > index]
        peak = next((v for v in peaks if math.isnan(v)), max(peaks, default=0.0))  # NaN wins
        out.append({"slot": index, "lora_id": lora_id, "max_abs": peak})
    return out


def _stacks(manager):
    for module in manager.modules.values():
        for name in ("lora_a_stacked", "lora_b_stacked"):
            stacks = getattr(module, name, None)
            if isinstance(stacks, torch.Tensor):  # embedding layers keep one tensor, not a tuple
                stacks = (stacks,)
            yield from (s for s in stacks or () if isinstance(s, torch.Tensor))
