"""`/v1/responses` is vLLM's own (its OpenAIServingResponses and route functions, mounted on dlora's
app), for the base model and every adapter dlora serves, with the official `openai` client:
non-streamed and streamed, the prompt rendered with the model's chat template, and vLLM's default of
storing nothing (a stored response is never found; background mode is refused).

The HTTP layer runs on the shared server over toy replicas (tests/toy_serve.py: the real app, config
and tokenizer; `reference_tokens` is what a toy replica generates); what the model generates is
checked on the tiny model's real engine against the same conversation through /v1/chat/completions."""

from __future__ import annotations

import httpx
import openai
import pytest

from dlora.sim.toy_replica import reference_tokens
from tests import harness

pytestmark = pytest.mark.engine  # `dlora serve` processes (over toy replicas, and the tiny model's engine)

AUTH = {"Authorization": f"Bearer {harness.TOY_API_KEY}"}
TEXT = "Write a haiku about rivers."
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    """The ids of TEXT as one user turn, rendered with the model's chat template (HF's own rendering)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.base)
    messages = [{"role": "user", "content": TEXT}]
    return tuple(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def client(server, api_key: str = harness.TOY_API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


def toy_text(model: str, prompt_ids: tuple[int, ...]) -> str:
    """What a toy replica answers for the prompt, as text."""
    adapter = None if model == "tiny-base" else model
    return "".join(f"<{t}>" for t in reference_tokens(adapter, prompt_ids, MAX_TOKENS))


@pytest.mark.parametrize("model", ["tiny-base", "a1"])
def test_a_response_renders_the_chat_template_and_answers_in_vllms_shape(toy_server, prompt_ids, model):
    resp = client(toy_server).responses.create(model=model, input=TEXT, max_output_tokens=MAX_TOKENS)
    assert resp.object == "response" and resp.model == model and resp.id.startswith("resp_")
    # The prompt is the chat template's rendering as chat tokenizes it (one BOS; vLLM 0.32 adds another).
    assert resp.output_text == toy_text(model, prompt_ids)
    assert [(item.type, item.role) for item in resp.output] == [("message", "assistant")]
    # Cut at max_output_tokens: OpenAI's "incomplete", saying why.
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (len(prompt_ids), MAX_TOKENS)


@pytest.mark.parametrize("model", ["tiny-base", "a1"])
def test_a_streamed_response_gives_the_text_as_deltas_then_the_whole_response(toy_server, prompt_ids, model):
    events = list(
        client(toy_server).responses.create(model=model, input=TEXT, max_output_tokens=MAX_TOKENS, stream=True)
    )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == MAX_TOKENS  # one per token: the stream is not buffered
    final = events[-1].response
    assert "".join(deltas) == final.output_text == toy_text(model, prompt_ids)
    assert final.model == model and final.usage.output_tokens == MAX_TOKENS
    assert {e.response.id for e in events if hasattr(e, "response")} == {final.id}


def test_the_request_id_is_the_servers(toy_server):
    """The router keys requests by this id: a client's own `request_id` must not name its request."""
    body = {"model": "a0", "input": TEXT, "max_output_tokens": 2, "request_id": "resp_mine"}
    headers = AUTH | {"X-Request-Id": "mine"}
    answers = [httpx.post(f"{toy_server.url}/v1/responses", json=body, headers=headers, timeout=60) for _ in range(2)]
    ids = [r.json()["id"] for r in answers]
    assert "resp_mine" not in ids and len(set(ids)) == 2 and all(i.startswith("resp_") for i in ids)
    # the id the response carries is the one the server's header names, as for completions
    assert [r.headers["x-request-id"] for r in answers] == ids


def test_nothing_is_stored_as_vllms_server_by_default(toy_server):
    """vLLM without VLLM_ENABLE_RESPONSES_API_STORE: `store: true` is answered and not kept, so the
    response is never found (its 404), background mode is a 400, and there is no DELETE route."""
    c = client(toy_server)
    resp = c.responses.create(model="a1", input=TEXT, max_output_tokens=2, store=True)
    assert resp.status == "incomplete"
    for call in (lambda: c.responses.retrieve(resp.id), lambda: c.responses.cancel(resp.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body == {
            "message": f"Response with id '{resp.id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    r = httpx.delete(f"{toy_server.url}/v1/responses/{resp.id}", headers=AUTH, timeout=30)
    assert r.status_code == 405, r.text
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="a1", input=TEXT, max_output_tokens=2, background=True)
    assert e.value.body["param"] == "background" and "VLLM_ENABLE_RESPONSES_API_STORE" in e.value.body["message"]


def test_an_unknown_model_is_a_404_and_the_api_key_guards_every_route(toy_server):
    with pytest.raises(openai.NotFoundError) as e:
        client(toy_server).responses.create(model="nobody", input=TEXT, max_output_tokens=2)
    assert e.value.body["param"] == "model"
    wrong = client(toy_server, api_key="wrong-key")
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="a1", input=TEXT, max_output_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.retrieve("resp_x")
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.cancel("resp_x")


def test_an_adapters_greedy_response_is_its_chat_completion(tiny_server):
    """The Responses API renders the same conversation with the same chat template as chat: at
    temperature 0 the real engine gives the same text, streamed or not."""
    c = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)
    chat = c.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": TEXT}], max_tokens=MAX_TOKENS, temperature=0
    )
    resp = c.responses.create(model="a1", input=TEXT, max_output_tokens=MAX_TOKENS, temperature=0)
    assert resp.output_text == chat.choices[0].message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat.usage.prompt_tokens, MAX_TOKENS)
    stream = c.responses.create(model="a1", input=TEXT, max_output_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == resp.output_text
