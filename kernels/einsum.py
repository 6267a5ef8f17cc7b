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

The one-hot form's price is every token times every packed adapter: with high ranks, many packed
adapters or long prefills those wasted multiply-adds outweigh per-op dispatch, and `add_lora_einsum`
runs the same update as one pair of GEMMs per adapter present instead (the grouped form, as the
reference computes it, on the tokens of that adapter only): when the one-hot form's extra
multiply-adds exceed what the grouped form adds (`grouped_is_cheaper`). On SmolLM2-135M's q_proj
with 8 packed rank-64 adapters, a 256-token prefill costs the one-hot form 8x its own multiply-adds.

The two contractions are plain GEMMs once the axes are packed, so they are written as matmuls
(torch.einsum adds ~10% dispatch overhead at these sizes), or go through the PackedLoRA's prebuilt
`gemm` when it has one (a GEMM with prepacked weights is ~2x torch.matmul at decode sizes). Rows
with index -1 are never read or written. Mask tensors are cached on the batch metadata, so they
are built once per step and per distinct rank layout.
"""

from __future__ import annotations

import torch

from .meta import LoRABatchMeta, PackedLoRA
from .reference import acc_dtype, token_groups

# The grouped form's costs beyond its own GEMMs, in multiply-adds of the one-hot form's GEMMs (~32
# GMAC/s on one CPU core), fitted where the two forms cross over on SmolLM2-135M's projection shapes
# (ranks 8 and 64, 1-8 adapters present, 1-2,048 tokens): each group past the first (two more GEMM
# dispatches, its slices or index tensors) ~50 us, and each element of the rows it gathers from x
# and scatters into y (a group of decode tokens; a segment is a view and costs nothing) ~1.5 ns.
GROUP_CALL_MACS = 1.5e6
COPY_MACS_PER_ELEMENT = 48

Groups = list[tuple[slice | torch.Tensor, int, int]]  # (rows, adapter, token count)


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
    y: torch.Tensor,
    x: torch.Tensor,
    lora: PackedLoRA,
    meta: LoRABatchMeta,
    scale: float = 1.0,
    form: str | None = None,
) -> None:
    """`form`: "onehot" or "grouped" runs that form; None picks the cheaper (`grouped_is_cheaper`)."""
    groups = _groups(meta)
    if form == "grouped" or (form is None and grouped_is_cheaper(groups, lora)):
        _add_lora_grouped(y, x, lora, groups, scale)
        return
    rows = meta.active_rows
    onehot, _ = _onehot_columns(meta, lora)
    xs = x if rows is None else x[rows]
    v_all = _shrink_all(xs, lora)  # "th,jh->tj": [T', R_total]
    v_all = v_all.masked_fill_(~onehot, 0)  # keep own adapter's columns
    _add_rows(y, _expand_all(v_all, lora), rows, scale)  # "tj,jo->to"


def grouped_is_cheaper(groups: Groups, lora: PackedLoRA) -> bool:
    """Whether the one-hot form's multiply-adds spent on other adapters' columns exceed what the
    grouped form adds (a call per group past the first, the rows it gathers and scatters), for this
    batch (`groups`: rows, adapter, token count) and projection."""
    width = lora.in_features + lora.out_features
    live = [(rows, n, count) for rows, n, count in groups if lora.ranks[n] > 0]
    tokens = sum(count for _, _, count in groups)
    wasted = (tokens * lora.ranks_total - sum(count * lora.ranks[n] for _, n, count in live)) * width
    copied = sum(count for rows, _, count in live if not isinstance(rows, slice)) * width
    return bool(live) and wasted > (len(live) - 1) * GROUP_CALL_MACS + copied * COPY_MACS_PER_ELEMENT


def _add_lora_grouped(y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, groups: Groups, scale: float) -> None:
    """y[rows] += scale * (x[rows] @ A_n.T) @ B_n.T for each group, in the weights' dtype like the
    one-hot GEMMs (rows of other adapters and of -1 are never read or written)."""
    offsets = lora.offsets
    for rows, n, _ in groups:
        lo, hi = offsets[n], offsets[n + 1]
        if hi == lo:
            continue
        delta = ((x[rows] @ lora.a[lo:hi].t()) @ lora.b[lo:hi]).to(y.dtype)
        if isinstance(rows, slice):
            y[rows].add_(delta, alpha=scale)
        else:
            y.index_add_(0, rows, delta, alpha=scale)


def _groups(meta: LoRABatchMeta) -> Groups:
    """(rows, adapter, token count) per adapter present, built once per step: its segment (a
    slice) when every adapter has one run of tokens, else its rows (decode tokens of a mixed step
    are one segment each, and a call per segment would cost more than the gather)."""
    if "groups" not in meta.cache:
        pairs = list(token_groups(meta)) if meta.is_segmented else []
        if not pairs or len(pairs) != len({n for _, n in pairs}):
            pairs = list(token_groups(LoRABatchMeta.decode(meta.token_indices)))
        meta.cache["groups"] = [
            (rows, n, rows.stop - rows.start if isinstance(rows, slice) else rows.numel()) for rows, n in pairs
        ]
    return meta.cache["groups"]


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
