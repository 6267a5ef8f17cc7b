"""The public batched-LoRA ops and their backend dispatch.

Backends, by name:
    "triton"    - kernels in triton_lora.py / triton_merge.py (CUDA, or CPU under TRITON_INTERPRET=1)
    "einsum"    - the one-hot einsum form in einsum.py (the CPU path; merge uses row-tiled addmm_)
    "reference" - the per-segment / per-adapter torch loops in reference.py
`backend=None` picks "triton" when `triton_usable(device)` and "einsum" otherwise. Where no Triton
tile fits a CUDA device's shared memory at the batch's rank (blocks.py), "triton" runs as
"reference" instead, with one log line.

Weights are `PackedLoRA` (mixed ranks packed rank-major, no padding) and the token -> adapter
mapping is a `LoRABatchMeta` built once per step: `LoRABatchMeta.prefill(...)` gives segmented
(SGMV) batches, `LoRABatchMeta.decode(...)` per-token (BGMV) batches. See meta.py for layouts.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from types import ModuleType
from typing import Literal

import torch

from . import blocks, einsum, reference
from .meta import LoRABatchMeta, PackedLoRA

Backend = Literal["triton", "einsum", "reference"]
BACKENDS: tuple[str, ...] = ("triton", "einsum", "reference")
log = logging.getLogger(__name__)


def lora_shrink(
    v: torch.Tensor,
    x: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    *,
    backend: Backend | None = None,
) -> None:
    """Shrink: project each token onto its own adapter's rank-r space, adding into `v`.

    Semantics:
        for t in range(T):
            n = meta.token_indices[t]                 # seg_adapters[s] for t in segment s (SGMV)
            if n == -1: continue                      # v[t] untouched
            r, off = ranks[n], rank_offsets[n]
            v[t, :r] += scale * x[t] @ lora.a[off:off + r].T      # = scale * A_n @ x[t]
            # v[t, r:] untouched

    Args:
        v: [T, >= R_max], updated in place (fp32 recommended; R_max = lora.max_rank).
        x: [T, H_in], same dtype as lora.a.
        lora: packed adapters, a: [R_total, H_in].
        meta: token -> adapter mapping, T = meta.num_tokens.
    """
    _check(meta, lora.a.dtype, x=(x, lora.in_features, False), v=(v, lora.max_rank, True))
    name = _fitting(select_backend(x.device, backend), x.device, lora.max_rank, x.dtype)
    if name == "triton":
        _triton_lora().lora_shrink_triton(v, x, lora, meta, scale)
    elif name == "einsum":
        einsum.lora_shrink_einsum(v, x, lora, meta, scale)
    else:
        reference.lora_shrink_ref(v, x, lora, meta, scale)


def lora_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    *,
    backend: Backend | None = None,
) -> None:
    """Expand: lift each token's rank-r vector back to H_out with its adapter's B, adding into `y`.

    Semantics:
        for t in range(T):
            n = meta.token_indices[t]
            if n == -1: continue                      # y[t] untouched
            r, off = ranks[n], rank_offsets[n]
            y[t] += scale * v[t, :r] @ lora.b[off:off + r]        # = scale * B_n @ v[t, :r]
            # v[t, r:] is never read

    Args:
        y: [T, H_out], updated in place.
        v: [T, >= R_max], e.g. the output of `lora_shrink`.
        lora: packed adapters, b: [R_total, H_out] (B_n transposed).
        meta: token -> adapter mapping.
    """
    _check(meta, lora.b.dtype, v=(v, lora.max_rank, True), y=(y, lora.out_features, False))
    name = _fitting(select_backend(y.device, backend), y.device, lora.max_rank, lora.b.dtype)
    if name == "triton":
        _triton_lora().lora_expand_triton(y, v, lora, meta, scale)
    elif name == "einsum":
        einsum.lora_expand_einsum(y, v, lora, meta, scale)
    else:
        reference.lora_expand_ref(y, v, lora, meta, scale)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    *,
    backend: Backend | None = None,
) -> None:
    """Shrink then expand: the full unmerged LoRA delta of one projection, added into `y`.

    Semantics:
        for t in range(T):
            n = meta.token_indices[t]
            if n == -1: continue
            A_n, B_n = lora.adapter(n)                # [r, H_in], [H_out, r]
            y[t] += scale * B_n @ (A_n @ x[t])

    Args:
        y: [T, H_out], updated in place.
        x: [T, H_in], same dtype as lora.a / lora.b.
    """
    _check(meta, lora.a.dtype, x=(x, lora.in_features, False), y=(y, lora.out_features, False))
    name = _fitting(select_backend(x.device, backend), x.device, lora.max_rank, x.dtype)
    if name == "triton":
        _triton_lora().add_lora_triton(y, x, lora, meta, scale)
    elif name == "einsum":
        einsum.add_lora_einsum(y, x, lora, meta, scale)
    else:
        reference.add_lora_ref(y, x, lora, meta, scale)


def merge_lora_inplace(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, sign: int = 1, *, backend: Backend | None = None
) -> None:
    """Merge (sign=+1) or unmerge (sign=-1) one adapter into a base weight, in place.

    Semantics:
        W += sign * scale * B @ A
    computed tile by tile (rows of W on the torch path, [BM, BN] tiles on Triton) with fp32
    accumulation and one rounding to W's dtype; no [H_out, H_in] temporary is allocated.

    Args:
        w: [H_out, H_in] (any strides), updated in place.
        a: [r, H_in] (PEFT lora_A.weight).
        b: [H_out, r] (PEFT lora_B.weight).
        scale: the LoRA scaling, alpha / r.
        sign: +1 to merge, -1 to unmerge.
    """
    if a.dim() != 2 or b.dim() != 2 or w.shape != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
        raise ValueError(
            f"shapes W {tuple(w.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} do not "
            "satisfy W: [H_out, H_in], A: [r, H_in], B: [H_out, r]"
        )
    if _fitting(select_backend(w.device, backend), w.device, a.shape[0], a.dtype) == "triton":
        if a.dtype != b.dtype:
            raise ValueError("the Triton merge needs A and B of one dtype")
        _triton_merge().merge_lora_inplace_triton(w, a, b, scale, sign)
    else:
        reference.merge_lora_inplace_ref(w, a, b, scale, sign)


def select_backend(device: torch.device, backend: Backend | None = None) -> str:
    if backend is None:
        return "triton" if triton_usable(device) else "einsum"
    if backend not in BACKENDS:
        raise ValueError(f"unknown LoRA kernel backend {backend!r}; choose from {BACKENDS}")
    if backend == "triton" and not triton_usable(device):
        raise RuntimeError(
            f"the triton backend cannot run on {device}: needs CUDA, or "
            "TRITON_INTERPRET=1 set before triton kernels are imported"
        )
    return backend


def _fitting(name: str, device: torch.device, rank: int, dtype: torch.dtype) -> str:
    """`name`, unless it is triton and no tile fits the device's shared memory: then the torch
    reference (slow but correct), said once per device, rank tile and dtype."""
    if name != "triton" or blocks.fits(device, rank, dtype):
        return name
    key = (str(device), blocks.block_r_for(rank), dtype)
    if key not in _fallbacks_logged:
        _fallbacks_logged.add(key)
        log.warning(
            "no Triton LoRA tile of rank %d in %s fits the shared memory of %s: using the torch reference kernels",
            rank,
            dtype,
            device,
        )
    return "reference"


_fallbacks_logged: set[tuple] = set()


def triton_usable(device: torch.device) -> bool:
    """True on CUDA devices, and on CPU when Triton's interpreter is on (TRITON_INTERPRET=1)."""
    if device.type == "cuda":
        return _triton_installed()
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1" and _triton_installed()
    return False


@lru_cache(maxsize=1)
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_lora() -> ModuleType:
    from . import triton_lora

    return triton_lora


def _triton_merge() -> ModuleType:
    from . import triton_merge

    return triton_merge


def _check(meta: LoRABatchMeta, weight_dtype: torch.dtype, **tensors: tuple[torch.Tensor, int, bool]) -> None:
    """Each tensor must be [T, cols] (cols >= the given width when the flag says "at least")."""
    t = meta.num_tokens
    for name, (tensor, width, at_least) in tensors.items():
        ok = tensor.dim() == 2 and tensor.shape[0] == t
        ok = ok and (tensor.shape[1] >= width if at_least else tensor.shape[1] == width)
        if not ok:
            want = f"[{t}, {'>=' if at_least else ''}{width}]"
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {want}")
    x = tensors.get("x")
    if x is not None and x[0].dtype != weight_dtype:
        raise ValueError(f"x dtype {x[0].dtype} differs from the LoRA weights' {weight_dtype}")
