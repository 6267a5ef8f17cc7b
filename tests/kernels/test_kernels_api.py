"""Layouts, batch metadata, argument checks and backend selection of dlora_kernels."""

from __future__ import annotations

import pytest
import torch

from dlora_kernels import (
    LoRABatchMeta,
    add_lora,
    lora_expand,
    lora_shrink,
    pack_lora,
    select_backend,
    triton_usable,
)
from tests.kernels.kernels_testlib import TRITON_INTERPRETED


def _lora(ranks=(4, 8, 2), h_in=6, h_out=5):
    a = [torch.randn(r, h_in) for r in ranks]
    b = [torch.randn(h_out, r) for r in ranks]
    return pack_lora(a, b), a, b


def test_pack_lora_is_rank_major_without_padding() -> None:
    lora, a, b = _lora()
    assert lora.a.shape == (14, 6) and lora.b.shape == (14, 5)
    assert lora.rank_offsets.tolist() == [0, 4, 12, 14]
    assert lora.max_rank == 8 and lora.num_adapters == 3
    assert lora.column_adapter.tolist() == [0] * 4 + [1] * 8 + [2] * 2
    for n in range(3):
        a_n, b_n = lora.adapter(n)
        assert torch.equal(a_n, a[n]) and torch.equal(b_n, b[n])


def test_stacked_pads_with_zeros() -> None:
    lora, a, b = _lora()
    a_s, b_s = lora.stacked()
    assert a_s.shape == (3, 8, 6) and b_s.shape == (3, 5, 8)
    assert torch.equal(a_s[2, :2], a[2]) and not a_s[2, 2:].any()
    assert torch.equal(b_s[0, :, :4], b[0]) and not b_s[0, :, 4:].any()


def test_pack_lora_rejects_mismatched_ranks() -> None:
    with pytest.raises(ValueError, match="does not match"):
        pack_lora([torch.zeros(4, 6)], [torch.zeros(5, 3)])


def test_prefill_meta_segments() -> None:
    meta = LoRABatchMeta.prefill([2, 0, 3, 1], [1, 0, -1, 2])
    assert meta.is_segmented and meta.num_segments == 4 and meta.max_seg_len == 3
    assert meta.seg_starts.tolist() == [0, 2, 2, 5, 6]
    assert meta.token_indices.tolist() == [1, 1, -1, -1, -1, 2]
    assert meta.active_rows.tolist() == [0, 1, 5]


def test_decode_meta_and_runs() -> None:
    meta = LoRABatchMeta.decode([0, 0, 3, -1])
    assert not meta.is_segmented and meta.num_tokens == 4
    assert LoRABatchMeta.decode([1, 2]).active_rows is None
    runs = LoRABatchMeta.segments_of([0, 0, 3, -1, -1, 3])
    assert runs.seg_adapters.tolist() == [0, 3, -1, 3] and runs.seg_starts.tolist() == [0, 2, 3, 5, 6]


def test_shape_and_dtype_checks() -> None:
    lora, _, _ = _lora()
    meta = LoRABatchMeta.decode([0, 1])
    with pytest.raises(ValueError, match="v has shape"):
        lora_shrink(torch.zeros(2, 4), torch.zeros(2, 6), lora, meta, backend="einsum")
    with pytest.raises(ValueError, match="x has shape"):
        lora_shrink(torch.zeros(2, 8), torch.zeros(3, 6), lora, meta, backend="einsum")
    with pytest.raises(ValueError, match="dtype"):
        add_lora(torch.zeros(2, 5), torch.zeros(2, 6, dtype=torch.float16), lora, meta, backend="einsum")
    with pytest.raises(ValueError, match="y has shape"):
        lora_expand(torch.zeros(2, 4), torch.zeros(2, 8), lora, meta, backend="einsum")


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="unknown"):
        select_backend(cpu, "cutlass")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_usable(cpu)
    assert select_backend(cpu) == "einsum"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select_backend(cpu, "triton")
    if TRITON_INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert select_backend(cpu) == "triton"


def test_auto_backend_runs_and_matches_reference() -> None:
    """backend=None (Triton here, under the interpreter) agrees with the reference loop."""
    lora, _, _ = _lora(ranks=(16, 4), h_in=40, h_out=24)
    meta = LoRABatchMeta.prefill([3, 2, 4], [1, -1, 0])
    x = torch.randn(9, 40)
    y_auto = torch.randn(9, 24)
    y_ref = y_auto.clone()
    add_lora(y_auto, x, lora, meta, 0.5)
    add_lora(y_ref, x, lora, meta, 0.5, backend="reference")
    torch.testing.assert_close(y_auto, y_ref, rtol=1e-5, atol=1e-5)
