"""Prepacked oneDNN GEMMs for the einsum LoRA kernels on CPU (`dlora_kernels.PackedGemm`).

Runs inside vLLM's worker process, for the punica wrapper (`punica_wrapper.py`): vLLM's own CPU
linears run through oneDNN over prepacked weight copies, about 2x torch.matmul at decode sizes, and
the LoRA shrink and expand do the same when vLLM's build has oneDNN.
"""

from __future__ import annotations

import functools

import torch

from dlora_kernels import PackedLoRA


class OneDnnGemm:
    """x @ a.T and v @ b (PackedGemm) through vLLM's oneDNN matmul with prepacked weight copies."""

    def __init__(self, lora: PackedLoRA):
        from vllm import _custom_ops as ops

        self._mm = ops.onednn_mm
        self._a = ops.create_onednn_mm(lora.a.t(), 32)  # weight [K, N]; 32 cached M sizes, as vLLM
        self._b = ops.create_onednn_mm(lora.b, 32)

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(self._a, x, None)

    def expand(self, v: torch.Tensor) -> torch.Tensor:
        return self._mm(self._b, v, None)


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """vLLM's build has oneDNN's matmul (CPU builds with it only)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return False
    return bool(getattr(ops, "_supports_onednn", False))
