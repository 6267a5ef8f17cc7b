"""Hugging Face transformers + PEFT as the numerical oracle for the tiny test model (fp32, greedy)."""

from __future__ import annotations

from functools import lru_cache


class HFOracle:
    def __init__(self, model):
        self.model = model

    @lru_cache(maxsize=8)
    def _load(self, adapter: str | None):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        base = AutoModelForCausalLM.from_pretrained(self.model.base, dtype=torch.float32)
        m = PeftModel.from_pretrained(base, self.model.adapters[adapter]) if adapter else base
        return m.eval()

    @lru_cache(maxsize=1)
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model.base)

    def greedy(self, adapter: str | None, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        import torch

        m = self._load(adapter)
        with torch.no_grad():
            out = m.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None)
        return out[0, len(prompt_ids):].tolist()
