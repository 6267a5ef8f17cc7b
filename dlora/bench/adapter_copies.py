"""Many random adapters fast: copies of one PEFT adapter's layout with fresh random weights.

Why: building each adapter through PEFT loads the base model once per adapter (seconds each);
a thousand adapters of one layout only need the template's config and tensor shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def copies_of(template: Path, out: Path, n: int, prefix: str = "a", seed: int = 0) -> list[Path]:
    """`out/<prefix><i>` for i < n: the template's config and tensor shapes, weights drawn with the
    same standard deviation per tensor (deterministic in `seed` and i, cached on disk)."""
    import torch
    from safetensors.torch import load_file, save_file

    shapes = load_file(str(template / WEIGHTS))
    stds = {k: float(t.float().std()) for k, t in shapes.items()}
    paths = [out / f"{prefix}{i}" for i in range(n)]
    for i, p in enumerate(paths):
        if (p / WEIGHTS).is_file():
            continue
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        tensors = {
            k: (torch.randn(t.shape, generator=gen) * stds[k]).to(t.dtype).contiguous() for k, t in shapes.items()
        }
        tmp = p.with_name(p.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS))
        (tmp / CONFIG).write_text(json.dumps(json.loads((template / CONFIG).read_text()), indent=2))
        tmp.rename(p)  # whole or absent: an interrupted run never leaves half an adapter
    return paths
