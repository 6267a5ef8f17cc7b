"""Triton fused merge: W += sign * scale * B @ A, one [BLOCK_M, BLOCK_N] tile of W per program.

Each program computes its tile of B @ A in registers (looping over the rank in BLOCK_R chunks) and
adds it to W in fp32 before rounding once to W's dtype, so the d x d update is never materialised
and W is read and written exactly once: the op is bound by W's memory traffic. On CUDA the tiles
and pipeline depth are what fits the device's shared memory (blocks.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import cuda_blocks
from .triton_lora import _dot_f32


@triton.jit
def _merge_kernel(
    w_ptr,
    a_ptr,
    b_ptr,
    H_out,
    H_in,
    rank,
    alpha,
    stride_wo,
    stride_wi,
    stride_ar,
    stride_ai,
    stride_bo,
    stride_br,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < H_out
    n_mask = offs_n < H_in
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r_mask = (r0 + offs_r) < rank
        b_tile = tl.load(
            b_ptr + offs_m[:, None] * stride_bo + (r0 + offs_r)[None, :] * stride_br,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BM, BR]
        a_tile = tl.load(
            a_ptr + (r0 + offs_r)[:, None] * stride_ar + offs_n[None, :] * stride_ai,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BR, BN]
        if DOT_F32:
            b_tile = b_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        acc += tl.dot(b_tile, a_tile, input_precision=PRECISION)
    w_ptrs = w_ptr + offs_m[:, None] * stride_wo + offs_n[None, :] * stride_wi
    mask = m_mask[:, None] & n_mask[None, :]
    w = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(w_ptrs, (w + alpha * acc).to(w_ptr.dtype.element_ty), mask=mask)


def merge_lora_inplace_triton(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    sign: int = 1,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    h_out, h_in = w.shape
    rank = a.shape[0]
    if h_out == 0 or h_in == 0 or rank == 0:
        return
    cfg = cuda_blocks(w.device, rank, a.dtype)
    if cfg is not None:
        block_m = block_m or cfg.merge.block_m
        block_n = block_n or cfg.merge.block_n
        block_r, launch = cfg.merge.block_r, {"num_warps": cfg.merge.num_warps, "num_stages": cfg.merge.num_stages}
    else:  # the interpreter: few, large blocks
        block_m = block_m or min(256, max(16, triton.next_power_of_2(h_out)))
        block_n = block_n or min(512, max(16, triton.next_power_of_2(h_in)))
        block_r, launch = min(64, max(16, triton.next_power_of_2(rank))), {}
    grid = (triton.cdiv(h_out, block_m), triton.cdiv(h_in, block_n))
    _merge_kernel[grid](
        w,
        a,
        b,
        h_out,
        h_in,
        rank,
        float(sign) * float(scale),
        w.stride(0),
        w.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        DOT_F32=_dot_f32(a),
        **launch,
    )
