"""dlora's batched-LoRA kernels (`dlora_kernels`) behind vLLM 0.32.0's punica-wrapper seam.

Runs inside vLLM's worker process.

vLLM routes every LoRA linear layer through one `PunicaWrapper` object per model: the runner calls
`update_metadata(mapping, ...)` once per step (token -> adapter slot), then each layer calls
`add_lora_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices)`. The classes here
keep vLLM's constructor and metadata, build one `LoRABatchMeta` per step from
`token_lora_indices`, and compute `add_lora_linear` with `dlora_kernels.add_lora`:

- `PunicaWrapperEinsum` (CPU): subclass of `PunicaWrapperCPU`, the one-hot einsum form;
- `PunicaWrapperTriton` (CUDA): subclass of `PunicaWrapperGPU`, dlora's SGMV/BGMV Triton kernels
  (built on first access, so importing this module never imports vLLM's GPU wrapper).

Embeddings, logits, MoE and the tensor-parallel (sharded) layers, which call `add_shrink` /
`add_expand` directly, stay with the parent class. `lora_backend.install` makes vLLM pick them.

NOTE on the weight layout: vLLM stacks each slice's adapters zero-padded to max rank R,
`lora_a_stacked[i]`: [N, 1, R, H_in], `lora_b_stacked[i]`: [N, 1, H_out, R] (N = max_loras slots),
and wraps every module the model supports, so a layer no resident adapter targets (gate/up/down
under q/k/v/o adapters) still gets a call, with all-zero stacks. Zero rows cost the one-hot kernels
as much as live ones, so `_pack` copies only each slot's live rank rows into dlora's packed
mixed-rank layout (A rows, B transposed), and a layer with none is skipped: in an engine profile
(SmolLM2-135M, 8 rank-8 q/k/v/o adapters, 16 decodes) half the LoRA time went to such zero layers.
The packed copy is cached per stacked tensor and rebuilt when either tensor's version counter moves
(`set_lora` / `reset_lora` write into them in place, which bumps it). Memory, besides vLLM's own
stacks (about 20 MB for SmolLM2-135M with 4 slots of rank 16 on every module): per targeted layer
the per-slice packed copy (live rows only, so at most the stacks' size), for fused layers the
block-diagonal fused copy (its B is k times the per-slice B of k slices), and oneDNN's prepacked
copy of whatever is called; while a merge lasts, the compensated versions of the same as well.

Token index -1 means "no adapter"; those rows are never read or written (vLLM's CPU torch ops get
this wrong, see cpu_lora_fix.py; the kernels skip them natively). A step whose tokens all have -1
does no LoRA work at all.

NOTE on mixed merged steps: while the adapter in slot s is merged into the base weights (W + dX,
see worker.py), the worker calls `dlora_set_merged_slot(s)`, and every token that is not s's must
get dY·x - dX·x (its own delta minus X's; base-model tokens: -dX·x), so that
(W + dX)x - dX·x + dY·x = W·x + dY·x, the unmerged result up to rounding; s's own tokens get
nothing (their delta is in the weights). Both terms go through ONE batched-LoRA call per slice,
as an unmerged step makes: on CPU a call's fixed cost (a dozen small torch ops) is most of the LoRA
time at decode sizes, and a second compensation call measured ~20% slower than an unmerged step.
The step uses *compensated* stacks (`_compensated`, cached per stack version and slot): slot j != s
becomes the rank-2r adapter [A_j; A_X] / [B_j; -B_X], and slot s itself becomes the rank-r adapter
A_X / -B_X, which the base-model tokens (-1) are sent to while s's own tokens go to -1. Each
token then costs its own rank plus X's; the compensated stacks cost about twice vLLM's B stacks in
memory while a merge lasts. A step of s's tokens only does no LoRA work at all, as before.
vLLM's own ops cannot do this: the `vllm` backend keeps remapping s's tokens to "no LoRA" and
never runs other requests while merged.

Both wrappers need eager execution (`engine.enforce_eager`, checked at start by `lora_backend`):
the per-step metadata is built on the host, which neither torch.compile nor CUDA graphs replay.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from dlora_kernels import LoRABatchMeta, PackedLoRA, add_lora

# Under "vllm." so the line goes through vLLM's log handler inside the engine process (the root
# logger there has none, and dlora INFO lines would be dropped).
log = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class LoRAPass:
    """The step's batched-LoRA call per LoRA linear: `meta` maps tokens to slots of the stacks as
    they are (`compensate` None), or of the compensated stacks of merged slot `compensate`."""

    meta: LoRABatchMeta
    compensate: int | None = None


def step_pass(idx: torch.Tensor, merged_slot: int | None) -> LoRAPass | None:
    """The step's pass for token slot indices `idx` (-1 = no adapter); None if it would do nothing.

    Merged slot s (module NOTE): s's tokens -> -1 (no LoRA), base tokens -> s (which holds -dX in
    the compensated stacks), every other token keeps its slot (its delta minus dX there)."""
    if merged_slot is not None:
        idx = torch.where(idx == merged_slot, -1, torch.where(idx < 0, merged_slot, idx)).to(idx.dtype)
    meta = _meta(idx)
    return None if meta is None else LoRAPass(meta, merged_slot)


def _meta(idx: torch.Tensor) -> LoRABatchMeta | None:
    """Segmented (SGMV) when some run of tokens shares an adapter, per-token (BGMV) otherwise
    (einsum ignores segments; Triton picks its kernel by it); None when no token has an adapter."""
    if idx.numel() == 0:
        return None
    adapters, lens = torch.unique_consecutive(idx, return_counts=True)
    adapters_l, lens_l = adapters.tolist(), lens.tolist()
    if all(a < 0 for a in adapters_l):
        return None
    if max(lens_l) > 1:
        return LoRABatchMeta.prefill(lens_l, adapters_l, device=idx.device)
    return LoRABatchMeta.decode(idx, device=idx.device)


def _head(meta: LoRABatchMeta, num_tokens: int) -> LoRABatchMeta | None:
    """`meta` for its first `num_tokens` tokens (None: none of them has an adapter)."""
    sub = LoRABatchMeta.decode(meta.token_indices[:num_tokens], device=meta.token_indices.device)
    return sub if sub.active_rows is None or sub.active_rows.numel() else None


if TYPE_CHECKING:
    # The mixin always sits before a vLLM wrapper in the bases: it calls up into one and reads its
    # per-step mapping. At run time it derives from object, so the MRO is the concrete class's.
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase as _WrapperBase
else:
    _WrapperBase = object


class DloraLinearMixin(_WrapperBase):
    """The shared override: per-step `LoRABatchMeta`s + `add_lora_linear` on dlora_kernels.

    Put it before the vLLM wrapper class in the bases; `kernel_backend` names the dlora_kernels
    backend ("einsum" or "triton").
    """

    kernel_backend: str = "einsum"
    # One call per LoRA linear instead of one per slice (see `_fuse_slices`): on CPU a call's fixed
    # cost dominates at decode sizes; on GPU the block-diagonal B would waste the expand's FLOPs.
    fuse_slices: bool = False
    _dlora_merged_slot: int | None = None
    # The adapter id in each slot (None: free; the whole tuple None until the first
    # update_metadata: every slot counts). A free slot keeps its last adapter's weights (vLLM's
    # unload and LRU deactivation do not clear them) and the einsum form multiplies every token by
    # every packed row, so a free slot is never packed; and when an adapter enters a slot, only
    # that slot is read again.
    _dlora_slot_ids: tuple[int | None, ...] | None = None

    # ---- per-step metadata ----------------------------------------------------------------------

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._dlora_slot_ids = tuple(lora_index_to_id)
        self._dlora_build_meta()

    def dlora_set_merged_slot(self, slot: int | None) -> None:
        """The slot of the adapter merged into the base weights (None: nothing merged), from the
        next LoRA linear on. vLLM skips `update_metadata` when the mapping and the slots did not
        change, so a new slot rebuilds the pass here."""
        if slot == self._dlora_merged_slot:
            return
        self._dlora_merged_slot = slot
        if hasattr(self, "_dlora_pass"):  # else the first update_metadata builds it
            self._dlora_build_meta()

    def _dlora_build_meta(self) -> None:
        """The step's pass, once per step, shared by every LoRA linear."""
        self._dlora_pass = step_pass(self.token_lora_indices, self._dlora_merged_slot)
        self._dlora_sub_passes: dict[int, LoRAPass | None] = {}

    def _dlora_pass_for(self, num_tokens: int) -> LoRAPass | None:
        """The step's pass for `num_tokens` rows of x (None: no LoRA work). Rows beyond the
        mapping (padding) get no adapter and no compensation."""
        full: LoRAPass | None = getattr(self, "_dlora_pass", None)
        if full is None or num_tokens >= full.meta.num_tokens:
            return full
        if num_tokens not in self._dlora_sub_passes:
            head = _head(full.meta, num_tokens)
            self._dlora_sub_passes[num_tokens] = None if head is None else LoRAPass(head, full.compensate)
        return self._dlora_sub_passes[num_tokens]

    # ---- weights --------------------------------------------------------------------------------

    def _dlora_packed(
        self, a_stacked: torch.Tensor, b_stacked: torch.Tensor, merged_slot: int | None = None
    ) -> PackedLoRA:
        """vLLM's padded stacks of one slice as a PackedLoRA of each slot's live rank rows (cached,
        see `_pack`); with `merged_slot`, the compensated stacks for that merged slot (module NOTE;
        also cached until the stacks change). When the stacks change (vLLM wrote an adapter into a
        slot), only the slots whose adapter changed are read again (`_slot_rows`): re-reading
        every slot of every layer made the first step of a newly loaded adapter stall the replica
        (about 330 ms with rank-64 adapters on SmolLM2-135M's seven projections, one core)."""
        cache: dict = self.__dict__.setdefault("_dlora_pack_cache", {})
        ids = self._dlora_slot_ids
        key = (a_stacked.data_ptr(), b_stacked.data_ptr(), tuple(b_stacked.shape))
        version = _version(a_stacked, b_stacked)
        hit: _PackEntry | None = cache.get(key)
        if hit is None or version is None or hit.version != version or hit.ids != ids:
            slots = _slot_rows(a_stacked, b_stacked, ids, hit.slots if hit is not None and ids is not None else None)
            hit = _PackEntry(version, ids, slots, _join(slots, a_stacked, b_stacked))
            if version is not None:
                cache[key] = hit
            elif not getattr(self, "_dlora_warned_uncached", False):
                self._dlora_warned_uncached = True
                log.warning(
                    "LoRA B stacks are inference tensors (no version counter): the %s backend re-packs B on every call",
                    self.kernel_backend,
                )
        if merged_slot is None:
            return hit.packed
        if merged_slot not in hit.compensated:
            hit.compensated.clear()  # one merged adapter at a time: keep only the current one's
            hit.compensated[merged_slot] = _compensated(hit.packed, merged_slot)
        return hit.compensated[merged_slot]

    # ---- the LoRA linear ------------------------------------------------------------------------

    def add_lora_linear(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: tuple[torch.Tensor, ...],
        lora_b_stacked: tuple[torch.Tensor, ...],
        scale: float,
        output_slices: tuple[int, ...],
        *,
        buffer=None,
        **kwargs: Any,
    ) -> None:
        """y[:, slice i] += scale * B_n(t) @ (A_n(t) @ x[t]) for every token t with an adapter.

        Same contract as vLLM's: y [T, sum(output_slices)] updated in place, x [T, H_in]; with
        `add_inputs=False` (vLLM's dual-stream path) each slice is written instead of added to.
        `buffer` is accepted and ignored (the kernels keep their own rank-r intermediate).
        """
        assert len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices)
        add_inputs = kwargs.get("add_inputs", True)
        if not add_inputs:
            y.zero_()
        step = self._dlora_pass_for(x.size(0))
        if step is None:
            return
        calls = self._dlora_calls(lora_a_stacked, lora_b_stacked, output_slices, step.compensate)
        if not calls:
            return  # no resident adapter targets this layer (vLLM wraps every supported module)
        t = step.meta.num_tokens
        xs = x[:t] if x.size(0) != t else x
        ys = y[:t] if y.size(0) != t else y
        if xs.dtype != lora_a_stacked[0].dtype:
            xs = xs.to(lora_a_stacked[0].dtype)
        if not getattr(self, "_dlora_logged", False):
            self._dlora_logged = True
            log.info(
                "dlora LoRA backend %s (%s) applies its first LoRA batch: %d tokens, %d slots",
                self.kernel_backend,
                type(self).__name__,
                t,
                lora_a_stacked[0].shape[0],
            )
        for lora, lo, hi in calls:
            add_lora(
                ys if hi - lo == ys.size(1) else ys[:, lo:hi], xs, lora, step.meta, scale, backend=self.kernel_backend
            )

    def add_lora_logits(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a_stacked: torch.Tensor,
        lora_b_stacked: torch.Tensor,
        scale,
        *,
        buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """vLLM's LM-head LoRA term, skipped when no resident adapter adapts the LM head or no
        sampled row has an adapter. vLLM wraps the LM head whenever LoRA is on, and its CPU op
        gathers a [rows, vocab, rank] copy of the stacks every step: with SmolLM2-135M's 49,152-word
        vocabulary that was a third of every decode step, adapters or not (q/k/v/o adapters leave
        the LM head's stacks all zero)."""
        if self._dlora_packed(lora_a_stacked, lora_b_stacked).ranks_total == 0:
            return
        if not bool((self.sampler_indices >= 0).any()):
            return
        # A vLLM wrapper follows this mixin in the MRO: its add_lora_logits is concrete.
        super().add_lora_logits(y, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer, **kwargs)  # type: ignore[safe-super]

    def _dlora_calls(
        self,
        a_stacked: tuple[torch.Tensor, ...],
        b_stacked: tuple[torch.Tensor, ...],
        output_slices: tuple[int, ...],
        compensate: int | None,
    ) -> tuple[tuple[PackedLoRA, int, int], ...]:
        """The layer's kernel calls (adapters, output columns lo:hi): one per slice with live rows,
        or one for all slices (`fuse_slices`, see `_fuse_slices`); each with prepacked oneDNN GEMMs
        on CPU (`_with_gemm`). Cached per layer and weight state until the stacks change; only the
        current merged slot's compensated calls are kept."""
        cache: dict = self.__dict__.setdefault("_dlora_calls_cache", {})
        key = (tuple(a.data_ptr() for a in a_stacked), tuple(b.data_ptr() for b in b_stacked), compensate)
        state = (tuple(_version(a, b) for a, b in zip(a_stacked, b_stacked)), self._dlora_slot_ids)
        hit = cache.get(key)
        if hit is not None and hit[0] == state and None not in state[0]:
            return hit[1]
        if compensate is not None and compensate != self.__dict__.get("_dlora_calls_merged"):
            for stale in [k for k in cache if k[2] is not None]:  # another merged slot's
                del cache[stale]
            self._dlora_calls_merged = compensate
        packs = tuple(self._dlora_packed(a, b, compensate) for a, b in zip(a_stacked, b_stacked))
        cols = [0, *itertools.accumulate(output_slices)]
        calls: tuple[tuple[PackedLoRA, int, int], ...]
        if not any(p.ranks_total for p in packs):
            calls = ()
        elif self.fuse_slices and len(packs) > 1:
            calls = ((self._with_gemm(_fuse_slices(packs)), 0, cols[-1]),)
        else:
            calls = tuple((self._with_gemm(p), cols[i], cols[i + 1]) for i, p in enumerate(packs) if p.ranks_total)
        cache[key] = (state, calls)  # one entry per layer and weight state: replaced, never piled up
        return calls

    def _with_gemm(self, lora: PackedLoRA) -> PackedLoRA:
        """`lora` with oneDNN GEMMs over prepacked copies of its weights, for the einsum kernels on
        CPU (vLLM's own CPU linears run this way; about 2x torch.matmul at decode sizes); as is
        elsewhere, or when oneDNN has no kernel for the dtype (fp16 without AVX512-FP16 or AMX-FP16)."""
        if self.kernel_backend != "einsum" or lora.a.device.type != "cpu" or not _onednn_available():
            return lora
        try:
            return dataclasses.replace(lora, gemm=_OneDnnGemm(lora))
        except RuntimeError as e:  # "could not create a primitive descriptor" (unsupported dtype)
            log.debug("oneDNN GEMM unavailable for %s LoRA weights (%s): torch.matmul", lora.a.dtype, e)
            return lora


class _OneDnnGemm:
    """x @ a.T and v @ b (PackedGemm) through vLLM's oneDNN matmul with prepacked weight copies."""

    def __init__(self, lora: PackedLoRA):
        from vllm import _custom_ops as ops

        self._mm = ops.onednn_mm
        self._a = ops.create_onednn_mm(lora.a.t(), 32)  # weight [K, N]; 32 cached M sizes, as vLLM
        self._b = ops.create_onednn_mm(lora.b, 32)

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(self._a, x, None)

    def expand(self, v: torch.Tensor) -> torch.Tensor:
        return self._mm(self._b, v, None)


@functools.lru_cache(maxsize=1)
def _onednn_available() -> bool:
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return False
    return bool(getattr(ops, "_supports_onednn", False))


@dataclass
class _SlotRows:
    """One slot's live rank rows of one slice: A [r, H_in] and B transposed [r, H_out]."""

    lora_id: int | None
    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class _PackEntry:
    """A slice's packed stacks as of `version` and slot occupancy `ids`, per slot and joined."""

    version: tuple[int, int] | None
    ids: tuple[int | None, ...] | None
    slots: list[_SlotRows | None]
    packed: PackedLoRA
    compensated: dict[int, PackedLoRA] = dataclasses.field(default_factory=dict)


SAMPLE = 8  # leading values of a slot's first A row compared to tell a rewritten slot from a kept one


def _read_slot(a3: torch.Tensor, b3: torch.Tensor, n: int, lora_id: int | None) -> _SlotRows:
    """Slot n's live rank rows: its rank is 1 + its last row k with A[n, k] and B[n, :, k] both
    nonzero (vLLM zero-pads every adapter to max_lora_rank)."""
    nonzero = (a3[n] != 0).any(dim=1) & (b3[n] != 0).any(dim=0)  # [R]
    rows = nonzero.nonzero()
    r = int(rows[-1]) + 1 if rows.numel() else 0
    return _SlotRows(lora_id, a3[n, :r].clone(), b3[n, :, :r].t().contiguous())


def _slot_rows(
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    ids: tuple[int | None, ...] | None,
    previous: list[_SlotRows | None] | None = None,
) -> list[_SlotRows | None]:
    """Every slot's rows: None for a free slot (`ids` None there; all slots count when `ids` is
    None), the `previous` rows where the slot still holds the same adapter and its first values
    are unchanged, else read from the stacks."""
    a3, b3 = a_stacked[:, 0], b_stacked[:, 0]  # [N, R, H_in], [N, H_out, R]
    out: list[_SlotRows | None] = []
    for n in range(a3.shape[0]):
        lora_id = None if ids is None else (ids[n] if n < len(ids) else None)
        if ids is not None and lora_id is None:
            out.append(None)
            continue
        old = previous[n] if previous is not None and n < len(previous) else None
        if old is not None and old.lora_id == lora_id and _same_start(old, a3[n]):
            out.append(old)
        else:
            out.append(_read_slot(a3, b3, n, lora_id))
    return out


def _same_start(rows: _SlotRows, a_slot: torch.Tensor) -> bool:
    """The slot's first A values are the cached ones (a cheap guard against a slot rewritten with
    the same adapter id; vLLM writes a slot only to activate another adapter there)."""
    if rows.rank == 0:
        return not bool((a_slot[0, :SAMPLE] != 0).any())
    return torch.equal(rows.a[0, :SAMPLE], a_slot[0, :SAMPLE])


def _join(slots: list[_SlotRows | None], a_stacked: torch.Tensor, b_stacked: torch.Tensor) -> PackedLoRA:
    """The slots' rows in dlora's packed mixed-rank layout (A rows, B transposed)."""
    ranks = tuple(0 if s is None else s.rank for s in slots)
    live = [s for s in slots if s is not None and s.rank]
    h_in, h_out = a_stacked.shape[-1], b_stacked.shape[-2]
    a = torch.cat([s.a for s in live]) if live else a_stacked.new_zeros((0, h_in))
    b = torch.cat([s.b for s in live]) if live else b_stacked.new_zeros((0, h_out))
    offsets = torch.tensor([0, *itertools.accumulate(ranks)], dtype=torch.int32, device=a.device)
    return PackedLoRA(a.contiguous(), b.contiguous(), offsets, ranks)


def _pack(a_stacked: torch.Tensor, b_stacked: torch.Tensor, live: tuple[bool, ...] | None = None) -> PackedLoRA:
    """Each slot's live rank rows, packed (B transposed). vLLM zero-pads every adapter to
    max_lora_rank and gives slots without the module (empty, or an adapter that does not target
    it) all-zero stacks, and a zero row costs the kernels as much as a live one; so a rank-8
    adapter under max_lora_rank 16 costs 8 rows, not 16, and a layer no resident adapter targets
    costs nothing (`ranks_total` 0). Slots `live` marks False (no adapter) get rank 0: they are
    never read."""
    ids = None if live is None else tuple(n if on else None for n, on in enumerate(live))
    return _join(_slot_rows(a_stacked, b_stacked, ids), a_stacked, b_stacked)


def _fuse_slices(packs: tuple[PackedLoRA, ...]) -> PackedLoRA:
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


def _compensated(packed: PackedLoRA, merged: int) -> PackedLoRA:
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


def _version(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    try:
        return a._version, b._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class PunicaWrapperEinsum(DloraLinearMixin, PunicaWrapperCPU):
    """vLLM's CPU wrapper with the LoRA linears on dlora's one-hot einsum kernels."""

    kernel_backend = "einsum"
    fuse_slices = True


def _triton_wrapper_class() -> type:
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU  # CUDA builds of vLLM

    # vLLM marks PunicaWrapperGPU final; this subclass replaces only its LoRA linears, on purpose.
    class PunicaWrapperTriton(DloraLinearMixin, PunicaWrapperGPU):  # type: ignore[misc]
        """vLLM's GPU wrapper with the LoRA linears on dlora's SGMV/BGMV Triton kernels."""

        kernel_backend = "triton"

    PunicaWrapperTriton.__module__ = __name__
    PunicaWrapperTriton.__qualname__ = "PunicaWrapperTriton"
    return PunicaWrapperTriton


def __getattr__(name: str):
    # vLLM resolves the wrapper by its dotted path, i.e. getattr on this module.
    if name == "PunicaWrapperTriton":
        cls = _triton_wrapper_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
