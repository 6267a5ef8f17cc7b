"""One step's batched-LoRA pass: which adapter slot each token reads, for every LoRA linear of the step.

Runs inside vLLM's worker process, for the punica wrapper (`punica_wrapper.py`), which builds one
pass per step from vLLM's `token_lora_indices` (token -> slot, -1 = no adapter) and shares it
between every LoRA linear. While an adapter is merged into the base weights, the pass maps tokens
to the slots of the compensated stacks instead (`packed_stacks.compensated`; the punica wrapper's
module NOTE on mixed merged steps says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlora_kernels import LoRABatchMeta


@dataclass(frozen=True)
class LoRAPass:
    """The step's batched-LoRA call per LoRA linear: `meta` maps tokens to slots of the stacks as
    they are (`compensate` None), or of the compensated stacks of merged slot `compensate`."""

    meta: LoRABatchMeta
    compensate: int | None = None


def step_pass(idx: torch.Tensor, merged_slot: int | None) -> LoRAPass | None:
    """The step's pass for token slot indices `idx` (-1 = no adapter); None if it would do nothing.

    Merged slot s: s's tokens -> -1 (no LoRA, their delta is in the weights), base tokens -> s
    (which holds -dX in the compensated stacks), every other token keeps its slot (its delta
    minus dX there)."""
    if merged_slot is not None:
        idx = torch.where(idx == merged_slot, -1, torch.where(idx < 0, merged_slot, idx)).to(idx.dtype)
    meta = batch_meta(idx)
    return None if meta is None else LoRAPass(meta, merged_slot)


def batch_meta(idx: torch.Tensor) -> LoRABatchMeta | None:
    """Segmented (SGMV) when some run of tokens shares an adapter, per-token (BGMV) otherwise
    (einsum ignores segments; Triton picks its kernel by it); None when no token has an adapter."""
    if idx.numel() == 0:
        return None
    adapters, lens = torch.unique_consecutive(idx, return_counts=True)
    adapters_l, lens_l = adapters.tolist(), lens.tolist()
    if all(a < 0 for a in adapters_l):
        return None
    if max(lens_l) > 1:
        return LoRABatchMeta.prefill(lens_l, adapters_l, device=idx.device)
    return LoRABatchMeta.decode(idx, device=idx.device)


def head_pass(full: LoRAPass, num_tokens: int) -> LoRAPass | None:
    """`full` for its first `num_tokens` tokens (None: none of them has an adapter). Rows beyond
    the mapping (padding) are not in it: they get no adapter and no compensation."""
    meta = full.meta
    sub = LoRABatchMeta.decode(meta.token_indices[:num_tokens], device=meta.token_indices.device)
    if sub.active_rows is not None and not sub.active_rows.numel():
        return None
    return LoRAPass(sub, full.compensate)
