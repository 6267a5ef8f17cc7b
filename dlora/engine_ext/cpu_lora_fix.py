"""Fix for vLLM 0.32.0's CPU LoRA ops: tokens without an adapter got the last slot's adapter.

Runs inside vLLM's worker process.

vLLM marks a token that uses no adapter with index -1. The GPU (Triton) kernels skip such tokens,
but the torch ops the CPU backend uses (`vllm/lora/ops/torch_ops/lora_ops.py`) gather
`lora_weights[indices]`, and index -1 selects the *last* slot. So in any batch that mixes base-model
requests with adapter requests, the base requests are computed with whichever adapter sits in slot
`max_loras - 1` (seen: every base request in a mixed batch diverged from HF at its first tokens,
while the same request alone was exact; `tests/engine_ext/test_cpu_lora_fix.py` shows it on the ops).

The fix wraps the three gather ops so that rows with index -1 contribute nothing, and installs the
wrappers where the CPU punica wrapper looks them up. It is applied inside the engine process by
importing dlora's worker extension (see `worker.py`); vLLM itself is not modified on disk.
"""

from __future__ import annotations

import functools

import torch

_PATCHED_FLAG = "_dlora_masks_no_lora_rows"


def _no_lora_rows(indices: torch.Tensor, rows: int) -> torch.Tensor | None:
    if indices.shape[0] != rows:
        return None
    mask = indices < 0
    return mask if bool(mask.any()) else None


def mask_shrink(shrink):
    """bgmv_shrink writes x @ A[idx]; rows with idx -1 must be zero."""

    @functools.wraps(shrink)
    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        mask = _no_lora_rows(lora_indices_tensor, output_tensor.shape[0])
        if mask is not None:
            output_tensor[mask] = 0

    setattr(bgmv_shrink, _PATCHED_FLAG, True)
    return bgmv_shrink


def mask_expand(expand):
    """bgmv_expand(_slice) adds (or writes) x @ B[idx]; rows with idx -1 must add nothing."""

    @functools.wraps(expand)
    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        mask = _no_lora_rows(lora_indices_tensor, inputs.shape[0])
        if mask is not None:
            inputs = inputs.masked_fill(mask.unsqueeze(-1), 0)
        expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)

    setattr(bgmv_expand, _PATCHED_FLAG, True)
    return bgmv_expand


def install() -> bool:
    """Patch vLLM's CPU LoRA ops in this process; idempotent. Returns True if it patched now."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops.bgmv_shrink, _PATCHED_FLAG, False):
        return False
    fixed = {
        "bgmv_shrink": mask_shrink(lora_ops.bgmv_shrink),
        "bgmv_expand": mask_expand(lora_ops.bgmv_expand),
        "bgmv_expand_slice": mask_expand(lora_ops.bgmv_expand_slice),
    }
    for name, fn in fixed.items():
        # sgmv_* in lora_ops call these through the module globals; punica_cpu imported them by name.
        setattr(lora_ops, name, fn)
        setattr(punica_cpu, name, fn)
    return True
