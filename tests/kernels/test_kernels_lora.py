"""lora_shrink / lora_expand / add_lora on every backend against an fp64 token-by-token oracle.

Grid (24 cases x 3 backends x 3 ops): {sgmv, bgmv} x {fp32, fp16, bf16} x {distinct, uniform,
zipf:1.5, identical}, with SHAPES cycled over each kind's 12 cases: 1-16 adapters, uniform and
mixed ranks 4-64, hidden sizes including non-powers of two (200, 136, 96, 320, 576). SGMV batches
have 8 segments of 0-12 tokens, BGMV batches 32 tokens. Every batch has ~15% of
requests without an adapter (-1) and SGMV batches have empty segments. Buffers are poisoned:
output elements that must stay untouched hold a finite sentinel and must come back bit-identical,
and inputs that must never be read (x rows of -1 tokens, v columns past a token's rank) are NaN.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlora_kernels import LoRABatchMeta, add_lora, einsum, lora_expand, lora_shrink, pack_lora, reference
from tests.kernels.kernels_testlib import (
    DEVICE,
    POPULARITIES,
    TRITON_RUNNABLE,
    Case,
    active_rows_mask,
    assert_update_close,
    build,
    oracle_add_lora,
    oracle_expand,
    oracle_shrink,
    poisoned,
    written_mask,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (num_adapters, ranks, h_in, h_out), cycled through the dtype x popularity combinations.
SHAPES = (
    (4, (8, 16, 4, 64), 200, 136),
    (16, (4, 8, 16, 32, 64, 8, 4, 16, 8, 32, 4, 8, 16, 4, 8, 64), 96, 320),
    (1, (64,), 64, 64),
    (8, (16,) * 8, 576, 192),
    (3, (32, 4, 8), 136, 200),
    (12, (8, 4) * 6, 320, 96),
)
SCALE_SHRINK, SCALE_EXPAND = 0.5, 2.0
NAN = float("nan")


def _cases() -> list[Case]:
    cases = []
    for kind, requests in (("sgmv", 8), ("bgmv", 32)):
        for d, dtype in enumerate(DTYPES):
            for p, popularity in enumerate(POPULARITIES):
                n, ranks, h_in, h_out = SHAPES[(d * len(POPULARITIES) + p) % len(SHAPES)]
                cases.append(
                    Case(kind, dtype, popularity, n, ranks, h_in, h_out, requests, max_seg_len=12, seed=len(cases))
                )
    return cases


CASES = [pytest.param(c, id=c.id) for c in _cases()]
BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNNABLE, reason="no triton")),
    "einsum",
    "reference",
]


def _run(op, out: torch.Tensor, inp: torch.Tensor, lora, meta, scale: float, **kwargs) -> torch.Tensor:
    """Apply `op(out, inp, lora, meta, scale)` on DEVICE and return `out` back on the CPU."""
    out_d = out.to(DEVICE)
    op(out_d, inp.to(DEVICE), lora.to(DEVICE), meta.to(DEVICE), scale, **kwargs)
    return out_d.cpu()


def _inputs_x(case: Case, meta, gen: torch.Generator) -> torch.Tensor:
    return poisoned((meta.num_tokens, case.h_in), case.dtype, active_rows_mask(meta, case.h_in), gen, poison=NAN)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_shrink(case: Case, backend: str) -> None:
    lora, meta, gen = build(case)
    x = _inputs_x(case, meta, gen)
    written = written_mask(lora, meta, lora.max_rank)
    v = poisoned((meta.num_tokens, lora.max_rank), torch.float32, written, gen)
    before = v.clone()
    expected = oracle_shrink(v, x, lora, meta, SCALE_SHRINK)
    v = _run(lora_shrink, v, x, lora, meta, SCALE_SHRINK, backend=backend)
    assert_update_close(v, expected, before, written, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_expand(case: Case, backend: str) -> None:
    lora, meta, gen = build(case)
    v = poisoned(
        (meta.num_tokens, lora.max_rank), torch.float32, written_mask(lora, meta, lora.max_rank), gen, poison=NAN
    )  # never read past rank
    written = active_rows_mask(meta, case.h_out)
    y = poisoned((meta.num_tokens, case.h_out), case.dtype, written, gen)
    before = y.clone()
    expected = oracle_expand(y, v, lora, meta, SCALE_EXPAND)
    y = _run(lora_expand, y, v, lora, meta, SCALE_EXPAND, backend=backend)
    assert_update_close(y, expected, before, written, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_add_lora(case: Case, backend: str) -> None:
    _check_add_lora(case, backend)


RANK_ZERO = [Case(kind, torch.float32, "uniform", 4, (8, 0, 16, 0), 96, 64, 16, seed=5) for kind in ("sgmv", "bgmv")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", RANK_ZERO)
def test_rank_zero_adapters_add_nothing(case: Case, backend: str) -> None:
    """A slot of rank 0 (its adapter does not target this projection): its tokens get no update."""
    _check_add_lora(case, backend)


def test_einsum_runs_the_packed_gemms_it_is_given() -> None:
    """`PackedLoRA.gemm` (e.g. oneDNN with prepacked weights) replaces the einsum's two matmuls."""
    case = Case("bgmv", torch.float32, "uniform", 4, (8, 16, 4, 8), 96, 64, 16, seed=6)
    lora, meta, gen = build(case)
    used = []

    class Fp64Gemm:
        def shrink(self, x):
            used.append("shrink")
            return (x.double() @ lora.a.double().t()).to(x.dtype)

        def expand(self, v):
            used.append("expand")
            return (v.double() @ lora.b.double()).to(v.dtype)

    x = _inputs_x(case, meta, gen)
    written = active_rows_mask(meta, case.h_out)
    y = poisoned((meta.num_tokens, case.h_out), case.dtype, written, gen)
    before = y.clone()
    expected = oracle_add_lora(y, x, lora, meta, SCALE_EXPAND)
    add_lora(y, x, dataclasses.replace(lora, gemm=Fp64Gemm()), meta, SCALE_EXPAND, backend="einsum")
    assert used == ["shrink", "expand"]
    assert_update_close(y, expected, before, written, case.dtype)


def _check_add_lora(case: Case, backend: str | None = None, op=add_lora, **kwargs) -> None:
    if backend is not None:
        kwargs["backend"] = backend
    lora, meta, gen = build(case)
    x = _inputs_x(case, meta, gen)
    written = active_rows_mask(meta, case.h_out)
    y = poisoned((meta.num_tokens, case.h_out), case.dtype, written, gen)
    before = y.clone()
    expected = oracle_add_lora(y, x, lora, meta, SCALE_EXPAND)
    y = _run(op, y, x, lora, meta, SCALE_EXPAND, **kwargs)
    assert_update_close(y, expected, before, written, case.dtype)


@pytest.mark.parametrize("case", [*CASES, *RANK_ZERO])
@pytest.mark.parametrize("form", ["grouped", "onehot"])
def test_add_lora_einsum_forms(case: Case, form: str) -> None:
    """Both forms of the einsum backend on every case, whichever the backend would pick."""
    _check_add_lora(case, op=einsum.add_lora_einsum, form=form)


def test_the_einsum_backend_groups_where_the_one_hot_form_wastes_more_than_the_calls_cost() -> None:
    def choice(tokens: int, adapters_present: int, packed: int, rank: int, h: int = 576) -> bool:
        lora = pack_lora([torch.zeros(rank, h)] * packed, [torch.zeros(h, rank)] * packed)
        meta = LoRABatchMeta.decode([i % adapters_present for i in range(tokens)])
        return einsum.grouped_is_cheaper(einsum._groups(meta), lora)

    # wasted: tokens x (packed - 1) x rank x (576 + 576) multiply-adds; the grouped form adds 1.5M per
    # adapter present past the first and 48 per element of the decode rows it gathers and scatters
    # (tokens x 1152): 16 tokens over 8 adapters, 10.5M + 0.9M = 11.4M; 64 tokens, 10.5M + 3.5M = 14M
    assert not choice(16, 8, 8, 8)  # 16 x 56 x 1152 = 1.0M < 11.4M: one-hot
    assert not choice(16, 8, 8, 64)  # 8.3M < 11.4M: one-hot
    assert choice(64, 8, 8, 64)  # 33M > 14M: grouped
    assert choice(256, 1, 8, 64)  # 256 tokens of one adapter among 8 packed: 132M > 0 + 14.2M
    assert not choice(64, 1, 1, 64)  # nothing wasted with one adapter packed
    meta = LoRABatchMeta.decode([0, 1, 0])
    assert meta.cache == {}
    groups = einsum._groups(meta)  # built on first use, then kept for the step's other layers
    assert einsum._groups(meta) is groups and [(n, count) for _, n, count in groups] == [(0, 2), (1, 1)]


@pytest.mark.parametrize("case", CASES[::3])
def test_paper_einsum_form(case: Case) -> None:
    """The literal dLoRA one-hot einsum on zero-padded stacked weights gives the same update."""
    lora, meta, gen = build(case)
    x = _inputs_x(case, meta, gen)
    written = active_rows_mask(meta, case.h_out)
    y = poisoned((meta.num_tokens, case.h_out), case.dtype, written, gen)
    before = y.clone()
    expected = oracle_add_lora(y, x, lora, meta, SCALE_EXPAND)
    a_stacked, b_stacked = lora.stacked()
    reference.lora_einsum_onehot(y, x.nan_to_num(), a_stacked, b_stacked, meta.token_indices, SCALE_EXPAND)
    assert_update_close(y, expected, before, written, case.dtype)


SMALL_BLOCK_CASES = [
    Case("sgmv", torch.float32, "uniform", 5, (4, 64, 8, 16, 32), 200, 136, 5, max_seg_len=40, seed=7),
    Case("bgmv", torch.float32, "zipf:1.5", 5, (4, 64, 8, 16, 32), 200, 136, 16, seed=8),
    Case("sgmv", torch.bfloat16, "distinct", 3, (8, 32, 4), 72, 100, 4, max_seg_len=20, seed=9),
]


@pytest.mark.skipif(not TRITON_RUNNABLE, reason="no triton")
@pytest.mark.parametrize("block_r", [None, 16])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SMALL_BLOCK_CASES])
def test_triton_small_blocks(case: Case, split_k: int, block_r: int | None) -> None:
    """Small blocks: several K steps with a ragged tail, several token and output tiles per
    segment, split-K shrink with atomic adds (fp32 intermediate), and with block_r=16 the rank
    axis in tiles (up to 4 at rank 64; what CUDA devices get at ranks above 64)."""
    from dlora_kernels.triton_lora import lora_expand_triton, lora_shrink_triton

    lora, meta, gen = build(case)
    x = _inputs_x(case, meta, gen)
    written_v = written_mask(lora, meta, lora.max_rank)
    v = poisoned((meta.num_tokens, lora.max_rank), torch.float32, written_v, gen)
    v_before = v.clone()
    v_expected = oracle_shrink(v, x, lora, meta, SCALE_SHRINK)
    v = _run(
        lora_shrink_triton, v, x, lora, meta, SCALE_SHRINK, block_m=16, block_k=32, split_k=split_k, block_r=block_r
    )
    assert_update_close(v, v_expected, v_before, written_v, case.dtype)

    written_y = active_rows_mask(meta, case.h_out)
    y = poisoned((meta.num_tokens, case.h_out), case.dtype, written_y, gen)
    y_before = y.clone()
    y_expected = oracle_expand(y, v, lora, meta, SCALE_EXPAND)
    y = _run(lora_expand_triton, y, v, lora, meta, SCALE_EXPAND, block_m=16, block_n=32, block_r=block_r)
    assert_update_close(y, y_expected, y_before, written_y, case.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_into_low_precision_buffer(backend: str) -> None:
    """The rank buffer may have the activations' dtype (load, add in fp32, round once)."""
    case = Case("sgmv", torch.float16, "uniform", 4, (8, 16, 4, 64), 200, 136, 6, seed=11)
    lora, meta, gen = build(case)
    x = _inputs_x(case, meta, gen)
    written = written_mask(lora, meta, lora.max_rank)
    v = poisoned((meta.num_tokens, lora.max_rank), torch.float16, written, gen)
    before = v.clone()
    expected = oracle_shrink(v, x, lora, meta, SCALE_SHRINK)
    v = _run(lora_shrink, v, x, lora, meta, SCALE_SHRINK, backend=backend)
    assert_update_close(v, expected, before, written, torch.float16)
