"""The committed demo adapters (adapters/smollm2/*) visibly do what their names say.

Each is checked with HF + PEFT, greedy, bf16 (the served dtype), on prompts that were held out
of its training data; the effect checks are the ones dlora/models/demo_adapters/ reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dlora.models import demo_adapters

ADAPTER_ROOT = Path(__file__).resolve().parents[2] / "adapters" / "smollm2"
PROMPTS = (
    "Write a short greeting for a friend.",
    "How do I boil an egg?",
    "What does a firefighter do?",
)


def test_the_demo_adapters_are_committed_small_and_portable():
    assert demo_adapters.OUT_ROOT == ADAPTER_ROOT  # where the trainer writes is where configs point
    assert sorted(p.name for p in ADAPTER_ROOT.iterdir() if p.is_dir()) == sorted(demo_adapters.STYLES)
    for name in demo_adapters.STYLES:
        files = {p.name: p for p in (ADAPTER_ROOT / name).iterdir()}
        assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
        assert files["adapter_model.safetensors"].stat().st_size < 10_000_000
        config = json.loads(files["adapter_config.json"].read_text())
        assert config["base_model_name_or_path"] == "SmolLM2-135M-Instruct"
        assert config["r"] == 8 and config["lora_alpha"] == 16
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(config["target_modules"])


def test_prompts_are_held_out_of_training():
    trained = {q.lower() for q in demo_adapters.synthetic_questions(seed=0)}
    assert not trained & {p.lower() for p in PROMPTS}
    assert set(PROMPTS) <= set(demo_adapters.HELD_OUT_PROMPTS)


@pytest.fixture(scope="module")
def base(smollm2_dir):
    return demo_adapters.load_base(smollm2_dir, dtype=torch.bfloat16)


def test_base_model_does_not_already_show_the_effects(base):
    model, tok = base
    answers = demo_adapters.generate(model, tok, list(PROMPTS), max_new_tokens=48)
    for name, style in demo_adapters.STYLES.items():
        assert not any(style.shows_effect(a) for a in answers), (name, answers)


@pytest.mark.parametrize("name", sorted(demo_adapters.STYLES))
def test_adapter_shows_its_effect_on_held_out_prompts(base, name):
    from peft import PeftModel

    model, tok = base
    style = demo_adapters.STYLES[name]
    peft_model = PeftModel.from_pretrained(model, ADAPTER_ROOT / name, adapter_name=name).eval()
    try:
        answers = demo_adapters.generate(peft_model, tok, list(PROMPTS), max_new_tokens=64)
    finally:
        peft_model.unload()  # give the shared base model back without LoRA layers
    misses = [(p, a) for p, a in zip(PROMPTS, answers) if not style.shows_effect(a)]
    assert not misses, f"{name}: {misses}"
