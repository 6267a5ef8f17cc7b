"""Small real PEFT adapters on a micro Llama config, built once per test run (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def make_base(out: Path) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    return out


def make_adapter(base_dir: Path, out: Path, rank: int = 4, targets=("q_proj", "v_proj"), **extra) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(base_dir))
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False, **extra)
    get_peft_model(model, cfg).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    base = make_base(root / "base")
    good = make_adapter(base, root / "good", rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
    other_base = root / "other_base"
    other_base.mkdir()
    cfg = json.loads((base / "config.json").read_text())
    cfg["hidden_size"] = 64
    cfg["intermediate_size"] = 96
    (other_base / "config.json").write_text(json.dumps(cfg))
    wrong_shape = make_adapter(other_base, root / "wrong_shape", rank=4)
    big_rank = make_adapter(base, root / "big_rank", rank=16)
    return {"root": root, "base": base, "good": good, "wrong_shape": wrong_shape, "big_rank": big_rank}
