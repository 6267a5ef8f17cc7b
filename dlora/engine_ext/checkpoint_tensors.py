"""The base model's checkpoint as the weight merger reads it (`merge.py`): tensors by name, read
once and kept as the pristine copy, and the engine module each checkpoint weight loads into.

Runs inside vLLM's worker process. vLLM fuses projections (q/k/v into qkv_proj, gate/up into
gate_up_proj): `fused_module` names the engine module of a checkpoint weight from the model's
`packed_modules_mapping`. Pure torch and safetensors: no vLLM here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from dlora.engine_ext.adapter_factors import MergeError


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
