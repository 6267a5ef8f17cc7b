"""Inputs shared by every batched-LoRA op: packed mixed-rank weights and per-step batch metadata.

NOTE on the weight layout (mixed ranks without padding):
    N adapters with ranks r_0 .. r_{N-1} for one projection W: [H_out, H_in] are packed row-wise,
    S-LoRA style, so an adapter of rank 8 costs 8 rows whatever the largest rank is:

        rank_offsets: [N+1] int32, rank_offsets[0] = 0, rank_offsets[n+1] - rank_offsets[n] = r_n
        a:            [R_total, H_in]   a[off_n : off_n + r_n]     = A_n         (A_n: [r_n, H_in])
        b:            [R_total, H_out]  b[off_n : off_n + r_n]     = B_n.T       (B_n: [H_out, r_n])

    with R_total = sum(r_n). Both halves are rank-major, so loading adapter n's rows is one contiguous
    slab and adding an adapter appends rows. The adapter's update is  dW_n = B_n @ A_n  (PEFT's
    lora_B.weight @ lora_A.weight); the LoRA scaling (alpha / r) is the `scale` argument of each op.

    The rank-r intermediate `v` between shrink and expand is compact: [T, R_max] with
    R_max = max(r_n); token t with adapter n uses v[t, :r_n] and leaves v[t, r_n:] untouched.

NOTE on the batch metadata (built once per step, outside the layers):
    token_indices [T] int32 gives each token's adapter slot, -1 for "no LoRA" (that token's outputs
    are never touched). A segmented (SGMV, prefill) batch also carries seg_starts [S+1] and
    seg_adapters [S]: tokens seg_starts[s] .. seg_starts[s+1]-1 all use adapter seg_adapters[s]
    (empty segments and segments with adapter -1 are allowed). A decode (BGMV) batch has no
    segments: every token is looked up on its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch


class PackedGemm(Protocol):
    """The two dense GEMMs of the one-hot einsum form over a PackedLoRA's packed weights, prebuilt
    by whoever owns a faster GEMM for fixed weights (dlora's vLLM wrapper: oneDNN with prepacked
    weights, as vLLM runs the base model's linears on CPU)."""

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H_in] @ a.T -> [T, R_total]"""

    def expand(self, v: torch.Tensor) -> torch.Tensor:
        """v [T, R_total] @ b -> [T, H_out]"""


@dataclass(frozen=True, eq=False)
class PackedLoRA:
    """One projection's adapters, packed rank-major (see the module NOTE)."""

    a: torch.Tensor  # [R_total, H_in]
    b: torch.Tensor  # [R_total, H_out]  (each block is B_n transposed)
    rank_offsets: torch.Tensor  # [N+1] int32, on the weights' device
    ranks: tuple[int, ...]  # host copy of r_n, so no op has to sync to size its buffers
    gemm: PackedGemm | None = None  # the einsum backend's GEMMs over a and b (None: torch.matmul)

    def __post_init__(self) -> None:
        if self.a.dim() != 2 or self.b.dim() != 2 or self.a.shape[0] != self.b.shape[0]:
            raise ValueError(f"a {tuple(self.a.shape)} and b {tuple(self.b.shape)} must be [R_total, H]")
        if sum(self.ranks) != self.a.shape[0] or self.rank_offsets.numel() != len(self.ranks) + 1:
            raise ValueError("ranks / rank_offsets do not match the packed rows")

    @property
    def num_adapters(self) -> int:
        return len(self.ranks)

    @property
    def ranks_total(self) -> int:
        """R_total, the packed rank rows (0: no adapter has any, nothing to compute)."""
        return self.a.shape[0]

    @property
    def max_rank(self) -> int:
        return max(self.ranks, default=0)

    @property
    def in_features(self) -> int:
        return self.a.shape[1]

    @property
    def out_features(self) -> int:
        return self.b.shape[1]

    @cached_property
    def column_adapter(self) -> torch.Tensor:
        """[R_total] int64: the adapter slot owning each packed rank row (for one-hot masks)."""
        counts = torch.tensor(self.ranks, dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(self.ranks)), counts).to(self.a.device)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Host copy of rank_offsets: adapter n's rows are offsets[n] .. offsets[n + 1] - 1."""
        return _offsets(self.ranks)

    def adapter(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_n [r_n, H_in], B_n [H_out, r_n]) as views into the packed tensors."""
        lo, hi = self.offsets[n], self.offsets[n + 1]
        return self.a[lo:hi], self.b[lo:hi].t()

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-padded copies A [N, R_max, H_in] and B [N, H_out, R_max] (for einsum/vLLM layouts)."""
        n, r = self.num_adapters, self.max_rank
        a = self.a.new_zeros(n, r, self.in_features)
        b = self.b.new_zeros(n, self.out_features, r)
        for i in range(n):
            a_i, b_i = self.adapter(i)
            a[i, : a_i.shape[0]] = a_i
            b[i, :, : b_i.shape[1]] = b_i
        return a, b

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> PackedLoRA:
        return PackedLoRA(
            self.a.to(device=device, dtype=dtype),
            self.b.to(device=device, dtype=dtype),
            self.rank_offsets.to(device=device),
            self.ranks,
        )


def pack_lora(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor]) -> PackedLoRA:
    """Pack per-adapter A_n [r_n, H_in] and B_n [H_out, r_n] (PEFT shapes) into a PackedLoRA."""
    if len(lora_a) != len(lora_b) or not lora_a:
        raise ValueError("need the same positive number of A and B matrices")
    ranks = tuple(int(a.shape[0]) for a in lora_a)
    for a, b, r in zip(lora_a, lora_b, ranks):
        if b.shape[1] != r:
            raise ValueError(f"B {tuple(b.shape)} does not match A {tuple(a.shape)}")
    offsets = _offsets(ranks)
    device = lora_a[0].device
    return PackedLoRA(
        a=torch.cat(list(lora_a), dim=0).contiguous(),
        b=torch.cat([b.t() for b in lora_b], dim=0).contiguous(),
        rank_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        ranks=ranks,
    )


@dataclass(frozen=True, eq=False)
class LoRABatchMeta:
    """Token -> adapter mapping for one step; build with `decode(...)` or `prefill(...)`."""

    token_indices: torch.Tensor  # [T] int32, -1 = no LoRA
    seg_starts: torch.Tensor | None  # [S+1] int32 (segmented batches only)
    seg_adapters: torch.Tensor | None  # [S] int32   (segmented batches only)
    max_seg_len: int  # longest segment (0 for decode batches)
    active_rows: torch.Tensor | None  # [T_active] int64 rows with an adapter; None if all have one
    # derived per-step tensors (e.g. one-hot masks), keyed by the backend that built them
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.token_indices.numel()

    @property
    def is_segmented(self) -> bool:
        return self.seg_starts is not None

    @property
    def num_segments(self) -> int:
        return 0 if self.seg_adapters is None else self.seg_adapters.numel()

    def to(self, device: torch.device | str) -> LoRABatchMeta:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return LoRABatchMeta(
            self.token_indices.to(device),
            move(self.seg_starts),
            move(self.seg_adapters),
            self.max_seg_len,
            move(self.active_rows),
        )

    @staticmethod
    def decode(token_indices: torch.Tensor | Sequence[int], device: torch.device | str | None = None) -> LoRABatchMeta:
        """Per-token (BGMV) batch: token t uses adapter token_indices[t] (-1 = none)."""
        idx = torch.as_tensor(token_indices, dtype=torch.int32, device=device).reshape(-1)
        return LoRABatchMeta(idx, None, None, 0, _active_rows(idx))

    @staticmethod
    def prefill(
        seg_lens: Sequence[int], seg_adapters: Sequence[int], device: torch.device | str | None = None
    ) -> LoRABatchMeta:
        """Segmented (SGMV) batch: seg_lens[s] consecutive tokens use adapter seg_adapters[s]."""
        if len(seg_lens) != len(seg_adapters) or any(n < 0 for n in seg_lens):
            raise ValueError("seg_lens and seg_adapters must have equal length, lengths >= 0")
        starts = [0]
        for n in seg_lens:
            starts.append(starts[-1] + int(n))
        lens = torch.tensor(list(seg_lens), dtype=torch.long)
        adapters = torch.tensor(list(seg_adapters), dtype=torch.int32)
        idx = torch.repeat_interleave(adapters, lens).to(device)
        return LoRABatchMeta(
            token_indices=idx,
            seg_starts=torch.tensor(starts, dtype=torch.int32, device=device),
            seg_adapters=adapters.to(device),
            max_seg_len=max(seg_lens, default=0),
            active_rows=_active_rows(idx),
        )

    @staticmethod
    def segments_of(token_indices: Sequence[int], device: torch.device | str | None = None) -> LoRABatchMeta:
        """Segmented batch from per-token indices, one segment per run of equal indices."""
        lens: list[int] = []
        adapters: list[int] = []
        for i in token_indices:
            if adapters and adapters[-1] == int(i):
                lens[-1] += 1
            else:
                adapters.append(int(i))
                lens.append(1)
        return LoRABatchMeta.prefill(lens, adapters, device)


def _offsets(ranks: Sequence[int]) -> tuple[int, ...]:
    """Running sum of the ranks from 0: the packed row where each adapter starts, then R_total."""
    return tuple(itertools.accumulate(ranks, initial=0))


def _active_rows(idx: torch.Tensor) -> torch.Tensor | None:
    active = idx >= 0
    if bool(active.all()):
        return None
    return torch.nonzero(active).reshape(-1)
