"""merge_lora_inplace: W += sign * scale * B @ A on every backend against fp64.

W is a strided view into a sentinel-padded buffer and A, B are views into NaN-padded ones, so a
write outside W, a read outside A or B, or a skipped tile (the row-wise check) fails.
Grid: 3 dtypes x 3 shapes (incl. non-powers of two) x ranks {4, 16, 80} (80 needs two rank steps
of the Triton kernel) x sign, on 3 backends.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlora_kernels import merge_lora_inplace, reference
from tests.kernels.kernels_testlib import (
    DEVICE,
    REL_TOL,
    SENTINEL,
    TRITON_RUNNABLE,
    assert_update_close,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((64, 64), (136, 200), (330, 96))  # (H_out, H_in)
BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNNABLE, reason="no triton")),
    "einsum",
    "reference",
]


def _make(h_out: int, h_in: int, rank: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((h_out + 2, h_in + 5), SENTINEL, dtype=dtype)
    w = buf[1:-1, 2:-3]  # strided view, sentinel all around it
    w.copy_(0.25 * torch.randn(h_out, h_in, generator=gen))  # small W: its rounding stays below tol
    a = _nan_padded(torch.randn(rank, h_in, generator=gen) / math.sqrt(h_in), dtype)
    b = _nan_padded(torch.randn(h_out, rank, generator=gen) / math.sqrt(rank) * math.sqrt(h_in), dtype)
    return buf, w, a, b


def _nan_padded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    pad = torch.full((t.shape[0] + 2, t.shape[1] + 2), float("nan"), dtype=dtype)
    pad[1:-1, 1:-1] = t
    return pad[1:-1, 1:-1]


def _merge_on_device(buf: torch.Tensor, a, b, scale: float, sign: int, **kwargs) -> torch.Tensor:
    buf_d = buf.to(DEVICE)
    merge_lora_inplace(buf_d[1:-1, 2:-3], a.to(DEVICE), b.to(DEVICE), scale, sign, **kwargs)
    return buf_d.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("rank", [4, 16, 80])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_merge(dtype, shape, rank, sign, backend) -> None:
    h_out, h_in = shape
    buf, w, a, b = _make(h_out, h_in, rank, dtype, seed=rank + h_in)
    before = buf.clone()
    expected = buf.double().clone()
    expected[1:-1, 2:-3] += sign * 0.25 * (b.double() @ a.double())
    out = _merge_on_device(buf, a, b, 0.25, sign, backend=backend)
    written = torch.zeros_like(buf, dtype=torch.bool)
    written[1:-1, 2:-3] = True
    assert_update_close(out, expected, before, written, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_then_unmerge_restores(backend: str) -> None:
    buf, w, a, b = _make(136, 200, 16, torch.float32, seed=3)
    original = buf.clone()
    buf = _merge_on_device(buf, a, b, 0.5, 1, backend=backend)
    buf = _merge_on_device(buf, a, b, 0.5, -1, backend=backend)
    inner = (slice(1, -1), slice(2, -3))
    assert (buf[0] == SENTINEL).all() and (buf[:, :2] == SENTINEL).all()
    assert torch.allclose(buf[inner], original[inner], atol=1e-5, rtol=0)


def test_torch_merge_tiles_rows_without_a_full_temporary() -> None:
    """Ragged row tiles give the same result; each addmm_ touches at most rows_per_tile rows."""
    _, w, a, b = _make(67, 40, 8, torch.bfloat16, seed=5)
    expected = w.double() + 0.5 * (b.double() @ a.double())
    shapes: list[tuple[int, ...]] = []
    original_addmm = torch.Tensor.addmm_

    def spy(self, *args, **kwargs):
        shapes.append(tuple(self.shape))
        return original_addmm(self, *args, **kwargs)

    torch.Tensor.addmm_ = spy
    try:
        reference.merge_lora_inplace_ref(w, a, b, 0.5, 1, rows_per_tile=16)
    finally:
        torch.Tensor.addmm_ = original_addmm
    assert shapes == [(16, 40)] * 4 + [(3, 40)]
    err = (w.double() - expected).norm() / (0.5 * b.double() @ a.double()).norm()
    assert err < REL_TOL[torch.bfloat16]


def test_merge_rejects_bad_arguments() -> None:
    w, a, b = torch.zeros(8, 6), torch.zeros(2, 6), torch.zeros(8, 2)
    with pytest.raises(ValueError, match="sign"):
        merge_lora_inplace(w, a, b, 1.0, 2, backend="reference")
    with pytest.raises(ValueError, match="shapes"):
        merge_lora_inplace(w, a.t(), b, 1.0, 1, backend="reference")
