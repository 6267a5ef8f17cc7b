"""Tile sizes for the Triton kernels that fit a GPU's shared memory, at any LoRA rank.

Triton pipelines each `tl.dot` loop `num_stages` deep: every stage holds one tile of each operand
in shared memory, and the fp32 result tile is staged there once more for the store. A
compile whose estimate exceeds the device's per-block limit fails with `OutOfResources` at the
first launch, which on a serving replica means a failed merge or a failed step. So the rank axis
is tiled (BLOCK_R at most 64; the shrink runs one program per rank tile, expand and merge loop
over rank tiles) and the largest token/feature tiles and stage counts whose estimate fits are
picked, with a margin for what the estimate leaves out (layout conversions, swizzle padding).
Pure arithmetic: no triton or CUDA needed, so it is tested on any machine.

Estimated bytes, per kernel (e = operand element size; merge operands are fp32):
    SGMV shrink  stages * (BM*BK + BK*BR) * e  +  BM*BR*4
    SGMV expand  stages * (BM*BR + BR*BN) * e  +  BM*BN*4
    merge        stages * (BM*BR + BR*BN) * 4  +  BM*BN*4
The BGMV kernels use no `tl.dot`; their [BR, BK] / [BR, BN] fp32 products live in registers, so
their tiles are capped at BGMV_MAX_ELEMENTS (64 fp32 registers a thread at 4 warps).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

MAX_BLOCK_R = 64
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
SMEM_MARGIN = 0.85  # use at most this share of the device's limit
NUM_WARPS = 4
BGMV_MAX_ELEMENTS = 64 * 32 * NUM_WARPS
# (rows, cols) tiles from the most to the least efficient; stages tried 3 then 2 for each before a
# smaller tile, and a single stage only when no tile fits pipelined.
TILES = ((64, 128), (64, 64), (32, 64), (32, 32), (16, 32), (16, 16))
PIPELINED_STAGES = (3, 2)


@dataclass(frozen=True)
class DotBlocks:
    """One `tl.dot` kernel's launch: rows x cols tile (BM x BK for shrink, BM x BN otherwise)."""

    block_m: int
    block_n: int
    block_r: int
    num_stages: int
    num_warps: int = NUM_WARPS


@dataclass(frozen=True)
class KernelBlocks:
    shrink: DotBlocks  # block_n is the reduction tile BK
    expand: DotBlocks
    merge: DotBlocks
    bgmv_block_k: int
    bgmv_block_n: int

    @property
    def block_r(self) -> int:
        return self.shrink.block_r


def block_r_for(rank: int) -> int:
    """The rank tile: a power of two >= 16 covering the rank, at most MAX_BLOCK_R (then looped)."""
    p = MIN_BLOCK
    while p < rank and p < MAX_BLOCK_R:
        p *= 2
    return p


def shrink_bytes(bm: int, bk: int, br: int, stages: int, elem: int) -> int:
    return stages * (bm * bk + bk * br) * elem + bm * br * 4


def expand_bytes(bm: int, bn: int, br: int, stages: int, elem: int) -> int:
    return stages * (bm * br + br * bn) * elem + bm * bn * 4


def merge_bytes(bm: int, bn: int, br: int, stages: int) -> int:
    return expand_bytes(bm, bn, br, stages, 4)


def choose_blocks(rank: int, dtype: torch.dtype, smem_bytes: int) -> KernelBlocks | None:
    """Launch sizes for adapters up to `rank` in `dtype` on a device with `smem_bytes` of shared
    memory per block; None if not even the smallest tiles fit (use the torch path instead)."""
    elem = torch.empty((), dtype=dtype).element_size()
    br = block_r_for(rank)
    limit = int(smem_bytes * SMEM_MARGIN)
    shrink = _first_fit(lambda m, n, s: shrink_bytes(m, n, br, s, elem), br, limit)
    expand = _first_fit(lambda m, n, s: expand_bytes(m, n, br, s, elem), br, limit)
    merge = _first_fit(lambda m, n, s: merge_bytes(m, n, br, s), br, limit)
    if shrink is None or expand is None or merge is None:
        return None
    bgmv = max(MIN_BLOCK, min(128, BGMV_MAX_ELEMENTS // br))
    return KernelBlocks(shrink, expand, merge, bgmv_block_k=bgmv, bgmv_block_n=bgmv)


def _first_fit(size, br: int, limit: int) -> DotBlocks | None:
    for stages_choice in (PIPELINED_STAGES, (1,)):
        for bm, bn in TILES:
            for stages in stages_choice:
                if size(bm, bn, stages) <= limit:
                    return DotBlocks(bm, bn, br, stages)
    return None


def cuda_blocks(device: torch.device, rank: int, dtype: torch.dtype) -> KernelBlocks | None:
    """`choose_blocks` for a CUDA device (None off CUDA: the interpreter has no shared memory and
    keeps its own few-large-blocks defaults). Raises if nothing fits: callers check `fits` first."""
    if device.type != "cuda":
        return None
    blocks = _cuda_blocks(_index(device), block_r_for(rank), dtype)
    if blocks is None:
        raise RuntimeError(f"no Triton tile of rank {rank} in {dtype} fits the shared memory of {device}")
    return blocks


def fits(device: torch.device, rank: int, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels can run adapters up to `rank` in `dtype` on `device`."""
    return device.type != "cuda" or _cuda_blocks(_index(device), block_r_for(rank), dtype) is not None


def device_smem_bytes(index: int) -> int:
    """Shared memory one block may use on CUDA device `index` (the opt-in maximum)."""
    return _smem(index)


@cache
def _cuda_blocks(index: int, block_r: int, dtype: torch.dtype) -> KernelBlocks | None:
    # Keyed by the rank tile, not the rank: all ranks with the same tile share one entry.
    return choose_blocks(block_r, dtype, _smem(index))


@cache
def _smem(index: int) -> int:
    smem = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0)
    if not smem:
        from triton.runtime import driver

        smem = driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(smem)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
