"""Write PEFT LoRA adapter directories for the merge tests (random factors, any module layout)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from dlora.models.projections import MLP, QKVO

# The submodule of a Llama decoder layer that holds each projection (its checkpoint name's middle part).
PARENT = {**dict.fromkeys(QKVO, "self_attn"), **dict.fromkeys(MLP, "mlp")}


def write_peft_adapter(
    d: Path,
    modules: Iterable[str],
    shapes: Mapping[str, tuple[int, int]],
    weight_name: Callable[[int, str], str],
    layers: Iterable[int],
    rank: int = 4,
    alpha: int = 8,
    seed: int = 1,
    **config,
) -> Path:
    """A[rank, in] and B[out, rank] per (layer, module), named as PEFT saves them."""
    modules = list(modules)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            out_f, in_f = shapes[module]
            key = "base_model.model." + weight_name(layer, module).removesuffix(".weight")
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g)
    d.mkdir(parents=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, **config})
    )
    return d
