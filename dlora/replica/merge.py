"""Fold one LoRA adapter into the base weights, and take it out again exactly (dLoRA's merged mode).

A merge replaces every touched base weight W by W + s·B@A (s = alpha/r, or alpha/sqrt(r) for
rsLoRA), computed in fp32 from the base *checkpoint's* W, never from the live parameters (which
may be merged already, or prepacked for the CPU GEMM kernels). An unmerge reloads the checkpoint's
own tensors, so the weights are bit-identical to the first load however many merges came before.

vLLM fuses projections (q/k/v into qkv_proj, gate/up into gate_up_proj), and its in-place reload
rebuilds a fused layer from *all* of its shards: a merge therefore reloads every shard of each
touched fused module (the untouched shards with their pristine values), never a partial layer.

Everything that can fail (missing or unreadable adapter files, names or shapes that do not fit the
base model) is checked before the weights are touched. If the reload itself fails, the pristine
tensors of the touched modules are reloaded before the error propagates, so a failed merge leaves
the base weights in place: never half-merged.

Merged weights are computed in fp32 and rounded once to the model dtype; pristine tensors go back
as the checkpoint holds them, through the same loader path as the first load.

No vLLM here: the engine supplies `reload(items)` (see `vllm_ext.py`), which keeps this testable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

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
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    self._file_of[key] = file
                    self._order[key] = len(self._order)
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

    @property
    def num_pristine(self) -> int:
        return len(self._pristine)


class WeightMerger:
    """At most one adapter merged at a time; `merge`/`unmerge` are all-or-nothing."""

    def __init__(self, checkpoint: CheckpointTensors, reload: Reload,
                 packed_modules: Mapping[str, Iterable[str]], dtype: torch.dtype | None = None):
        self.checkpoint = checkpoint
        self.dtype = dtype  # the model's: merged weights are rounded to it once, here
        self._reload = reload
        self._packed = {k: tuple(v) for k, v in packed_modules.items()}
        self._groups: dict[str, list[str]] = {}
        for name in checkpoint.names():
            self._groups.setdefault(fused_module(name, self._packed), []).append(name)
        self.merged: str | None = None  # path of the merged adapter
        self._touched: list[str] = []  # checkpoint names whose live values differ from pristine

    def merge(self, adapter_path: str) -> None:
        """Fold the adapter in (unmerging any other first). Raises MergeError, weights unchanged."""
        if self.merged is not None:
            self.unmerge()
        lora = read_adapter(adapter_path)
        items = self._merged_items(lora, adapter_path)
        self._touched = [n for n, _ in items]
        try:
            self._reload(items)
        except Exception as e:
            self._restore()  # an exception here propagates: the engine must not serve on
            raise MergeError(f"reloading merged weights failed, base restored: {e}") from e
        self.merged = adapter_path

    def unmerge(self) -> None:
        """Reload the pristine tensors of everything the last merge touched (no-op when unmerged)."""
        self._restore()
        self.merged = None

    def _restore(self) -> None:
        if self._touched:
            self._reload(sorted(self.checkpoint.get(self._touched).items(),
                                key=lambda kv: self._load_order(kv[0])))
            self._touched = []

    def _merged_items(self, lora: LoraFactors, path: str) -> list[tuple[str, torch.Tensor]]:
        unknown = sorted(n for n in lora.factors if n not in self.checkpoint)
        if unknown:
            raise MergeError(f"adapter {path!r} targets weights the base model lacks: {unknown[:3]}")
        names = sorted({n for t in lora.factors for n in self._groups[fused_module(t, self._packed)]},
                       key=self._load_order)
        base = self.checkpoint.get(names)
        items = []
        for name in names:
            w = base[name]
            if name in lora.factors:
                a, b = lora.factors[name]
                if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                    raise MergeError(f"adapter {path!r}: {name} has A {list(a.shape)}, B {list(b.shape)}; "
                                     f"the base weight is {list(w.shape)}")
                w = merged_weight(w, a, b, lora.scale)
                if self.dtype is not None:
                    w = w.to(self.dtype)
            items.append((name, w))
        return items

    def _load_order(self, name: str) -> tuple[str, int]:
        """Shards of one fused module next to each other (vLLM buffers a layer until it is complete)."""
        return fused_module(name, self._packed), self.checkpoint.order(name)
