"""Triton tile selection against shared memory (pure arithmetic, `dlora_kernels.blocks`)."""

from __future__ import annotations

import logging

import pytest
import torch

from dlora_kernels import blocks, merge_lora_inplace, reference
from dlora_kernels.blocks import (
    MAX_BLOCK_R,
    choose_blocks,
    expand_bytes,
    merge_bytes,
    shrink_bytes,
)

KIB = 1024
DEVICES = {"100KiB (sm86/sm89)": 100 * KIB, "227KiB (H100)": 227 * KIB}
RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # every max_lora_rank vLLM accepts from 8 on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("smem", DEVICES.values(), ids=DEVICES.keys())
def test_chosen_tiles_fit_shared_memory_at_every_rank(smem, rank, dtype):
    elem = torch.empty((), dtype=dtype).element_size()
    cfg = choose_blocks(rank, dtype, smem)
    assert cfg is not None
    s, e, m = cfg.shrink, cfg.expand, cfg.merge
    assert shrink_bytes(s.block_m, s.block_n, s.block_r, s.num_stages, elem) <= smem
    assert expand_bytes(e.block_m, e.block_n, e.block_r, e.num_stages, elem) <= smem
    assert merge_bytes(m.block_m, m.block_n, m.block_r, m.num_stages) <= smem
    for d in (s, e, m):
        assert 16 <= d.block_r <= MAX_BLOCK_R and d.block_m >= 16 and d.block_n >= 16  # tl.dot minimum
        assert d.block_r >= min(rank, MAX_BLOCK_R)  # rank tiles cover the rank (looped past 64)
        assert d.num_stages >= 1 and d.num_warps >= 1
    assert cfg.bgmv_block_k * cfg.block_r <= blocks.BGMV_MAX_ELEMENTS  # the BGMV products fit registers


def test_the_large_device_keeps_big_pipelined_tiles():
    cfg = choose_blocks(512, torch.bfloat16, 227 * KIB)
    assert (cfg.shrink.block_m, cfg.shrink.block_n, cfg.shrink.num_stages) == (64, 128, 3)
    assert cfg.merge.num_stages >= 2
    small = choose_blocks(512, torch.bfloat16, 100 * KIB)
    assert small.shrink.num_stages >= 2 and small.merge.num_stages >= 2  # still pipelined
    assert merge_bytes(small.merge.block_m, small.merge.block_n, 64, small.merge.num_stages) <= 100 * KIB


def test_small_ranks_use_a_small_rank_tile():
    assert choose_blocks(8, torch.bfloat16, 227 * KIB).block_r == 16
    assert choose_blocks(40, torch.bfloat16, 227 * KIB).block_r == 64
    assert choose_blocks(320, torch.bfloat16, 227 * KIB).block_r == 64


def test_nothing_fits_a_tiny_shared_memory():
    assert choose_blocks(8, torch.float32, 2 * KIB) is None
    assert choose_blocks(8, torch.float32, 8 * KIB) is not None


def test_triton_falls_back_to_the_reference_with_one_log_line(monkeypatch, caplog):
    """A CUDA device whose shared memory fits no tile: the merge runs through torch instead."""
    monkeypatch.setattr(blocks, "fits", lambda device, rank, dtype: False)
    monkeypatch.setattr("dlora_kernels.ops.triton_usable", lambda device: True)
    calls = []
    real = reference.merge_lora_inplace_ref
    monkeypatch.setattr(reference, "merge_lora_inplace_ref", lambda *a: calls.append(1) or real(*a))
    w = torch.zeros(32, 48)
    a, b = torch.ones(4, 48), torch.ones(32, 4)
    with caplog.at_level(logging.WARNING, logger="dlora_kernels.ops"):
        merge_lora_inplace(w, a, b, 0.5, backend="triton")
        merge_lora_inplace(w, a, b, 0.5, backend="triton")
    assert calls == [1, 1]
    assert torch.equal(w, torch.full((32, 48), 4.0))  # 2 merges x 0.5 x (B@A = 4)
    assert sum("torch reference" in r.getMessage() for r in caplog.records) == 1
