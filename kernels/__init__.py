"""dlora_kernels: batched multi-LoRA ops (SGMV/BGMV shrink-expand, one-hot einsum, fused merge).

Public surface: the ops in `ops` plus the layout types in `meta`. Triton kernels are imported
lazily, so importing this package never imports triton.
"""

from .meta import LoRABatchMeta, PackedGemm, PackedLoRA, pack_lora
from .ops import (
    BACKENDS,
    add_lora,
    lora_expand,
    lora_shrink,
    merge_lora_inplace,
    select_backend,
    triton_usable,
)

__all__ = [
    "BACKENDS",
    "LoRABatchMeta",
    "PackedGemm",
    "PackedLoRA",
    "add_lora",
    "lora_expand",
    "lora_shrink",
    "merge_lora_inplace",
    "pack_lora",
    "select_backend",
    "triton_usable",
]
