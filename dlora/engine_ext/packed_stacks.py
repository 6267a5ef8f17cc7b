"""vLLM's padded LoRA stacks as dlora's packed mixed-rank layout (`dlora_kernels.PackedLoRA`).

Runs inside vLLM's worker process, for the punica wrapper (`punica_wrapper.py`, whose module NOTEs
explain the layout and the merged-step compensation). vLLM stacks each slice's adapters zero-padded
to max rank R, `lora_a_stacked[i]`: [N, 1, R, H_in], `lora_b_stacked[i]`: [N, 1, H_out, R]; here
each slot's live rank rows are read (`slot_rows`, reusing the rows of slots whose adapter did not
change), joined into one packed adapter set (`join`, A rows and B transposed), fused across the
slices of one layer (`fuse_slices`) and, while an adapter is merged, compensated (`compensated_stacks`).
Pure torch: no vLLM here.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from dlora_kernels import PackedLoRA


@dataclass
class SlotRows:
    """One slot's live rank rows of one slice: A [r, H_in] and B transposed [r, H_out]."""

    lora_id: int | None
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class PackEntry:
    """A slice's packed stacks as of `version` and slot occupancy `ids`, per slot and joined."""

    version: tuple[int, int] | None
    ids: tuple[int | None, ...] | None
    slots: list[SlotRows | None]
    packed: PackedLoRA
    compensated: dict[int, PackedLoRA] = dataclasses.field(default_factory=dict)


SAMPLE = 8  # leading values of a slot's first A row compared to tell a rewritten slot from a kept one


def read_slot(a3: torch.Tensor, b3: torch.Tensor, n: int, lora_id: int | None) -> SlotRows:
    """Slot n's live rank rows: its rank is 1 + its last row k with A[n, k] and B[n, :, k] both
    nonzero (vLLM zero-pads every adapter to max_lora_rank)."""
    nonzero = (a3[n] != 0).any(dim=1) & (b3[n] != 0).any(dim=0)  # [R]
    rows = nonzero.nonzero()
    r = int(rows[-1]) + 1 if rows.numel() else 0
    return SlotRows(lora_id, a3[n, :r].clone(), b3[n, :, :r].t().contiguous())


def slot_rows(
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    ids: tuple[int | None, ...] | None,
    previous: list[SlotRows | None] | None = None,
) -> list[SlotRows | None]:
    """Every slot's rows: None for a free slot (`ids` None there; all slots count when `ids` is
    None), the `previous` rows where the slot still holds the same adapter and its first values
    are unchanged, else read from the stacks."""
    a3, b3 = a_stacked[:, 0], b_stacked[:, 0]  # [N, R, H_in], [N, H_out, R]
    out: list[SlotRows | None] = []
    for n in range(a3.shape[0]):
        lora_id = None if ids is None else (ids[n] if n < len(ids) else None)
        if ids is not None and lora_id is None:
            out.append(None)
            continue
        old = previous[n] if previous is not None and n < len(previous) else None
        if old is not None and old.lora_id == lora_id and same_start(old, a3[n]):
            out.append(old)
        else:
            out.append(read_slot(a3, b3, n, lora_id))
    return out


def same_start(rows: SlotRows, a_slot: torch.Tensor) -> bool:
    """The slot's first A values are the cached ones (a cheap guard against a slot rewritten with
    the same adapter id; vLLM writes a slot only to activate another adapter there)."""
    if rows.rank == 0:
        return not bool((a_slot[0, :SAMPLE] != 0).any())
    return torch.equal(rows.a[0, :SAMPLE], a_slot[0, :SAMPLE])


def join(slots: list[SlotRows | None], a_stacked: torch.Tensor, b_stacked: torch.Tensor) -> PackedLoRA:
    """The slots' rows in dlora's packed mixed-rank layout (A rows, B transposed)."""
    ranks = tuple(0 if s is None else s.rank for s in slots)
    live = [s for s in slots if s is not None and s.rank]
    h_in, h_out = a_stacked.shape[-1], b_stacked.shape[-2]
    a = torch.cat([s.a for s in live]) if live else a_stacked.new_zeros((0, h_in))
    b = torch.cat([s.b for s in live]) if live else b_stacked.new_zeros((0, h_out))
    offsets = torch.tensor([0, *itertools.accumulate(ranks)], dtype=torch.int32, device=a.device)
    return PackedLoRA(a.contiguous(), b.contiguous(), offsets, ranks)


def pack(a_stacked: torch.Tensor, b_stacked: torch.Tensor, live: tuple[bool, ...] | None = None) -> PackedLoRA:
    """Each slot's live rank rows, packed (B transposed). vLLM zero-pads every adapter to
    max_lora_rank and gives slots without the module (empty, or an adapter that does not target
    it) all-zero stacks, and a zero row costs the kernels as much as a live one; so a rank-8
    adapter under max_lora_rank 16 costs 8 rows, not 16, and a layer no resident adapter targets
    costs nothing (`ranks_total` 0). Slots `live` marks False (no adapter) get rank 0: they are
    never read."""
    ids = None if live is None else tuple(n if on else None for n, on in enumerate(live))
    return join(slot_rows(a_stacked, b_stacked, ids), a_stacked, b_stacked)


def fuse_slices(packs: tuple[PackedLoRA, ...]) -> PackedLoRA:
    """Slices i = 0..k-1 of one layer (same adapters, same input) as one adapter per slot:
    A_n = [A_n,0; ...; A_n,k-1] (rank sum_i r_n,i) and B_n block-diagonal, slice i's B in slice
    i's output columns, so B_n^T A_n x = [B_n,0^T A_n,0 x, ..., B_n,k-1^T A_n,k-1 x]: exactly the
    per-slice results, side by side, in one shrink and one expand (the zero blocks of B_n cost
    FLOPs, not accuracy)."""
    col = [0, *itertools.accumulate(p.out_features for p in packs)]
    offsets = [p.rank_offsets.tolist() for p in packs]
    num_adapters = packs[0].num_adapters
    ranks = tuple(sum(p.ranks[n] for p in packs) for n in range(num_adapters))
    first = packs[0].a
    a = torch.empty(sum(ranks), first.shape[1], dtype=first.dtype, device=first.device)
    b = torch.zeros(sum(ranks), col[-1], dtype=packs[0].b.dtype, device=first.device)
    row = 0
    for n in range(num_adapters):
        for i, p in enumerate(packs):
            lo, hi = offsets[i][n], offsets[i][n + 1]
            a[row : row + hi - lo] = p.a[lo:hi]
            b[row : row + hi - lo, col[i] : col[i + 1]] = p.b[lo:hi]
            row += hi - lo
    rank_offsets = torch.tensor([0, *itertools.accumulate(ranks)], dtype=torch.int32, device=first.device)
    return PackedLoRA(a, b, rank_offsets, ranks)


def compensated_stacks(packed: PackedLoRA, merged: int) -> PackedLoRA:
    """Slot j != merged -> [A_j; A_X] / [B_j; -B_X] (rank r_j + r_X); slot merged -> A_X / -B_X."""
    offsets = packed.rank_offsets.tolist()
    a_x, b_x = (t[offsets[merged] : offsets[merged + 1]] for t in (packed.a, packed.b))
    a_parts: list[torch.Tensor] = []
    b_parts: list[torch.Tensor] = []
    ranks: list[int] = []
    for j, r in enumerate(packed.ranks):
        own = slice(offsets[j], offsets[j + 1])
        if j == merged:
            a_parts.append(a_x)
            b_parts.append(-b_x)
            ranks.append(r)
        else:
            a_parts += [packed.a[own], a_x]
            b_parts += [packed.b[own], -b_x]
            ranks.append(r + packed.ranks[merged])
    new_offsets = torch.tensor([0, *itertools.accumulate(ranks)], dtype=torch.int32, device=packed.a.device)
    return PackedLoRA(torch.cat(a_parts), torch.cat(b_parts), new_offsets, tuple(ranks))


def stack_version(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """The stacks' version counters (`set_lora` / `reset_lora` write in place, which bumps them);
    None for inference tensors, which keep none."""
    try:
        return a._version, b._version
    except RuntimeError:
        return None
