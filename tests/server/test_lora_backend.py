"""`engine.lora_backend: einsum` in a real server: dlora's einsum kernels run every LoRA linear, and
greedy token ids equal HF + PEFT (fp32), alone and in one concurrent batch mixing the base model
with three adapters while max_loras=2 makes the engine swap adapters between slots.

The default backend (`vllm`) is held to the same HF + PEFT ids on the same prompts by
test_openai_api.py, so equal ids here are equal to the default backend's. The server is
`einsum_server` (tests/conftest.py), shared with the hostile-adapter tests; the log proves the
einsum wrapper is the one vLLM built and that it ran.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server.test_openai_api import MAX_TOKENS, PROMPTS, complete

pytestmark = pytest.mark.engine  # a `dlora serve` process

MODELS = ["tiny-base", "a0", "a1", "a2"]


def _adapter(model: str) -> str | None:
    return None if model == "tiny-base" else model


@pytest.mark.parametrize("model", MODELS)
def test_greedy_ids_equal_hf_peft(einsum_server, oracle, model):
    for prompt in PROMPTS[:2]:
        choice = complete(einsum_server.url, model=model, prompt=prompt)["choices"][0]
        assert choice["token_ids"] == oracle.greedy(_adapter(model), choice["prompt_token_ids"], MAX_TOKENS)


def test_concurrent_mixed_batch_equals_hf_peft(einsum_server, oracle):
    """Base + a0, a1, a2 in flight at once (max_loras=2: adapters swap slots between steps)."""
    jobs = [(m, p) for m in MODELS for p in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        choices = list(
            pool.map(lambda job: complete(einsum_server.url, model=job[0], prompt=job[1])["choices"][0], jobs)
        )
    for (model, _), choice in zip(jobs, choices):
        assert choice["token_ids"] == oracle.greedy(_adapter(model), choice["prompt_token_ids"], MAX_TOKENS), model


def test_the_einsum_wrapper_is_the_one_in_use(einsum_server):
    complete(einsum_server.url, model="a1", prompt=PROMPTS[3])  # at least one LoRA batch has run
    built = "Using PunicaWrapperEinsum"  # vLLM's selector, at model load
    ran = "dlora LoRA backend einsum (PunicaWrapperEinsum) applies its first LoRA batch"
    deadline = time.monotonic() + 20  # Ray forwards worker logs to the driver asynchronously
    while True:
        log = einsum_server.log_path.read_text(errors="replace")
        if (built in log and ran in log) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert built in log, einsum_server.tail()
    assert ran in log, einsum_server.tail()
    assert "Using PunicaWrapperCPU" not in log
