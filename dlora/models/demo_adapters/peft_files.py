"""Where the demo adapters are written, and in what form: PEFT files in bf16 with a base model name
that is the same on every machine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The committed adapters live in the repository's adapters/ directory, where configs/*.yaml point.
OUT_ROOT = Path(__file__).resolve().parents[3] / "adapters" / "smollm2"
NEUTRAL_BASE_NAME = "SmolLM2-135M-Instruct"


def save_adapter(peft_model, out_dir: Path) -> Path:
    """Save in bf16 (the served dtype; halves the file) with a machine-neutral base name."""
    peft_model.to(torch.bfloat16)
    peft_model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)
    (out_dir / "README.md").unlink(missing_ok=True)
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = NEUTRAL_BASE_NAME
    config["target_modules"] = sorted(config["target_modules"])  # a set in PEFT: hash order
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir
