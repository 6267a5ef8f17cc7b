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

Beside it: the step's token -> slot pass (`lora_step_pass.py`), the packed and compensated stacks
(`packed_stacks.py`) and the CPU's prepacked oneDNN GEMMs (`onednn_gemm.py`).

NOTE on the weight layout: vLLM stacks each slice's adapters zero-padded to max rank R,
`lora_a_stacked[i]`: [N, 1, R, H_in], `lora_b_stacked[i]`: [N, 1, H_out, R] (N = max_loras slots),
and wraps every module the model supports, so a layer no resident adapter targets (gate/up/down
under q/k/v/o adapters) still gets a call, with all-zero stacks. Zero rows cost the one-hot kernels
as much as live ones, so `packed_stacks` copies only each slot's live rank rows into dlora's packed
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
The step uses *compensated* stacks (`packed_stacks.compensated_stacks`, cached per stack version
and slot): slot j != s becomes the rank-2r adapter [A_j; A_X] / [B_j; -B_X], and slot s itself
becomes the rank-r adapter A_X / -B_X, which the base-model tokens (-1) are sent to while s's own
tokens go to -1 (`lora_step_pass.step_pass`). Each token then costs its own rank plus X's; the
compensated stacks cost about twice vLLM's B stacks in memory while a merge lasts. A step of s's
tokens only does no LoRA work at all, as before.
vLLM's own ops cannot do this: the `vllm` backend keeps remapping s's tokens to "no LoRA" and
never runs other requests while merged.

Both wrappers need eager execution (`engine.enforce_eager`, checked at start by `lora_backend`):
the per-step metadata is built on the host, which neither torch.compile nor CUDA graphs replay.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from dlora.engine_ext.lora_step_pass import LoRAPass, head_pass, step_pass
from dlora.engine_ext.onednn_gemm import OneDnnGemm, onednn_available
from dlora.engine_ext.packed_stacks import PackEntry, compensated_stacks, fuse_slices, join, slot_rows, stack_version
from dlora_kernels import PackedLoRA, add_lora

# Under "vllm." so the line goes through vLLM's log handler inside the engine process (the root
# logger there has none, and dlora INFO lines would be dropped).
log = logging.getLogger(f"vllm.{__name__}")


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
    # One call per LoRA linear instead of one per slice (`packed_stacks.fuse_slices`): on CPU a call's fixed
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
            self._dlora_sub_passes[num_tokens] = head_pass(full, num_tokens)
        return self._dlora_sub_passes[num_tokens]

    # ---- weights --------------------------------------------------------------------------------

    def _dlora_packed(
        self, a_stacked: torch.Tensor, b_stacked: torch.Tensor, merged_slot: int | None = None
    ) -> PackedLoRA:
        """vLLM's padded stacks of one slice as a PackedLoRA of each slot's live rank rows (cached,
        see `packed_stacks`); with `merged_slot`, the compensated stacks for that merged slot (module NOTE;
        also cached until the stacks change). When the stacks change (vLLM wrote an adapter into a
        slot), only the slots whose adapter changed are read again (`packed_stacks.slot_rows`): re-reading
        every slot of every layer made the first step of a newly loaded adapter stall the replica
        (about 330 ms with rank-64 adapters on SmolLM2-135M's seven projections, one core)."""
        cache: dict = self.__dict__.setdefault("_dlora_pack_cache", {})
        ids = self._dlora_slot_ids
        key = (a_stacked.data_ptr(), b_stacked.data_ptr(), tuple(b_stacked.shape))
        version = stack_version(a_stacked, b_stacked)
        hit: PackEntry | None = cache.get(key)
        if hit is None or version is None or hit.version != version or hit.ids != ids:
            slots = slot_rows(a_stacked, b_stacked, ids, hit.slots if hit is not None and ids is not None else None)
            hit = PackEntry(version, ids, slots, join(slots, a_stacked, b_stacked))
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
            hit.compensated[merged_slot] = compensated_stacks(hit.packed, merged_slot)
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
        or one for all slices (`fuse_slices`, `packed_stacks.fuse_slices`); each with prepacked oneDNN GEMMs
        on CPU (`_with_gemm`). Cached per layer and weight state until the stacks change; only the
        current merged slot's compensated calls are kept."""
        cache: dict = self.__dict__.setdefault("_dlora_calls_cache", {})
        key = (tuple(a.data_ptr() for a in a_stacked), tuple(b.data_ptr() for b in b_stacked), compensate)
        state = (tuple(stack_version(a, b) for a, b in zip(a_stacked, b_stacked)), self._dlora_slot_ids)
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
            calls = ((self._with_gemm(fuse_slices(packs)), 0, cols[-1]),)
        else:
            calls = tuple((self._with_gemm(p), cols[i], cols[i + 1]) for i, p in enumerate(packs) if p.ranks_total)
        cache[key] = (state, calls)  # one entry per layer and weight state: replaced, never piled up
        return calls

    def _with_gemm(self, lora: PackedLoRA) -> PackedLoRA:
        """`lora` with oneDNN GEMMs over prepacked copies of its weights, for the einsum kernels on
        CPU (vLLM's own CPU linears run this way; about 2x torch.matmul at decode sizes); as is
        elsewhere, or when oneDNN has no kernel for the dtype (fp16 without AVX512-FP16 or AMX-FP16)."""
        if self.kernel_backend != "einsum" or lora.a.device.type != "cpu" or not onednn_available():
            return lora
        try:
            return dataclasses.replace(lora, gemm=OneDnnGemm(lora))
        except RuntimeError as e:  # "could not create a primitive descriptor" (unsupported dtype)
            log.debug("oneDNN GEMM unavailable for %s LoRA weights (%s): torch.matmul", lora.a.dtype, e)
            return lora


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
