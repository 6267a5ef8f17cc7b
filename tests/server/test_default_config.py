"""configs/default.yaml as shipped answers like Hugging Face does, in the dtype it ships.

The server (`shipped_server` in tests/conftest.py, shared with other tests) runs the shipped file
(its `auto:` model, its dtype, its adapters) with only a free port, a throw-away state dir and one
replica. The oracle is HF transformers (+ PEFT for the demo adapters) on the same converted model
directory, in the same dtype, greedy, on the same prompt token ids.

A greedy comparison is only meaningful while the oracle's choice is clear: where HF's own top-2
logits are closer than the dtype's noise, either token is a correct answer and everything after
it may differ. So each answer is compared up to and including the first such near-tie step of HF.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
PROMPTS = (
    "What is the capital of France?",  # the demo prompt of the README
    "Write a short greeting for a friend.",
    "How do I boil an egg?",
)
MAX_TOKENS = 24
# A top-2 logit gap below this is a tie for the dtype. fp32 kernels differ from HF's by ~1e-4 in
# the logits. bf16 logits of 16-32 come in steps of 0.125, so two bf16 steps are a tie; fp16's
# steps there are 1/64. (In bf16 the France prompt's first token is such a tie: "The" leads "L" by
# 0.098 in fp32, and kernels that round the other way answer "L'Etoile, la Marseillaise, ...".)
NEAR_TIE = {"float32": 1e-2, "bfloat16": 0.3, "float16": 0.05}


@dataclass
class Greedy:
    token_ids: list[int]
    margins: list[float]  # HF's top-1 minus top-2 logit at each step

    def compared_length(self, near_tie: float) -> int:
        """Steps that must match: up to and including the first near-tie (its token is still the
        prompt's and the steps before are unambiguous), the whole answer if there is none."""
        for i, gap in enumerate(self.margins):
            if gap < near_tie:
                return i + 1
        return len(self.token_ids)


def hf_greedy(model, prompt_ids: list[int], max_tokens: int, eos_id: int) -> Greedy:
    """Greedy decoding by hand, recording each step's top-2 gap (generate() does not give it)."""
    import torch

    ids, margins, past = torch.tensor([prompt_ids]), [], None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            top = step.logits[0, -1].float().topk(2)
            token = int(top.indices[0])
            out.append(token)
            margins.append(float(top.values[0] - top.values[1]))
            if token == eos_id:
                break
            ids = torch.tensor([[token]])
    return Greedy(out, margins)


@pytest.fixture(scope="module")
def shipped():
    return yaml.safe_load(CONFIG.read_text())


@pytest.fixture(scope="module")
def oracle_answers(shipped):
    """HF (+ PEFT) greedy answers for every served model and prompt, in the shipped dtype."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlora.models.smollm2 import resolve_model_path

    torch.set_num_threads(1)  # the other core serves
    model_dir = resolve_model_path(shipped["model"]["path"])
    dtype = getattr(torch, shipped["model"]["dtype"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = {
        p: tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for p in PROMPTS
    }
    adapters = {None: None} | {a["name"]: (CONFIG.parent / a["path"]).resolve() for a in shipped["adapters"]}
    answers = {}
    for name, path in adapters.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if path is not None:
            model = PeftModel.from_pretrained(model, path)
        model.eval()
        for p, ids in prompts.items():
            answers[name, p] = (ids, hf_greedy(model, ids, MAX_TOKENS, tok.eos_token_id))
    return answers


def served_greedy(server, model: str, prompt_ids: list[int]) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        timeout=300,
        json={
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_comparison_stops_at_the_first_near_tie():
    answer = Greedy([5, 6, 7, 8], [3.0, 0.004, 2.0, 0.001])
    assert answer.compared_length(1e-2) == 2
    assert Greedy([5, 6], [3.0, 2.0]).compared_length(1e-2) == 2


def test_default_config_ships_a_dtype_with_a_tie_tolerance(shipped):
    assert shipped["model"]["dtype"] in NEAR_TIE


@pytest.mark.engine
@pytest.mark.parametrize("adapter", [None, "upper", "json", "pirate"], ids=["base", "upper", "json", "pirate"])
def test_greedy_answers_match_hf_in_the_shipped_dtype(shipped_server, oracle_answers, shipped, adapter):
    model = adapter or shipped["model"]["served_name"]
    near_tie = NEAR_TIE[shipped["model"]["dtype"]]
    compared = 0
    for prompt in PROMPTS:
        ids, hf = oracle_answers[adapter, prompt]
        n = hf.compared_length(near_tie)
        got = served_greedy(shipped_server, model, ids)
        assert got[:n] == hf.token_ids[:n], (prompt, got, hf.token_ids, n)
        compared += n
    # The tie rule must not quietly compare nothing: most of each answer is unambiguous.
    assert compared >= len(PROMPTS) * 8, compared
