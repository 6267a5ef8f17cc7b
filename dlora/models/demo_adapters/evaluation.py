"""How well a saved adapter shows its style on held-out prompts, and the report of it."""

from __future__ import annotations

from pathlib import Path

from dlora.models.demo_adapters.chat import generate, load_base
from dlora.models.demo_adapters.styles import Style


def evaluate(base_dir: Path, adapter_dir: Path, style: Style, prompts: list[str]) -> tuple[float, list[str]]:
    """Greedy answers of the *saved* adapter (bf16, HF+PEFT) and the fraction showing the style."""
    from peft import PeftModel

    model, tok = load_base(base_dir)
    peft_model = PeftModel.from_pretrained(model, adapter_dir).eval()
    answers = generate(peft_model, tok, prompts, max_new_tokens=64)
    rate = sum(style.shows_effect(a) for a in answers) / len(answers)
    return rate, answers


def print_outcome(style: Style, out_dir: Path, prompts: list[str], answers: list[str], before: str) -> None:
    """A before/after sample on the style's example prompt, then the held-out misses."""
    size_mb = (out_dir / "adapter_model.safetensors").stat().st_size / 1e6
    after = answers[prompts.index(style.example_prompt)]
    hits = sum(style.shows_effect(a) for a in answers)
    print(f"  saved {out_dir}  ({size_mb:.1f} MB)")
    print(f"  before: {style.example_prompt!r} -> {before!r}")
    print(f"  after:  {style.example_prompt!r} -> {after!r}")
    print(f"  effect on held-out prompts: {hits}/{len(answers)}", flush=True)
    for prompt, answer in zip(prompts, answers):
        if not style.shows_effect(answer):
            print(f"    missed: {prompt!r} -> {answer!r}")
