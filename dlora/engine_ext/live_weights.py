"""Where the engine keeps each checkpoint weight, for merging in place (`merge.py`'s in-place strategy).

Runs inside vLLM's worker process. `LiveWeights` is the hook the merger asks; `ParameterViews`
answers it over a module tree laid out like vLLM's (the worker builds it over the model runner's
model, `worker.py`), or refuses a weight the forward pass does not read as a plain tensor, which
sends that merge through the engine's reload. Pure torch: no vLLM here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch

from dlora.engine_ext.checkpoint_tensors import fused_module


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
