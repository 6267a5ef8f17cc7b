"""configs/default.yaml as shipped answers like Hugging Face does, in the dtype it ships.

The server (`shipped_server` in tests/conftest.py, shared with other tests) runs the shipped file
(its `auto:` model, its dtype, its chat template, its adapters) with only a free port, a throw-away
state dir and one replica; it is asked as the README asks it, through the chat endpoint. The oracle
is HF transformers (+ PEFT for the demo adapters) on the same converted model directory, in the
same dtype, scoring the served path (tests/oracle.py): one forward pass over the prompt and the
served tokens gives the logits each served token was chosen from.

A greedy server may pick either of two tokens whose logits are closer than the dtype's noise, and
continue differently from there; scoring the served path keeps every later step comparable, so
each served token must be HF's argmax up to such a near-tie.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests.oracle import ShippedOracle, greedy_choice_errors

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


@pytest.fixture(scope="module")
def shipped():
    return yaml.safe_load(CONFIG.read_text())


@pytest.fixture(scope="module")
def oracle_in_shipped_dtype(shipped, shipped_oracle):
    """The shared fp32 oracle when the config ships fp32 (its models and scores are then reused)."""
    dtype = shipped["model"]["dtype"]
    return shipped_oracle if dtype == shipped_oracle.dtype else ShippedOracle(dtype)


def served_chat(server, model: str, prompt: str) -> dict:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=300,
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_default_config_ships_a_dtype_with_a_tie_tolerance(shipped):
    assert shipped["model"]["dtype"] in NEAR_TIE


@pytest.mark.engine
@pytest.mark.parametrize("adapter", [None, "upper", "json", "pirate"], ids=["base", "upper", "json", "pirate"])
def test_chat_answers_are_hf_greedy_in_the_shipped_dtype(shipped_server, oracle_in_shipped_dtype, shipped, adapter):
    oracle = oracle_in_shipped_dtype
    near_tie = NEAR_TIE[shipped["model"]["dtype"]]
    compared = 0
    for prompt in PROMPTS:
        resp = served_chat(shipped_server, adapter or shipped["model"]["served_name"], prompt)
        prompt_ids, choice = resp["prompt_token_ids"], resp["choices"][0]
        ids = choice["token_ids"]
        assert prompt_ids == oracle.chat_ids(prompt)  # the server applied the model's own chat template
        assert choice["finish_reason"] == "stop" or len(ids) == MAX_TOKENS, choice
        logits = oracle.logits(adapter, prompt_ids, ids)
        assert greedy_choice_errors(logits, ids, near_tie) == [], (prompt, ids)
        compared += len(ids)
    assert compared >= len(PROMPTS) * 8, compared  # answers long enough to compare something
