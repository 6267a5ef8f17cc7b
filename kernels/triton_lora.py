"""Triton SGMV / BGMV shrink and expand on the packed mixed-rank layout (see `meta` for layouts).

Four kernels, Punica style:
    SGMV (segmented, prefill): one program per (segment, BLOCK_M-token tile[, output tile]); the
        tile's tokens share one adapter, so it is a small GEMM with `tl.dot`.
    BGMV (per token, decode):  one program per (token[, output tile]); a GEMV as a `tl.reduce` sum.
Every program reads its adapter's rank r from `rank_offsets` and masks the rank axis with it, so
an adapter of rank 8 in a batch padded to BLOCK_R=64 loads and writes only 8 rank rows. Programs
whose adapter is -1 (or whose token tile lies past its segment) return at once. The rank axis is
tiled in BLOCK_R chunks (shrink: one program per rank tile; expand: a loop over them), so on CUDA
the tiles fit the device's shared memory at any rank (blocks.py); off CUDA one tile spans it.

Shrink may split the H_in reduction over SPLIT_K programs that `tl.atomic_add` their partial sums
(fp32 outputs only); with SPLIT_K=1 it is a plain load-add-store, valid for any dtype.
Accumulation is fp32; fp32 inputs use `input_precision="ieee"` so GPU results match the CPU
interpreter (no TF32). Under the interpreter bf16 dot operands are upcast first (see `_dot_f32`).
The kernels call only builtins (`tl.full`, `tl.reduce`), not triton.language's own jit'd helpers
(`tl.zeros`, `tl.sum`): those are interpreted only if triton itself was imported with
TRITON_INTERPRET=1, which a test run cannot guarantee (peft and vLLM import triton early).
The launchers take CPU tensors when TRITON_INTERPRET=1 was set before this module was imported
(see `ops.triton_usable`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import DotBlocks, cuda_blocks
from .meta import LoRABatchMeta, PackedLoRA

# tl.sum is `tl.reduce(x, axis, _sum_combine)`; calling reduce directly keeps the kernels free of
# triton.language's jit'd helpers (see the module docstring), and the interpreter recognises this
# combine function and sums with numpy instead of calling it element by element.
_sum_combine = tl.standard._sum_combine


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    rank_offsets_ptr,
    seg_starts_ptr,
    seg_adapters_ptr,
    H_in,
    scale,
    stride_xt,
    stride_xh,
    stride_ar,
    stride_ah,
    stride_vt,
    stride_vr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    tile_m = tl.program_id(1)
    pid_k = tl.program_id(2) % SPLIT_K
    r0 = (tl.program_id(2) // SPLIT_K) * BLOCK_R  # this program's rank tile
    adapter = tl.load(seg_adapters_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tile_m * BLOCK_M
    if (adapter < 0) | (row0 >= end):
        return
    r_lo = tl.load(rank_offsets_ptr + adapter)
    rank = tl.load(rank_offsets_ptr + adapter + 1) - r_lo
    if r0 >= rank:
        return
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < end
    r_mask = offs_r < rank
    acc = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)
    for k0 in range(pid_k * BLOCK_K, H_in, BLOCK_K * SPLIT_K):
        k_mask = (k0 + offs_k) < H_in
        x_tile = tl.load(
            x_ptr + offs_m[:, None] * stride_xt + (k0 + offs_k)[None, :] * stride_xh,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BM, BK]
        a_tile = tl.load(
            a_ptr + (r_lo + offs_r)[None, :] * stride_ar + (k0 + offs_k)[:, None] * stride_ah,
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BK, BR] = A_n^T
        if DOT_F32:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc += tl.dot(x_tile, a_tile, input_precision=PRECISION)
    v_ptrs = v_ptr + offs_m[:, None] * stride_vt + offs_r[None, :] * stride_vr
    out_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        old = tl.load(v_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(v_ptrs, (old + scale * acc).to(v_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.atomic_add(v_ptrs, scale * acc, mask=out_mask)


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    rank_offsets_ptr,
    token_indices_ptr,
    H_in,
    scale,
    stride_xt,
    stride_xh,
    stride_ar,
    stride_ah,
    stride_vt,
    stride_vr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    t = tl.program_id(0)
    pid_k = tl.program_id(1) % SPLIT_K
    r0 = (tl.program_id(1) // SPLIT_K) * BLOCK_R  # this program's rank tile
    adapter = tl.load(token_indices_ptr + t)
    if adapter < 0:
        return
    r_lo = tl.load(rank_offsets_ptr + adapter)
    rank = tl.load(rank_offsets_ptr + adapter + 1) - r_lo
    if r0 >= rank:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < rank
    acc = tl.full((BLOCK_R,), 0.0, tl.float32)
    for k0 in range(pid_k * BLOCK_K, H_in, BLOCK_K * SPLIT_K):
        k_mask = (k0 + offs_k) < H_in
        x_vec = tl.load(x_ptr + t * stride_xt + (k0 + offs_k) * stride_xh, mask=k_mask, other=0.0)
        a_tile = tl.load(
            a_ptr + (r_lo + offs_r)[:, None] * stride_ar + (k0 + offs_k)[None, :] * stride_ah,
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BR, BK]
        acc += tl.reduce(a_tile.to(tl.float32) * x_vec.to(tl.float32)[None, :], 1, _sum_combine)
    v_ptrs = v_ptr + t * stride_vt + offs_r * stride_vr
    if SPLIT_K == 1:
        old = tl.load(v_ptrs, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(v_ptrs, (old + scale * acc).to(v_ptr.dtype.element_ty), mask=r_mask)
    else:
        tl.atomic_add(v_ptrs, scale * acc, mask=r_mask)


@triton.jit
def _sgmv_expand_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    rank_offsets_ptr,
    seg_starts_ptr,
    seg_adapters_ptr,
    H_out,
    scale,
    stride_vt,
    stride_vr,
    stride_br,
    stride_bo,
    stride_yt,
    stride_yo,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seg = tl.program_id(0)
    tile_m = tl.program_id(1)
    tile_n = tl.program_id(2)
    adapter = tl.load(seg_adapters_ptr + seg)
    start = tl.load(seg_starts_ptr + seg)
    end = tl.load(seg_starts_ptr + seg + 1)
    row0 = start + tile_m * BLOCK_M
    if (adapter < 0) | (row0 >= end):
        return
    r_lo = tl.load(rank_offsets_ptr + adapter)
    rank = tl.load(rank_offsets_ptr + adapter + 1) - r_lo
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < end
    n_mask = offs_n < H_out
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # rank tiles
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        v_tile = tl.load(
            v_ptr + offs_m[:, None] * stride_vt + offs_r[None, :] * stride_vr,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BM, BR]
        b_tile = tl.load(
            b_ptr + (r_lo + offs_r)[:, None] * stride_br + offs_n[None, :] * stride_bo,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BR, BN] = B_n^T
        v_tile = v_tile.to(b_tile.dtype)  # as vLLM: v in B's dtype
        if DOT_F32:
            v_tile = v_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        acc += tl.dot(v_tile, b_tile, input_precision=PRECISION)  # [BM, BN]
    y_ptrs = y_ptr + offs_m[:, None] * stride_yt + offs_n[None, :] * stride_yo
    out_mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (old + scale * acc).to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _bgmv_expand_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    rank_offsets_ptr,
    token_indices_ptr,
    H_out,
    scale,
    stride_vt,
    stride_vr,
    stride_br,
    stride_bo,
    stride_yt,
    stride_yo,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    tile_n = tl.program_id(1)
    adapter = tl.load(token_indices_ptr + t)
    if adapter < 0:
        return
    r_lo = tl.load(rank_offsets_ptr + adapter)
    rank = tl.load(rank_offsets_ptr + adapter + 1) - r_lo
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H_out
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):  # rank tiles
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        v_vec = tl.load(v_ptr + t * stride_vt + offs_r * stride_vr, mask=r_mask, other=0.0)
        b_tile = tl.load(
            b_ptr + (r_lo + offs_r)[:, None] * stride_br + offs_n[None, :] * stride_bo,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BR, BN]
        acc += tl.reduce(v_vec.to(b_tile.dtype).to(tl.float32)[:, None] * b_tile.to(tl.float32), 0, _sum_combine)
    y_ptrs = y_ptr + t * stride_yt + offs_n * stride_yo
    old = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (old + scale * acc).to(y_ptr.dtype.element_ty), mask=n_mask)


# ----------------------------------------------------------------------------------------------
# Launchers. Block sizes: `None` picks them for the device (on CUDA what fits its shared memory,
# blocks.py); tests pass small ones to exercise tails, rank tiles and multi-step loops.


def lora_shrink_triton(
    v: torch.Tensor,
    x: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    *,
    block_m: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    block_r: int | None = None,
) -> None:
    if meta.num_tokens == 0 or lora.max_rank == 0:
        return
    cfg = cuda_blocks(x.device, lora.max_rank, x.dtype)
    block_r = block_r or (cfg.block_r if cfg else _block_r(lora.max_rank))
    r_tiles = triton.cdiv(lora.max_rank, block_r)
    if meta.is_segmented:
        block_k = block_k or (cfg.shrink.block_n if cfg else _interp_block(lora.in_features))
    else:
        block_k = block_k or (cfg.bgmv_block_k if cfg else _interp_block(lora.in_features))
    split_k = split_k or _default_split_k(v, meta, lora.in_features, block_k)
    if split_k > 1 and v.dtype != torch.float32:
        raise ValueError("split-K shrink needs an fp32 intermediate (atomic adds)")
    common = (
        lora.in_features,
        float(scale),
        x.stride(0),
        x.stride(1),
        lora.a.stride(0),
        lora.a.stride(1),
        v.stride(0),
        v.stride(1),
    )
    if meta.is_segmented:
        if meta.max_seg_len == 0 or meta.num_segments == 0:
            return
        block_m = block_m or _block_m(meta.max_seg_len, cfg.shrink.block_m if cfg else 64)
        grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, block_m), split_k * r_tiles)
        _sgmv_shrink_kernel[grid](
            x,
            lora.a,
            v,
            lora.rank_offsets,
            meta.seg_starts,
            meta.seg_adapters,
            *common,
            BLOCK_M=block_m,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            SPLIT_K=split_k,
            PRECISION=_precision(x.dtype),
            DOT_F32=_dot_f32(x),
            **_launch(cfg.shrink if cfg else None),
        )
    else:
        _bgmv_shrink_kernel[(meta.num_tokens, split_k * r_tiles)](
            x,
            lora.a,
            v,
            lora.rank_offsets,
            meta.token_indices,
            *common,
            BLOCK_R=block_r,
            BLOCK_K=block_k,
            SPLIT_K=split_k,
        )


def lora_expand_triton(
    y: torch.Tensor,
    v: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_r: int | None = None,
) -> None:
    if meta.num_tokens == 0 or lora.max_rank == 0:
        return
    cfg = cuda_blocks(y.device, lora.max_rank, lora.b.dtype)
    block_r = block_r or (cfg.block_r if cfg else _block_r(lora.max_rank))
    common = (
        lora.out_features,
        float(scale),
        v.stride(0),
        v.stride(1),
        lora.b.stride(0),
        lora.b.stride(1),
        y.stride(0),
        y.stride(1),
    )
    if meta.is_segmented:
        if meta.max_seg_len == 0 or meta.num_segments == 0:
            return
        block_n = block_n or (cfg.expand.block_n if cfg else _interp_block(lora.out_features))
        block_m = block_m or _block_m(meta.max_seg_len, cfg.expand.block_m if cfg else 64)
        grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, block_m), triton.cdiv(lora.out_features, block_n))
        _sgmv_expand_kernel[grid](
            v,
            lora.b,
            y,
            lora.rank_offsets,
            meta.seg_starts,
            meta.seg_adapters,
            *common,
            BLOCK_M=block_m,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            PRECISION=_precision(lora.b.dtype),
            DOT_F32=_dot_f32(lora.b),
            **_launch(cfg.expand if cfg else None),
        )
    else:
        block_n = block_n or (cfg.bgmv_block_n if cfg else _interp_block(lora.out_features))
        _bgmv_expand_kernel[(meta.num_tokens, triton.cdiv(lora.out_features, block_n))](
            v, lora.b, y, lora.rank_offsets, meta.token_indices, *common, BLOCK_R=block_r, BLOCK_N=block_n
        )


def add_lora_triton(
    y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    v = torch.zeros(meta.num_tokens, max(lora.max_rank, 1), dtype=torch.float32, device=x.device)
    lora_shrink_triton(v, x, lora, meta, 1.0)
    lora_expand_triton(y, v, lora, meta, scale)


def _block_r(max_rank: int) -> int:
    """Off CUDA: one rank tile for the whole rank (the interpreter has no shared memory limit)."""
    return max(16, triton.next_power_of_2(max_rank))  # tl.dot needs every dim >= 16


def _block_m(max_seg_len: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(max_seg_len)))


def _interp_block(extent: int) -> int:
    # The interpreter's cost is per program and per op, so it wants few, large blocks.
    return min(1024, max(16, triton.next_power_of_2(extent)))


def _launch(blocks: DotBlocks | None) -> dict:
    """Triton's launch options for a tl.dot kernel on CUDA (its defaults elsewhere)."""
    return {"num_warps": blocks.num_warps, "num_stages": blocks.num_stages} if blocks else {}


def _default_split_k(v: torch.Tensor, meta: LoRABatchMeta, h_in: int, block_k: int) -> int:
    """On CUDA, split the reduction until there are about two programs per SM."""
    if v.device.type != "cuda" or v.dtype != torch.float32:
        return 1
    programs = meta.num_segments if meta.is_segmented else meta.num_tokens
    sms = torch.cuda.get_device_properties(v.device).multi_processor_count
    split = 1
    while programs * split < 2 * sms and block_k * split * 2 <= h_in:
        split *= 2
    return split


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _dot_f32(t: torch.Tensor) -> bool:
    """Upcast bf16 dot operands off-GPU: the interpreter's tl.dot multiplies bf16 bit patterns
    (triton-lang/triton#11584, "we just don't support it yet"). On CUDA the native bf16 dot runs."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"
