"""`/tokenize` and `/detokenize` are vLLM's own (its ServingTokenization, mounted on dlora's app), for
the base model and every adapter dlora serves: ids equal the model's tokenizer, a chat request is
rendered with the model's chat template, and bad requests are vLLM's 4xx in OpenAI's shape.

No engine is involved, so the server is the shared one over toy replicas (tests/toy_serve.py: the
real app, config and tokenizer)."""

from __future__ import annotations

import httpx
import pytest

from tests import harness

pytestmark = pytest.mark.engine  # a `dlora serve` process (over toy replicas)

PROMPT = "def main():\n    return 1"


@pytest.fixture
def server(toy_server):
    """The shared toy server (tests/conftest.py): it has an API key, which these routes do not need."""
    return toy_server


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.base)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("model", ["tiny-base", "a1"])
def test_tokenize_gives_the_models_token_ids(server, tokenizer, model):
    r = post(server, "/tokenize", {"model": model, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tokenizer(PROMPT)["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == 512  # harness.tiny_config's
    r = post(server, "/tokenize", {"model": model, "prompt": PROMPT, "add_special_tokens": False})
    assert r.json()["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


def test_tokenize_renders_messages_with_the_models_chat_template(server, tokenizer):
    messages = [{"role": "user", "content": "Hello there"}]
    r = post(server, "/tokenize", {"model": "a0", "messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert r.json()["tokens"] == want["input_ids"]


def test_detokenize_returns_the_text_of_the_ids(server, tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    r = post(server, "/detokenize", {"model": "a2", "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == PROMPT


def test_an_unknown_model_is_a_404_naming_the_field(server):
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1, 2]})]:
        r = post(server, path, {"model": "nobody", **body})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["type"] == "NotFoundError" and err["param"] == "model" and "`nobody`" in err["message"]


def test_an_adapter_registered_after_start_is_known_at_once(server, tiny_model):
    """The registry is read at each request, not copied at start."""
    assert post(server, "/tokenize", {"model": "late", "prompt": "x"}).status_code == 404
    body = {"lora_name": "late", "lora_path": str(tiny_model.adapters["a3"])}  # a3: not in the config
    admin = {"Authorization": f"Bearer {harness.TOY_API_KEY}"}  # no admin token: the API key guards /v1
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    try:
        assert post(server, "/tokenize", {"model": "late", "prompt": "x"}).status_code == 200
    finally:
        httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=admin, timeout=60)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/tokenize", {"model": "tiny-base"}),  # neither prompt nor messages
        ("/tokenize", {"model": "tiny-base", "prompt": 5}),
        ("/detokenize", {"model": "tiny-base", "tokens": ["a"]}),
        ("/detokenize", {"model": "tiny-base", "tokens": [10**30]}),
        ("/tokenize", {"model": "tiny-base", "messages": "hi"}),
    ],
    ids=["no-prompt", "prompt-number", "tokens-strings", "token-huge", "messages-string"],
)
def test_bad_bodies_are_4xx_in_openai_shape(server, path, body):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == r.status_code and err["message"]
    assert "Traceback" not in r.text and ".py" not in r.text
