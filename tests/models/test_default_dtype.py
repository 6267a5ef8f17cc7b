"""Why configs/default.yaml serves SmolLM2 in float32: the README's demo prompt is a near-tie.

The first answer token of "What is the capital of France?" is "The" by less than one bf16 step of
the logits over "L", and "L" continues as "L'Etoile, la Marseillaise, ...". bf16 kernels that round
the other way (vLLM's CPU kernels on some CPUs) therefore answer that, while any fp32 engine keeps
the 0.1-logit lead. HF only, on the converted model.
"""

from __future__ import annotations

import pytest
import torch

QUESTION = "What is the capital of France?"
BF16_STEP_AT_16_TO_32 = 0.125  # bf16 has 8 significant bits: logits of 16-32 come in 1/8 steps


@pytest.fixture(scope="module")
def fp32_model(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return model, tok, ids


@torch.no_grad()
def test_first_answer_token_leads_the_runner_up_by_less_than_a_bf16_step(fp32_model):
    model, tok, ids = fp32_model
    logits = model(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2)
    assert [tok.decode([int(i)]) for i in top.indices] == ["The", "L"]
    assert 16 <= float(top.values[0]) < 32
    assert 0 < float(top.values[0] - top.values[1]) < BF16_STEP_AT_16_TO_32


@torch.no_grad()
def test_the_runner_up_is_the_french_answer(fp32_model):
    model, tok, ids = fp32_model
    runner_up = int(model(torch.tensor([ids])).logits[0, -1].topk(2).indices[1])
    out = model.generate(torch.tensor([ids + [runner_up]]), max_new_tokens=12, do_sample=False)
    assert tok.decode(out[0, len(ids) :]).startswith("L'Étoile, la Marseillaise")
