"""The one-hot einsum form of batched LoRA (dLoRA), on the packed mixed-rank layout: the CPU path.

Every token is multiplied by *all* adapters' A rows in one GEMM, and a one-hot adapter mask over
the packed rank columns keeps only its own adapter's block:

    M[t, j] = (column_adapter[j] == token_indices[t])       # [T, R_total], one-hot over adapters
    y[t]   += scale * ((x @ a.T) * M)[t] @ b                # "th,jh->tj", mask, "tj,jo->to"

With equal ranks this is exactly the paper's `einsum("th,tn,nrh->tr")` / `einsum("tr,tn,nor->to")`
(see `reference.lora_einsum_onehot`), reshaped so the adapter and rank axes are one packed axis and
each adapter only costs its own rank. It trades N-fold FLOPs (T x R_total x H) for two large GEMMs
instead of one small GEMM per adapter, which wins on CPU where per-op dispatch dominates while a
batch holds few adapters (bench/kernels/ times both forms).

The two contractions are plain GEMMs once the axes are packed, so they are written as matmuls
(torch.einsum adds ~10% dispatch overhead at these sizes), or go through the PackedLoRA's prebuilt
`gemm` when it has one (a GEMM with prepacked weights is ~2x torch.matmul at decode sizes). Rows
with index -1 are never read or written. Mask tensors are cached on the batch metadata, so they
are built once per step and per distinct rank layout.
"""

from __future__ import annotations

import torch

from .meta import LoRABatchMeta, PackedLoRA
from .reference import acc_dtype


def lora_shrink_einsum(
    v: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    rows = meta.active_rows
    cols, valid = _compact_columns(meta, lora)  # [T', R_max]
    xs = x if rows is None else x[rows]
    v_all = _shrink_all(xs, lora)  # "th,jh->tj": all adapters
    picked = v_all.gather(1, cols).to(acc_dtype(v.dtype))  # each token's own block
    r_max = lora.max_rank
    old = v[:, :r_max] if rows is None else v[rows, :r_max]
    new = torch.where(valid, old.to(picked.dtype) + scale * picked, old.to(picked.dtype)).to(v.dtype)
    if rows is None:
        v[:, :r_max] = new
    else:
        v[rows, :r_max] = new


def lora_expand_einsum(
    y: torch.Tensor, v: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    rows = meta.active_rows
    onehot, local = _onehot_columns(meta, lora)  # [T', R_total] each
    vs = v if rows is None else v[rows]
    spread = vs.gather(1, local)  # v[t, j - off(t)], any j
    spread = torch.where(onehot, spread, 0).to(lora.b.dtype)  # one-hot mask (NaN-safe)
    _add_rows(y, _expand_all(spread, lora), rows, scale)  # "tj,jo->to"


def add_lora_einsum(
    y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float = 1.0
) -> None:
    rows = meta.active_rows
    onehot, _ = _onehot_columns(meta, lora)
    xs = x if rows is None else x[rows]
    v_all = _shrink_all(xs, lora)  # "th,jh->tj": [T', R_total]
    v_all = v_all.masked_fill_(~onehot, 0)  # keep own adapter's columns
    _add_rows(y, _expand_all(v_all, lora), rows, scale)  # "tj,jo->to"


def _shrink_all(x: torch.Tensor, lora: PackedLoRA) -> torch.Tensor:
    return x @ lora.a.t() if lora.gemm is None else lora.gemm.shrink(x)


def _expand_all(v: torch.Tensor, lora: PackedLoRA) -> torch.Tensor:
    return v @ lora.b if lora.gemm is None else lora.gemm.expand(v)


def _add_rows(y: torch.Tensor, delta: torch.Tensor, rows: torch.Tensor | None, scale: float) -> None:
    delta = delta.to(y.dtype)
    if rows is None:
        y.add_(delta, alpha=scale)
    else:
        y.index_add_(0, rows, delta, alpha=scale)


def _onehot_columns(meta: LoRABatchMeta, lora: PackedLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(onehot [T', R_total] bool, local [T', R_total] int64 rank index clamped to [0, R_max))."""
    key = ("onehot", lora.ranks)
    if key not in meta.cache:
        idx = _active_indices(meta)
        offsets = lora.rank_offsets.long()[idx.clamp(min=0)]  # [T']
        onehot = lora.column_adapter[None, :] == idx[:, None]
        j = torch.arange(lora.a.shape[0], device=idx.device)
        local = (j[None, :] - offsets[:, None]).clamp(0, max(lora.max_rank - 1, 0))
        meta.cache[key] = (onehot, local)
    return meta.cache[key]


def _compact_columns(meta: LoRABatchMeta, lora: PackedLoRA) -> tuple[torch.Tensor, torch.Tensor]:
    """(cols [T', R_max] packed column of v[t, k], valid [T', R_max] k < r of token t's adapter)."""
    key = ("compact", lora.ranks)
    if key not in meta.cache:
        idx = _active_indices(meta).clamp(min=0)
        offsets = lora.rank_offsets.long()
        ranks = (offsets[1:] - offsets[:-1])[idx]  # [T']
        k = torch.arange(lora.max_rank, device=idx.device)
        valid = k[None, :] < ranks[:, None]
        cols = (offsets[idx][:, None] + k[None, :]).clamp(max=max(lora.a.shape[0] - 1, 0))
        meta.cache[key] = (cols, valid)
    return meta.cache[key]


def _active_indices(meta: LoRABatchMeta) -> torch.Tensor:
    idx = meta.token_indices.long()
    return idx if meta.active_rows is None else idx[meta.active_rows]
