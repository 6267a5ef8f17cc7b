"""Hugging Face transformers + PEFT as the numerical oracle for the tiny test model (fp32, greedy)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml


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
            out = m.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        return out[0, len(prompt_ids) :].tolist()


# --- Teacher-forced scoring: HF's logits along a path the server already chose ----------------
#
# Comparing greedy token ids alone stops at the first near-tie (either token is right there, and
# everything after may differ). Scoring the *served* path instead makes every position comparable:
# one HF forward pass over prompt + served tokens gives the logits each served token was chosen
# from, whatever happened before. Ties then only relax "the served token is HF's argmax".

SHIPPED_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def shipped_config(tmp: Path, **overrides) -> dict:
    """configs/default.yaml with absolute paths, a free port, a throw-away state dir and one replica;
    `overrides` as in harness.tiny_config ("section.key": value, or "section": {...})."""
    from tests import harness

    cfg = yaml.safe_load(SHIPPED_CONFIG.read_text())
    here = SHIPPED_CONFIG.parent
    cfg["server"].update(
        port=harness.free_port(),
        state_dir=str(tmp / "state"),
        adapter_roots=[str((here / r).resolve()) for r in cfg["server"]["adapter_roots"]],
    )
    cfg["cluster"]["num_replicas"] = 1  # one engine: the answers do not depend on the replica
    for spec in cfg["adapters"]:
        spec["path"] = str((here / spec["path"]).resolve())
    return harness.apply_overrides(cfg, overrides)


def shipped_adapters() -> dict[str, Path]:
    cfg = yaml.safe_load(SHIPPED_CONFIG.read_text())
    return {a["name"]: (SHIPPED_CONFIG.parent / a["path"]).resolve() for a in cfg["adapters"]}


class ShippedOracle:
    """HF (+ PEFT) on the shipped model directory, in `dtype` (fp32 unless said: the reference for
    every served dtype, the exact answer lower precisions round); one model object per adapter and
    the logits of every path scored, cached, so the modules that share one oracle load each model once."""

    def __init__(self, dtype: str = "float32"):
        from dlora.models.smollm2 import resolve_model_path

        cfg = yaml.safe_load(SHIPPED_CONFIG.read_text())
        self.model_dir = resolve_model_path(cfg["model"]["path"])
        self.served_name = cfg["model"]["served_name"]
        self.dtype = dtype
        self.adapters = shipped_adapters()
        self._models: dict = {}
        self._logits: dict = {}
        self._tok = None

    def tokenizer(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tok

    def model(self, adapter: str | None):
        if adapter not in self._models:
            import torch
            from peft import PeftModel
            from transformers import AutoModelForCausalLM

            torch.set_num_threads(1)  # the other core serves
            m = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, self.dtype))
            if adapter is not None:
                m = PeftModel.from_pretrained(m, self.adapters[adapter])
            self._models[adapter] = m.eval()
        return self._models[adapter]

    def chat_ids(self, text: str) -> list[int]:
        return self.tokenizer().apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]

    def logits(self, adapter: str | None, prompt_ids: list[int], output_ids: list[int]):
        """teacher_forced_logits under `adapter`; a copy, so that a caller may mask it in place."""
        key = (adapter, tuple(prompt_ids), tuple(output_ids))
        if key not in self._logits:
            self._logits[key] = teacher_forced_logits(self.model(adapter), prompt_ids, output_ids)
        return self._logits[key].clone()


def teacher_forced_logits(model, prompt_ids: list[int], output_ids: list[int]):
    """[len(output_ids), vocab] float32: row i holds the logits output_ids[i] was chosen from."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(output_ids)]


def token_pieces(tokenizer, ids) -> list[str]:
    """Each id's text as the server names it in logprobs (vLLM decodes every id on its own)."""
    return [tokenizer.decode([int(i)]) for i in ids]


def greedy_choice_errors(logits, output_ids: list[int], tie: float) -> list[tuple[int, int, float]]:
    """(step, token, shortfall) wherever a served token is not HF's argmax by more than `tie`: a
    greedy decoder may pick either of two tokens closer than its dtype's noise, no other."""
    errors = []
    for step, (row, token) in enumerate(zip(logits, output_ids)):
        shortfall = float(row.max() - row[token])
        if shortfall > tie:
            errors.append((step, token, shortfall))
    return errors


def top_k_errors(tok, hf_lp, served_top: dict[str, float], k: int, tol: float) -> tuple[list[str], float]:
    """Every served alternative is one of HF's with HF's logprob (within tol), and every token HF
    ranks clearly inside its top-k (above its (k+1)-th by more than tol) is served. Tokens are
    matched by text, as the API names them; two ids with the same text may answer for each other."""
    values, ids = hf_lp.topk(k + 5)
    hf = list(zip(token_pieces(tok, ids), values.tolist()))
    errors, worst = [], 0.0
    for piece, value in served_top.items():
        diffs = [abs(v - value) for p, v in hf if p == piece]
        if not diffs or min(diffs) > tol:
            errors.append(f"served {piece!r}={value:.5f}, HF {[(p, round(v, 5)) for p, v in hf if p == piece]}")
        worst = max(worst, min(diffs, default=0.0))
    cutoff = hf[k][1] + tol
    errors += [f"HF top-{k} {p!r}={v:.5f} not served" for p, v in hf[:k] if v > cutoff and p not in served_top]
    return errors, worst
