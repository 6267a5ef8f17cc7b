"""A PEFT LoRA adapter's files read for merging: its factors per base weight, its scale, its identity.

Runs inside vLLM's worker process, for the weight merger (`merge.py`), which checks everything
that can fail before the weights are touched. `MergeError`, every failed merge's error, is defined
here, the lowest of the merger's modules. Pure torch and safetensors: no vLLM here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


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


def adapter_key(path: str) -> tuple:
    """Identity of an adapter's files (a re-written adapter is not taken for the cached one)."""
    try:
        st = os.stat(Path(path) / ADAPTER_WEIGHTS)
    except OSError as e:
        raise MergeError(f"cannot read adapter {path!r}: {e}") from e
    return (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
