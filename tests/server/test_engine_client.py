"""vLLM's own completion serving (`OpenAIServingCompletion`, unchanged) generating through dlora's
router (`RouterEngineClient`), in process, over toy replicas (deterministic tokens:
dlora.sim.toy_replica.reference_tokens is the oracle): vLLM's defaults and response shapes, n > 1 as
separate routed legs with one prompt count in the usage, adapters by their public name, fields a
replica cannot carry yet refused with a 400 naming them, an unknown model a 404, and an abort ending
the request."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from vllm.entrypoints.serve import create_error_response
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.sampling_params import RequestOutputKind, SamplingParams

from dlora.app.state import build_state
from dlora.config import from_dict
from dlora.sim.toy_replica import ToyReplica, reference_tokens
from tests import harness

PROMPT = "def main():\n    return 1"


@contextlib.asynccontextmanager
async def serving(tiny_model, tmp_path, step_s: float = 0.001):
    """vLLM's completion serving over dlora's router on two toy replicas (the frontend a server
    builds, dlora.server.vllm_frontend)."""
    cfg = from_dict(harness.tiny_config(tiny_model, tmp_path / "state", 0, cluster={"num_replicas": 2}))
    state = await build_state(cfg, replicas=[ToyReplica(i, step_s=step_s) for i in range(2)])
    try:
        yield state.frontend.completion, state.frontend.client
    finally:
        await state.close()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.base)(PROMPT)["input_ids"]


def run(coro):
    return asyncio.run(coro)


async def answered(call):
    """What vLLM's server answers: the serving call's result, or its exception as the error
    response vLLM's exception handlers send."""
    try:
        return await call
    except Exception as e:
        return create_error_response(e)


def test_vllms_defaults_and_shape_with_n_legs_counted_once(tiny_model, tmp_path, prompt_ids):
    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            req = CompletionRequest(model="tiny-base", prompt=PROMPT, n=2, seed=3)  # no max_tokens
            return await completion.create_completion(req)

    resp = run(go())
    assert isinstance(resp, CompletionResponse), resp
    want = reference_tokens(None, tuple(prompt_ids), 16)  # vLLM's (and OpenAI's) default max_tokens
    assert [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        assert c.text == "".join(f"<{t}>" for t in want) and c.finish_reason == "length"
    assert resp.model == "tiny-base"
    assert resp.usage.prompt_tokens == len(prompt_ids)  # once, however many choices
    assert resp.usage.completion_tokens == 2 * 16


def test_an_adapter_is_served_under_its_public_name(tiny_model, tmp_path, prompt_ids):
    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            req = CompletionRequest(model="a1", prompt=PROMPT, max_tokens=5, return_token_ids=True)
            return await completion.create_completion(req)

    resp = run(go())
    assert isinstance(resp, CompletionResponse), resp
    assert resp.model == "a1"
    assert resp.choices[0].token_ids == reference_tokens("a1", tuple(prompt_ids), 5)


def test_a_stream_of_two_choices_finishes_each_and_counts_the_prompt_once(tiny_model, tmp_path, prompt_ids):
    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            req = CompletionRequest(
                model="a2", prompt=PROMPT, n=2, max_tokens=4, stream=True, stream_options={"include_usage": True}
            )
            stream = await completion.create_completion(req)
            return [chunk async for chunk in stream]

    chunks = [json.loads(c[len("data: ") :]) for c in run(go()) if c.startswith("data: {")]
    text = {0: "", 1: ""}
    finished = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            text[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finished[choice["index"]].append(choice["finish_reason"])
    want = "".join(f"<{t}>" for t in reference_tokens("a2", tuple(prompt_ids), 4))
    assert text == {0: want, 1: want}
    assert finished == {0: ["length"], 1: ["length"]}
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == 8


@pytest.mark.parametrize(
    "field, fields",
    [
        ("logprob_token_ids", {"logprob_token_ids": [1, 2], "logprobs": 1}),
    ],
)
def test_a_field_replicas_cannot_carry_yet_is_a_400_naming_it(tiny_model, tmp_path, field, fields):
    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            req = CompletionRequest(model="tiny-base", prompt=PROMPT, max_tokens=2, **fields)
            return await answered(completion.create_completion(req))

    resp = run(go())
    assert isinstance(resp, ErrorResponse), resp
    assert resp.error.code == 400 and resp.error.param == field and f"`{field}`" in resp.error.message


def test_an_unknown_model_is_a_404(tiny_model, tmp_path):
    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            return await completion.create_completion(CompletionRequest(model="nobody", prompt=PROMPT))

    resp = run(go())
    assert isinstance(resp, ErrorResponse) and resp.error.code == 404 and resp.error.param == "model"


def test_abort_ends_every_leg_with_finish_reason_abort(tiny_model, tmp_path, prompt_ids):
    async def go():
        async with serving(tiny_model, tmp_path, step_s=0.05) as (_, client):
            params = SamplingParams(n=2, max_tokens=200, output_kind=RequestOutputKind.DELTA)
            outputs = []
            async for out in client.generate({"prompt_token_ids": prompt_ids}, params, "r1"):
                outputs.append(out)
                if len(outputs) == 3:
                    await client.abort("r1")
            return outputs

    outputs = run(go())
    last = outputs[-1]
    assert last.finished and sorted(o.index for o in last.outputs) == [0, 1]
    assert {o.finish_reason for o in last.outputs} == {"abort"}
    generated = sum(len(o.token_ids) for out in outputs for o in out.outputs)
    assert 3 <= generated < 400  # stopped long before either leg's 200 tokens
    assert not any(out.finished for out in outputs[:-1])


NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


def test_a_trusted_template_that_renders_too_long_is_a_400_and_the_server_goes_on(tiny_model, tmp_path):
    cfg = from_dict(
        harness.tiny_config(
            tiny_model,
            tmp_path / "state",
            0,
            server={"trust_request_chat_template": True, "template_timeout_s": 0.5},
        )
    )
    messages = [{"role": "user", "content": "hi"}]

    async def go():
        state = await build_state(cfg, replicas=[ToyReplica(0, step_s=0.001)])
        chat = state.frontend.chat
        try:
            looping = ChatCompletionRequest(model="tiny-base", messages=messages, chat_template=NESTED_LOOPS)
            refused = await answered(chat.create_chat_completion(looping))
            # The stuck render thread does not hold up the next request.
            ok = await asyncio.wait_for(
                chat.create_chat_completion(ChatCompletionRequest(model="tiny-base", messages=messages, max_tokens=2)),
                30,
            )
            return refused, ok
        finally:
            await state.close()

    refused, ok = run(go())
    assert isinstance(refused, ErrorResponse) and refused.error.code == 400 and refused.error.param == "messages"
    assert "0.5 s" in refused.error.message
    assert isinstance(ok, ChatCompletionResponse) and ok.choices[0].finish_reason == "length"


def test_a_chat_stream_sends_the_role_with_the_first_token(tiny_model, tmp_path):
    """vLLM's chat stream: no chunk before the engine has produced something, so a client's
    time to first token is the engine's."""

    async def go():
        cfg = from_dict(harness.tiny_config(tiny_model, tmp_path / "state2", 0))
        state = await build_state(cfg, replicas=[ToyReplica(0, step_s=0.2)])
        try:
            req = ChatCompletionRequest(
                model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
            )
            stream = await state.frontend.chat.create_chat_completion(req)
            t0 = asyncio.get_running_loop().time()
            first = await stream.__anext__()
            waited = asyncio.get_running_loop().time() - t0
            rest = [c async for c in stream]
            return first, waited, rest
        finally:
            await state.close()

    first, waited, rest = run(go())
    chunk = json.loads(first[len("data: ") :])
    assert chunk["choices"][0]["delta"]["role"] == "assistant"
    assert waited >= 0.15  # the toy replica's first step (0.2 s) came first
    assert rest[-1].strip() == "data: [DONE]"


def test_the_servers_chat_template_and_tool_parser_are_vllms_options(tiny_model, tmp_path, prompt_ids):
    """server.chat_template (vLLM's --chat-template) renders every chat; a tool parser with auto tool
    choice lets a chat carry tools."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    server = {"chat_template": template, "tool_call_parser": "hermes", "enable_auto_tool_choice": True}
    cfg = from_dict(harness.tiny_config(tiny_model, tmp_path / "state", 0, server=server))
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}

    async def go():
        state = await build_state(cfg, replicas=[ToyReplica(0, step_s=0.001)])
        try:
            tokens = await state.frontend.tokenization.create_tokenize(
                TokenizeChatRequest(model="a0", messages=messages, add_special_tokens=False), None
            )
            chat = await state.frontend.chat.create_chat_completion(
                ChatCompletionRequest(model="a0", messages=messages, max_tokens=3, tools=[tool], tool_choice="auto")
            )
            return tokens, chat
        finally:
            await state.close()

    tokens, chat = run(go())
    want = AutoTokenizer.from_pretrained(tiny_model.base)("[user] hi\n", add_special_tokens=False)["input_ids"]
    assert tokens.tokens == want
    assert isinstance(chat, ChatCompletionResponse), chat
    assert chat.choices[0].message.content == "".join(f"<{t}>" for t in reference_tokens("a0", tuple(want), 3))


def test_the_adapter_map_vllm_reads_is_a_view_of_the_registry(tiny_model, tmp_path):
    """vLLM looks adapters up by name in `lora_requests`: one lookup each, and an adapter
    unregistered or registered later is seen at once."""

    async def go():
        async with serving(tiny_model, tmp_path) as (completion, _):
            requests = completion.models.lora_requests
            registry = completion.models._adapters.registry
            seen = ("a1" in requests, "nobody" in requests, list(requests), len(requests))
            a1 = requests["a1"]
            with pytest.raises(KeyError):
                requests["nobody"]
            registry.remove("a1")
            return seen, a1, "a1" in requests, len(requests)

    (has_a1, has_nobody, names, count), a1, still, after = run(go())
    assert (has_a1, has_nobody, names, count) == (True, False, ["a0", "a1", "a2"], 3)
    assert (a1.lora_name, a1.lora_int_id) == ("a1", 2)
    assert (still, after) == (False, 2)
