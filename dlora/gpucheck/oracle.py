"""HF transformers + PEFT greedy decoding on the CPU in fp32: what the engine's tokens must equal."""

from __future__ import annotations

from functools import lru_cache


class HFOracle:
    def __init__(self, base: str, adapters: dict[str, str]):
        self.base = base
        self.adapters = adapters

    @lru_cache(maxsize=8)
    def _load(self, adapter: str | None):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, self.adapters[adapter]) if adapter else base
        return model.eval()

    @lru_cache(maxsize=1)
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.base)

    @lru_cache(maxsize=256)
    def greedy(self, adapter: str | None, prompt: str, max_new_tokens: int) -> tuple[int, ...]:
        import torch

        ids = self.tokenizer()(prompt)["input_ids"]
        with torch.no_grad():
            out = self._load(adapter).generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        return tuple(out[0, len(ids) :].tolist())
