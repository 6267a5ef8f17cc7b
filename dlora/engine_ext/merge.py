"""Fold one LoRA adapter into the base weights, and take it out again exactly (dLoRA's merged mode).

Runs inside vLLM's worker process.

A merge replaces every touched base weight W by W + s·B@A (s = alpha/r, or alpha/sqrt(r) for
rsLoRA), computed in fp32 from the base *checkpoint's* W, never from the live parameters (which
may be merged already, or prepacked for the CPU GEMM kernels). An unmerge reloads the checkpoint's
own tensors, so the weights are bit-identical to the first load however many merges came before.
Where the engine can capture a module's compute state (`KernelStates`: on CPU, the prepacked GEMM
closure), unmerge instead puts back the very objects captured before the merge, and re-merging
a recently merged adapter puts back its merged objects: the same result without a reload (about
1 ms against 130-210 ms through vLLM's reload for SmolLM2-135M on one core).

vLLM fuses projections (q/k/v into qkv_proj, gate/up into gate_up_proj), and its in-place reload
rebuilds a fused layer from *all* of its shards: a merge therefore reloads every shard of each
touched fused module (the untouched shards with their pristine values), never a partial layer.

Everything that can fail (missing or unreadable adapter files, names or shapes that do not fit the
base model) is checked before the weights are touched. If the reload itself fails, the pristine
tensors of the touched modules are reloaded before the error propagates, so a failed merge leaves
the base weights in place: never half-merged.

Merged weights are computed in fp32 and rounded once to the model dtype; pristine tensors go back
as the checkpoint holds them, through the same loader path as the first load.

Two strategies, chosen per merge by what the engine exposes:

- *reload* (above): for engines whose weights cannot be edited in place, above all vLLM on CPU,
  which prepacks each GEMM weight into its kernel's own layout and empties `layer.weight`.
- *in place* (`LiveWeights`): where every touched weight is a plain parameter the forward pass
  reads (CUDA, or any device where vLLM does not prepack), each touched weight, or its rows of a
  fused parameter, gets `dlora_kernels.merge_lora_inplace` (W += s·B@A tile by tile, fp32
  accumulation, one rounding, no d x d temporary). The rows are copied aside the first time a
  merge touches them (`PristineRows`: device memory within a budget, pinned host memory
  beyond), and unmerge copies them back: bit-identical by construction
  (see `_restore_inplace` for why not a reload, and never a subtraction). A merge that fails
  midway copies back every row it may have touched before the error propagates.
  `ParameterViews` (`live_weights.py`) finds those rows in a vLLM-shaped module tree; if any
  touched weight is not plain (prepacked, quantized, tensor-parallel, laid out unlike the
  checkpoint), that merge takes the reload path, so a prepacked CPU engine behaves exactly as before.

The in-place strategy starts from the live (model-dtype) W, the reload strategy from the
checkpoint's W; the two agree unless the checkpoint is stored in a wider dtype than the model.

Beside it: the adapter's files and `MergeError` (`adapter_factors.py`), the base checkpoint
(`checkpoint_tensors.py`), the live weights the in-place strategy writes (`live_weights.py`) and
where their pristine rows are kept (`pristine_rows.py`).

No vLLM here: the engine supplies `reload(items)` and the module tree (see `worker.py`), which
keeps this testable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from dlora.engine_ext.adapter_factors import LoraFactors, MergeError, adapter_key, read_adapter
from dlora.engine_ext.checkpoint_tensors import CheckpointTensors, fused_module
from dlora.engine_ext.freed_heap import release_freed_heap
from dlora.engine_ext.live_weights import LiveWeights, ParameterViews
from dlora.engine_ext.pristine_rows import PristineRows
from dlora_kernels import merge_lora_inplace

# The merger's API, imported from here by the worker (`worker.py`); each part is defined in its own module.
__all__ = [
    "CheckpointTensors",
    "KernelStates",
    "LiveWeights",
    "MergeError",
    "ParameterViews",
    "Reload",
    "WeightMerger",
    "merged_weight",
    "read_adapter",
]

Reload = Callable[[list[tuple[str, torch.Tensor]]], None]


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B@A in fp32 (the engine's loader casts it to the model dtype once)."""
    return torch.addmm(w.float(), b.float(), a.float(), alpha=scale)


class KernelStates(Protocol):
    """Engine hook for switching without a reload: the compute state of engine modules.

    `capture(modules)` returns an opaque state per module that holds everything the module computes
    with (None if that is not possible, e.g. the weights live in tensors the next reload overwrites);
    `apply(states)` puts captured states back. Only for states captured from this same model.
    """

    def capture(self, modules: list[str]) -> dict[str, Any] | None: ...

    def apply(self, states: dict[str, Any]) -> None: ...


class WeightMerger:
    """At most one adapter merged at a time; `merge`/`unmerge` are all-or-nothing.

    With `kernels`, the base state of every module a merge touches is captured before its first
    merge, so unmerge puts those very objects back instead of reloading (bit-identical by
    construction), and the merged states of recently merged adapters are kept, least recently
    merged dropped first, within `cache_bytes` (counted as the merged weights' bytes), so merging
    any of them again is a swap too. Why more than one: a policy that serves a cold adapter merged
    and then returns to the hot one would otherwise pay a full reload on every change. A captured
    state stays valid after later reloads of the same modules, which build new objects (on CPU a
    new prepacked GEMM closure; each closure owns its packed copy). A failed reload is always
    repaired by a full pristine reload.

    With `live`, a merge whose every target is a plain live tensor is done in place instead
    (`merge_lora_inplace`), and its unmerge copies back the saved pristine rows; otherwise it goes
    through `reload` as above.
    """

    def __init__(
        self,
        checkpoint: CheckpointTensors,
        reload: Reload,
        packed_modules: Mapping[str, Iterable[str]],
        dtype: torch.dtype | None = None,
        kernels: KernelStates | None = None,
        cache_bytes: int = 0,
        live: LiveWeights | None = None,
        pristine: PristineRows | None = None,
    ):
        self.checkpoint = checkpoint
        self.dtype = dtype  # the model's: merged weights are rounded to it once, here
        self._reload = reload
        self._packed = {k: tuple(v) for k, v in packed_modules.items()}
        self._groups: dict[str, list[str]] = {}
        for name in checkpoint.names():
            self._groups.setdefault(fused_module(name, self._packed), []).append(name)
        self.merged: str | None = None  # path of the merged adapter
        self._touched: list[str] = []  # checkpoint names whose live values differ from pristine
        self._kernels = kernels
        self._cache_bytes = cache_bytes
        self._base_states: dict[str, Any] = {}  # module -> its state with pristine weights
        # adapter key -> (names, module states, bytes), least recently merged first
        self._cached: OrderedDict[tuple, tuple[list[str], dict[str, Any], int]] = OrderedDict()
        self.reloads = 0  # merges and unmerges that went through the engine's reload
        self._live = live
        self._saved = pristine if pristine is not None else PristineRows()  # name -> its pristine live rows
        self._inplace: dict[str, torch.Tensor] = {}  # name -> live rows the current in-place merge may change
        self.inplace_merges = 0  # merges done in place

    def merge(self, adapter_path: str) -> None:
        """Fold the adapter in (unmerging any other first). Raises MergeError, weights unchanged."""
        if self.merged is not None:
            self.unmerge()
        key = adapter_key(adapter_path)
        if key in self._cached:
            self._cached.move_to_end(key)
            names, states, _ = self._cached[key]
            self._touched = names
            self._swap_in(states)
            self.merged = adapter_path
            return
        lora = read_adapter(adapter_path)
        views = self._inplace_views(lora, adapter_path)
        if views is not None:
            self._merge_inplace(lora, views)
            self.merged = adapter_path
            return
        items = self._merged_items(lora, adapter_path)
        names = [n for n, _ in items]
        modules = self._modules(names)
        if self._kernels is not None:
            self._capture_base(modules)
        self._touched = names
        try:
            self._reload(items)
            self.reloads += 1
        except Exception as e:
            self._restore(full=True)  # an exception here propagates: the engine must not serve on
            raise MergeError(f"reloading merged weights failed, base restored: {e}") from e
        self.merged = adapter_path
        self._remember(key, names, modules, items)
        release_freed_heap()  # the reload freed the old packed weights (freed_heap.py)

    def prepare(self, adapter_path: str) -> bool:
        """Cache the adapter's merged state ahead of its first merge, leaving the base weights in.

        Why: a first merge through the engine's reload stalls the replica for the whole reload
        (130-230 ms for SmolLM2-135M on one core), a cached one is a swap (~2 ms). Done when an
        adapter is registered, so serving never pays it. Only with nothing merged (the caller's
        weights must stay as they are), capturable kernels, and room in the cache for one more
        state the size of those already kept (a prepare never evicts). True if it is cached now.
        Raises MergeError like `merge` (the base weights are then in place, as before).
        """
        if self.merged is not None or self._kernels is None or self._cache_bytes <= 0:
            return False
        key = adapter_key(adapter_path)
        if key in self._cached:
            return True
        sizes = [e[2] for e in self._cached.values()]
        if sizes and sum(sizes) + max(sizes) > self._cache_bytes:
            return False
        self.merge(adapter_path)
        self.unmerge()
        return key in self._cached

    def unmerge(self) -> None:
        """Put back the pristine weights of everything the last merge touched (no-op when unmerged)."""
        self._restore_inplace()
        self._restore()
        self.merged = None

    @property
    def strategy(self) -> str | None:
        """How the merged adapter went in: 'inplace', 'reload', or None when nothing is merged."""
        if self.merged is None:
            return None
        return "inplace" if self._inplace else "reload"

    # ---- in place ------------------------------------------------------------------------------

    def _inplace_views(self, lora: LoraFactors, path: str) -> dict[str, torch.Tensor] | None:
        """The live rows of every target if all of them can be merged in place, else None."""
        if self._live is None:
            return None
        self._check_targets(lora, path)
        names = sorted(lora.factors, key=self._load_order)
        try:
            views = self._live.views(names)
        except Exception as e:  # nothing written yet: the adapter runs unmerged this time
            raise MergeError(f"cannot locate the live weights of adapter {path!r}: {e}") from e
        if views is None or any(views[n].shape != self.checkpoint.shape(n) for n in names):
            return None  # not plain, or laid out unlike the checkpoint: the reload path
        for n in names:
            self._check_factors(n, *lora.factors[n], self.checkpoint.shape(n), path)
        return views

    def _merge_inplace(self, lora: LoraFactors, views: dict[str, torch.Tensor]) -> None:
        try:
            self._saved.save(views)  # everything is unmerged here, so the views hold pristine bits
        except Exception as e:  # e.g. out of host memory: nothing written yet
            raise MergeError(f"cannot save the pristine weights: {e}") from e
        self._inplace = views  # from here on, unmerge/repair copies back all of them
        try:
            with torch.no_grad():
                for n, v in views.items():
                    a, b = lora.factors[n]
                    # fp32 factors: exact for any adapter dtype, and what Triton wants (one dtype).
                    merge_lora_inplace(v, a.to(v.device, torch.float32), b.to(v.device, torch.float32), lora.scale, 1)
        except Exception as e:
            self._restore_inplace()  # an exception here propagates: the engine must not serve on
            raise MergeError(f"merging in place failed, base restored: {e}") from e
        self.inplace_merges += 1

    def _restore_inplace(self) -> None:
        # Copy the saved rows back rather than reload or subtract. Exact by construction: they are
        # the very bits the engine computed with before the first merge, same dtype, no cast,
        # so nothing depends on how the loader turned checkpoint tensors into parameters.
        # Cheaper than vLLM's reload, which rebuilds every shard of each touched fused layer through
        # the weight loaders and re-runs their post-processing: this is one copy per touched shard.
        # Subtracting s·B@A would be cheaper still but is not exact (rounding drifts, ~2e-8 per
        # 100 cycles in fp32, far more in bf16). Where the copies live: pristine_rows.py.
        if not self._inplace:
            return
        with torch.no_grad():
            self._saved.restore(self._inplace)
        self._inplace = {}

    # ---- reload --------------------------------------------------------------------------------

    def _restore(self, full: bool = False) -> None:
        if not self._touched:
            return
        modules = self._modules(self._touched)
        if not full and self._kernels is not None and all(m in self._base_states for m in modules):
            self._kernels.apply({m: self._base_states[m] for m in modules})
        else:
            self._reload(sorted(self.checkpoint.get(self._touched).items(), key=lambda kv: self._load_order(kv[0])))
            self.reloads += 1
        self._touched = []

    def _swap_in(self, states: dict[str, Any]) -> None:
        assert self._kernels is not None  # states are cached only when the engine captured them
        try:
            self._kernels.apply(states)
        except Exception as e:
            self._restore(full=True)
            raise MergeError(f"restoring cached merged weights failed, base restored: {e}") from e

    def _capture_base(self, modules: list[str]) -> None:
        assert self._kernels is not None  # called only when the engine can capture states
        missing = [m for m in modules if m not in self._base_states]
        if missing:
            states = self._kernels.capture(missing)
            if states is not None:
                self._base_states.update(states)

    def _remember(self, key: tuple, names: list[str], modules: list[str], items) -> None:
        for stale in [k for k in self._cached if k[0] == key[0]]:  # the same path, older files
            del self._cached[stale]
        size = sum(t.numel() * t.element_size() for _, t in items)
        if self._kernels is None or size > self._cache_bytes:
            return
        while self._cached and sum(e[2] for e in self._cached.values()) + size > self._cache_bytes:
            self._cached.popitem(last=False)  # released before the new capture holds memory
        states = self._kernels.capture(modules)
        if states is not None:
            self._cached[key] = (names, states, size)

    @property
    def cached_adapters(self) -> list[str]:
        """Paths of the adapters whose merged state is kept, least recently merged first."""
        return [key[0] for key in self._cached]

    def _modules(self, names: Iterable[str]) -> list[str]:
        return sorted({fused_module(n, self._packed) for n in names})

    def _check_targets(self, lora: LoraFactors, path: str) -> None:
        unknown = sorted(n for n in lora.factors if n not in self.checkpoint)
        if unknown:
            raise MergeError(f"adapter {path!r} targets weights the base model lacks: {unknown[:3]}")

    @staticmethod
    def _check_factors(name: str, a: torch.Tensor, b: torch.Tensor, shape: torch.Size, path: str) -> None:
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(shape) or a.shape[0] != b.shape[1]:
            raise MergeError(
                f"adapter {path!r}: {name} has A {list(a.shape)}, B {list(b.shape)}; the base weight is {list(shape)}"
            )

    def _merged_items(self, lora: LoraFactors, path: str) -> list[tuple[str, torch.Tensor]]:
        self._check_targets(lora, path)
        names = sorted(
            {n for t in lora.factors for n in self._groups[fused_module(t, self._packed)]}, key=self._load_order
        )
        base = self.checkpoint.get(names)
        items = []
        for name in names:
            w = base[name]
            if name in lora.factors:
                a, b = lora.factors[name]
                self._check_factors(name, a, b, w.shape, path)
                w = merged_weight(w, a, b, lora.scale)
                if self.dtype is not None:
                    w = w.to(self.dtype)
            items.append((name, w))
        return items

    def _load_order(self, name: str) -> tuple[str, int]:
        """Shards of one fused module next to each other (vLLM buffers a layer until it is complete)."""
        return fused_module(name, self._packed), self.checkpoint.order(name)
