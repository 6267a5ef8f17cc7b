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
  `ParameterViews` finds those rows in a vLLM-shaped module tree; if any touched weight is not
  plain (prepacked, quantized, tensor-parallel, laid out unlike the checkpoint), that merge
  takes the reload path, so a prepacked CPU engine behaves exactly as before.

The in-place strategy starts from the live (model-dtype) W, the reload strategy from the
checkpoint's W; the two agree unless the checkpoint is stored in a wider dtype than the model.

No vLLM here: the engine supplies `reload(items)` and the module tree (see `worker.py`), which
keeps this testable.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from dlora.engine_ext.pristine_rows import PristineRows
from dlora_kernels import merge_lora_inplace

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."

Reload = Callable[[list[tuple[str, torch.Tensor]]], None]


class MergeError(RuntimeError):
    """The adapter could not be merged; the base weights are unchanged."""


@dataclass(frozen=True)
class LoraFactors:
    """A PEFT LoRA adapter as checkpoint weight name -> (A [r, in], B [out, r]), and its scale."""

    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def lora_scale(config: Mapping) -> float:
    """vLLM's (and PEFT's) scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    r = config["r"]
    alpha = config.get("lora_alpha", r)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_adapter(path: str | Path) -> LoraFactors:
    """Read a PEFT adapter directory; raise MergeError naming what is wrong."""
    d = Path(path)
    try:
        config = json.loads((d / ADAPTER_CONFIG).read_text())
        with safe_open(str(d / ADAPTER_WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # missing file, bad JSON, corrupt safetensors: all mean "cannot merge"
        raise MergeError(f"cannot read adapter {str(d)!r}: {e}") from e
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise MergeError(f"adapter {str(d)!r}: rank/alpha patterns and DoRA cannot be merged")
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise MergeError(f"adapter {str(d)!r}: {key} has no lora_B")
        name = key.removeprefix(_PEFT_PREFIX).replace(".lora_A.weight", ".weight")
        factors[name] = (a, b)
    if not factors:
        raise MergeError(f"adapter {str(d)!r} holds no LoRA weights")
    return LoraFactors(lora_scale(config), factors)


def _adapter_key(path: str) -> tuple:
    """Identity of an adapter's files (a re-written adapter is not taken for the cached one)."""
    try:
        st = os.stat(Path(path) / ADAPTER_WEIGHTS)
    except OSError as e:
        raise MergeError(f"cannot read adapter {path!r}: {e}") from e
    return (str(path), st.st_mtime_ns, st.st_size, st.st_ino)


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale·B@A in fp32 (the engine's loader casts it to the model dtype once)."""
    return torch.addmm(w.float(), b.float(), a.float(), alpha=scale)


def fused_module(name: str, packed_modules: Mapping[str, Iterable[str]]) -> str:
    """The engine module a checkpoint weight loads into: '...self_attn.k_proj.weight' -> '...self_attn.qkv_proj'."""
    module = name.rsplit(".", 1)[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed_modules.items():
        if leaf in parts:
            return f"{parent}.{fused}"
    return module


class CheckpointTensors:
    """Read-once access to the base model's safetensors; what was read is kept as the pristine copy."""

    def __init__(self, model_dir: str | Path):
        self._file_of: dict[str, Path] = {}
        self._order: dict[str, int] = {}
        self._shape: dict[str, torch.Size] = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    self._file_of[key] = file
                    self._order[key] = len(self._order)
                    self._shape[key] = torch.Size(f.get_slice(key).get_shape())
        if not self._file_of:
            raise MergeError(f"no safetensors weights in {str(model_dir)!r}")
        self._pristine: dict[str, torch.Tensor] = {}

    def names(self) -> Iterable[str]:
        return self._file_of.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        missing = sorted(n for n in set(names) if n not in self._pristine)
        by_file: dict[Path, list[str]] = {}
        for n in missing:
            by_file.setdefault(self._file_of[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for k in keys:
                    self._pristine[k] = f.get_tensor(k)
        return {n: self._pristine[n] for n in names}

    def order(self, name: str) -> int:
        return self._order[name]

    def shape(self, name: str) -> torch.Size:
        """The tensor's shape, read from the file header (the tensor itself is not loaded)."""
        return self._shape[name]


class KernelStates(Protocol):
    """Engine hook for switching without a reload: the compute state of engine modules.

    `capture(modules)` returns an opaque state per module that holds everything the module computes
    with (None if that is not possible, e.g. the weights live in tensors the next reload overwrites);
    `apply(states)` puts captured states back. Only for states captured from this same model.
    """

    def capture(self, modules: list[str]) -> dict[str, Any] | None: ...

    def apply(self, states: dict[str, Any]) -> None: ...


class LiveWeights(Protocol):
    """Engine hook for the in-place strategy: where the engine keeps checkpoint weights.

    `views(names)` maps each checkpoint weight name to the live tensor the forward pass reads for
    it (for one shard of a fused module, that shard's rows of the fused parameter), or returns None
    if any of them is not such a plain tensor: that merge then goes through the engine's reload.
    """

    def views(self, names: list[str]) -> dict[str, torch.Tensor] | None: ...


class ParameterViews:
    """`LiveWeights` over a module tree laid out like vLLM's at tensor parallel size 1.

    Checkpoint weight '<parent>.<leaf>.weight' lives in module '<parent>.<fused>' when
    `packed_modules[fused]` lists `leaf` (`fused_module`), else in '<parent>.<leaf>'. A LoRA
    wrapper's `base_layer` holds the weight. A fused module's `weight` stacks its shards' rows
    in `packed_modules` order with sizes `output_sizes`: QKVParallelLinear q | k | v (GQA: k and v
    have fewer rows than q), MergedColumnParallelLinear gate | up. `usable(layer)` is the engine's
    say whether the forward pass computes with `layer.weight` as is (not prepacked, quantized...).
    Shapes are checked against the checkpoint by the merger, so an unexpected layout is refused
    (reload) rather than merged into the wrong rows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        packed_modules: Mapping[str, Iterable[str]],
        usable: Callable[[torch.nn.Module], bool] = lambda layer: True,
    ):
        self.model = model
        self._packed = {k: tuple(v) for k, v in packed_modules.items()}
        self._usable = usable

    def views(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        out = {}
        for name in names:
            view = self._view(name)
            if view is None:
                return None
            out[name] = view
        return out

    def _view(self, name: str) -> torch.Tensor | None:
        module_name = fused_module(name, self._packed)
        try:
            layer = self.model.get_submodule(module_name)
        except AttributeError:
            return None
        layer = getattr(layer, "base_layer", layer)
        w = getattr(layer, "weight", None)
        if (
            not isinstance(w, torch.Tensor)
            or w.dim() != 2
            or w.is_meta
            or not w.is_floating_point()
            or getattr(layer, "tp_size", 1) != 1
            or not self._usable(layer)
        ):
            return None
        w = w.detach()  # same storage, no autograd
        leaf = name.rsplit(".", 1)[0].rpartition(".")[2]
        fused_leaf = module_name.rpartition(".")[2]
        if fused_leaf == leaf:
            return w
        parts = self._packed[fused_leaf]
        sizes = getattr(layer, "output_sizes", None)
        if sizes is None or len(sizes) != len(parts) or sum(sizes) != w.shape[0]:
            return None
        i = parts.index(leaf)
        start = sum(sizes[:i])
        return w[start : start + sizes[i]]


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
        key = _adapter_key(adapter_path)
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
        key = _adapter_key(adapter_path)
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
