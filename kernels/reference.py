"""Plain torch references for every op: a loop over segments / adapters, accumulating in fp32.

They are the ground truth of the tests (run on fp64 copies they give the fp64 oracle) and the
`reference` backend of `dlora_kernels.ops`. Each function has the same signature and semantics as
the public op of the same name without the `_ref` suffix; see `dlora_kernels.ops` for the docs.
`merge_lora_inplace_ref` is also the CPU merge path (row-tiled `addmm_`, no d x d temporary).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .meta import LoRABatchMeta, PackedLoRA

MERGE_ROWS_PER_TILE = 256


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64, everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_groups(meta: LoRABatchMeta) -> Iterator[tuple[slice | torch.Tensor, int]]:
    """(rows, adapter) pairs: one per non-empty segment with an adapter (SGMV), else one per
    adapter present (BGMV, rows as an index tensor). Syncs with the device; reference use only."""
    if meta.is_segmented:
        assert meta.seg_starts is not None and meta.seg_adapters is not None
        starts = meta.seg_starts.tolist()
        for s, n in enumerate(meta.seg_adapters.tolist()):
            if n >= 0 and starts[s + 1] > starts[s]:
                yield slice(starts[s], starts[s + 1]), n
        return
    idx = meta.token_indices
    for n in sorted(set(idx.tolist()) - {-1}):
        yield torch.nonzero(idx == n).reshape(-1), n


def lora_shrink_ref(
    v: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    acc = acc_dtype(v.dtype)
    for rows, n in token_groups(meta):
        a_n, _ = lora.adapter(n)  # [r, H_in]
        r = a_n.shape[0]
        delta = x[rows].to(acc) @ a_n.to(acc).t()  # [rows, r]
        v[rows, :r] = (v[rows, :r].to(acc) + scale * delta).to(v.dtype)


def lora_expand_ref(
    y: torch.Tensor, v: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    acc = acc_dtype(y.dtype)
    for rows, n in token_groups(meta):
        _, b_n = lora.adapter(n)  # [H_out, r]
        r = b_n.shape[1]
        delta = v[rows, :r].to(acc) @ b_n.to(acc).t()  # [rows, H_out]
        y[rows] = (y[rows].to(acc) + scale * delta).to(y.dtype)


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0) -> None:
    acc = acc_dtype(y.dtype)
    v = torch.zeros(meta.num_tokens, lora.max_rank, dtype=acc, device=x.device)
    lora_shrink_ref(v, x, lora, meta, 1.0)
    lora_expand_ref(y, v, lora, meta, scale)


def lora_einsum_onehot(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    token_indices: torch.Tensor,
    scale: float = 1.0,
) -> None:
    """The dLoRA paper's form, literally: two batched einsums over a one-hot adapter mask.

    Semantics:
        M[t, n] = 1 if token_indices[t] == n else 0                  # -1 -> all-zero row
        v = einsum("th,tn,nrh->tr", x, M, A)                         # shrink
        y[t] += scale * einsum("tr,tn,nor->to", v, M, B)[t]  for t with token_indices[t] >= 0

    Args:
        y: [T, H_out], updated in place (rows with index -1 untouched).
        x: [T, H_in].
        a_stacked: [N, R, H_in]; mixed ranks are zero-padded to R (`PackedLoRA.stacked()`).
        b_stacked: [N, H_out, R].
        token_indices: [T] int, -1 = no LoRA.
    """
    acc = acc_dtype(y.dtype)
    idx = token_indices.long()
    onehot = torch.nn.functional.one_hot(idx.clamp(min=0), a_stacked.shape[0]).to(acc)
    onehot = onehot * (idx >= 0).to(acc)[:, None]
    v = torch.einsum("th,tn,nrh->tr", x.to(acc), onehot, a_stacked.to(acc))
    delta = torch.einsum("tr,tn,nor->to", v, onehot, b_stacked.to(acc))
    rows = torch.nonzero(idx >= 0).reshape(-1)
    y[rows] = (y[rows].to(acc) + scale * delta[rows]).to(y.dtype)


def merge_lora_inplace_ref(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    sign: int = 1,
    rows_per_tile: int = MERGE_ROWS_PER_TILE,
) -> None:
    """W += sign * scale * B @ A, one block of rows at a time (temporaries: rows_per_tile x H_in)."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    alpha = float(sign) * float(scale)
    acc = acc_dtype(w.dtype)
    a_acc = a.to(acc)
    for lo in range(0, w.shape[0], rows_per_tile):
        hi = min(lo + rows_per_tile, w.shape[0])
        if w.dtype == acc:
            w[lo:hi].addmm_(b[lo:hi].to(acc), a_acc, alpha=alpha)
        else:
            tile = w[lo:hi].to(acc)
            tile.addmm_(b[lo:hi].to(acc), a_acc, alpha=alpha)
            w[lo:hi] = tile.to(w.dtype)
