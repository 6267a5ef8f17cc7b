"""The OpenAI API of a real server on the tiny model, checked against HF + PEFT (fp32, greedy)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.conftest import ADMIN_TOKEN

PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]
MAX_TOKENS = 12


def usage(body: dict) -> dict:
    """A response's token counts: its usage without the fields vLLM sends as null, and without
    `prompt_tokens_details`, which vLLM's completion stream writes where its whole response leaves
    it null (nothing cached); tests/server/test_vllm_parity.py holds both to vLLM's."""
    return {k: v for k, v in body["usage"].items() if v is not None and k != "prompt_tokens_details"}


def complete(url, **body):
    body = {"temperature": 0, "max_tokens": MAX_TOKENS, "return_token_ids": True} | body
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["tiny-base", "a0", "a1", "a2"])
def test_greedy_ids_equal_hf_peft(tiny_server, oracle, model):
    adapter = None if model == "tiny-base" else model
    for prompt in PROMPTS[:2]:
        choice = complete(tiny_server.url, model=model, prompt=prompt)["choices"][0]
        assert choice["prompt_token_ids"] == oracle.tokenizer()(prompt)["input_ids"]
        assert choice["token_ids"] == oracle.greedy(adapter, choice["prompt_token_ids"], MAX_TOKENS)


def test_adapters_change_the_output(tiny_server):
    outs = {
        m: complete(tiny_server.url, model=m, prompt=PROMPTS[0])["choices"][0]["token_ids"]
        for m in ["tiny-base", "a0", "a1", "a2"]
    }
    assert len({tuple(v) for v in outs.values()}) == 4


def test_concurrent_mixed_batch_equals_hf_peft(tiny_server, oracle):
    """Base + 3 adapters in flight at once (max_loras=2 forces the engine to juggle slots)."""
    jobs = [(m, p) for m in ["tiny-base", "a0", "a1", "a2"] for p in PROMPTS]

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:

            async def one(m, p):
                r = await c.post(
                    f"{tiny_server.url}/v1/completions",
                    json={
                        "model": m,
                        "prompt": p,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "return_token_ids": True,
                    },
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            return await asyncio.gather(*(one(m, p) for m, p in jobs))

    for (model, _), choice in zip(jobs, asyncio.run(run())):
        adapter = None if model == "tiny-base" else model
        assert choice["token_ids"] == oracle.greedy(adapter, choice["prompt_token_ids"], MAX_TOKENS), model


def sse_events(url, path, body):
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_reassembles_to_the_whole_text(tiny_server):
    body = {"model": "a1", "prompt": PROMPTS[2], "max_tokens": 20, "temperature": 0}
    whole = complete(tiny_server.url, **body)
    chunks = sse_events(
        tiny_server.url, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert (
        usage(chunks[-1])
        == usage(whole)
        == {
            "prompt_tokens": len(whole["choices"][0]["prompt_token_ids"]),
            "completion_tokens": 20,
            "total_tokens": whole["usage"]["total_tokens"],
        }
    )
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}


def test_chat_stream_reassembles_and_matches_hf(tiny_server, oracle):
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "a2", "messages": messages, "max_tokens": 10, "temperature": 0}
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body | {"return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["object"] == "chat.completion"
    prompt_ids = oracle.tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = oracle.tokenizer()(prompt_ids, add_special_tokens=False)["input_ids"]
    assert whole["prompt_token_ids"] == prompt_ids
    assert whole["choices"][0]["token_ids"] == oracle.greedy("a2", prompt_ids, 10)
    chunks = sse_events(tiny_server.url, "/v1/chat/completions", body | {"stream": True})
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_streamed_n_2_sends_both_indices_each_to_its_finish(tiny_server):
    body = {"model": "a0", "prompt": PROMPTS[1], "max_tokens": 9, "n": 2, "temperature": 2.0, "seed": 3}
    whole = complete(tiny_server.url, **body)["choices"]
    chunks = sse_events(tiny_server.url, "/v1/completions", body | {"stream": True})
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            finishes[choice["index"]].append(choice["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in whole}  # each index its own seeded sample
    for index in (0, 1):  # one finish per index, on its last chunk
        assert finishes[index][-1] == "length" and set(finishes[index][:-1]) <= {None}, finishes


def test_chat_stream_include_usage_ends_with_a_usage_chunk(tiny_server):
    body = {"model": "a1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "temperature": 0}
    whole = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body, timeout=120).json()
    chunks = sse_events(
        tiny_server.url, "/v1/chat/completions", body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["choices"] == [] and usage(chunks[-1]) == usage(whole)
    assert whole["usage"]["completion_tokens"] == 7
    assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 7
    assert all(c.get("usage") is None for c in chunks[:-1])  # only the last chunk carries it
    plain = sse_events(tiny_server.url, "/v1/chat/completions", body | {"stream": True})
    assert all(c.get("usage") is None for c in plain)


def test_a_prompt_at_the_context_limit_is_served_one_more_gets_what_room_is_left_and_past_it_is_400(tiny_server):
    """vLLM's rule: max_tokens is cut to the room the context leaves; a prompt beyond the context is
    a 400."""
    max_model_len, max_tokens = 512, 8  # tests/harness.tiny_config
    fits = [11] * (max_model_len - max_tokens)
    choice = complete(tiny_server.url, model="a2", prompt=fits, max_tokens=max_tokens, ignore_eos=True)["choices"][0]
    assert len(choice["token_ids"]) == max_tokens and choice["finish_reason"] == "length"
    over = complete(tiny_server.url, model="a2", prompt=[*fits, 11], max_tokens=max_tokens, ignore_eos=True)
    assert len(over["choices"][0]["token_ids"]) == max_tokens - 1 and over["choices"][0]["finish_reason"] == "length"
    assert over["usage"]["total_tokens"] == max_model_len
    r = httpx.post(
        f"{tiny_server.url}/v1/completions",
        json={"model": "a2", "prompt": [11] * (max_model_len + 1), "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and "512" in err["message"], err


def test_n_seed_logprobs_and_stop(tiny_server):
    url = tiny_server.url
    # The tiny model's logits are very peaked (decisive greedy tests), so sample hot to see variety.
    sampled = dict(model="a0", prompt=PROMPTS[0], n=3, temperature=2.0, seed=7, logprobs=2, max_tokens=16)
    r = complete(url, **sampled)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 48
    assert len({tuple(c["token_ids"]) for c in r["choices"]}) > 1  # distinct samples
    again = complete(url, **sampled)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in r["choices"]]  # seeded
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 16
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"])  # top-2 plus the sampled token

    greedy = complete(url, model="a0", prompt=PROMPTS[0], max_tokens=12)["choices"][0]["text"]
    stop = greedy[3:6]
    stopped = complete(url, model="a0", prompt=PROMPTS[0], max_tokens=12, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["text"] == greedy[: greedy.index(stop)]


def test_batch_of_prompts_and_token_prompt(tiny_server):
    r = complete(tiny_server.url, model="a1", prompt=PROMPTS[:3])  # greedy: n > 1 would need sampling
    assert [c["index"] for c in r["choices"]] == list(range(3))
    single = complete(tiny_server.url, model="a1", prompt=PROMPTS[1])["choices"][0]
    assert r["choices"][1]["token_ids"] == single["token_ids"]
    by_ids = complete(tiny_server.url, model="a1", prompt=single["prompt_token_ids"])["choices"][0]
    assert by_ids["token_ids"] == single["token_ids"]


def test_a_request_without_a_model_is_served_by_the_base_model(tiny_server, oracle):
    """vLLM's rule: `model` may be left out."""
    body = {"prompt": PROMPTS[0], "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "tiny-base"
    choice = answer["choices"][0]
    # vLLM's default max_tokens (16), on the base model's weights
    assert choice["token_ids"] == oracle.greedy(None, choice["prompt_token_ids"], 16)


def test_priority_is_vllms_request_field(tiny_server, oracle):
    """`priority` (vLLM's extension, lower runs earlier) is accepted on both endpoints and does not
    change what is generated; queue order under it is tested on the engine (test_engine_host.py)."""
    choice = complete(tiny_server.url, model="a2", prompt=PROMPTS[2], priority=-3)["choices"][0]
    assert choice["token_ids"] == oracle.greedy("a2", choice["prompt_token_ids"], MAX_TOKENS)
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions",
        timeout=120,
        json={"model": "a2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "priority": 5},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_models_lists_base_and_adapters(tiny_server, tiny_model):
    """vLLM's model list: the base model's card, then one card per registered adapter, as vLLM lists
    its --lora-modules (the parent the base model), but with no server path: without
    server.show_model_paths, a card's root is its own name where vLLM gives the path."""
    listing = httpx.get(f"{tiny_server.url}/v1/models", timeout=30).json()
    assert listing["object"] == "list"
    base, *adapters = listing["data"]
    assert (base["id"], base["parent"], base["root"]) == ("tiny-base", None, "tiny-base")
    assert base["max_model_len"] == 512  # harness.tiny_config's
    registered = httpx.get(
        f"{tiny_server.url}/v1/adapters", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ).json()["data"]
    assert {"a0", "a1", "a2"} <= {a["name"] for a in registered}
    assert [(m["id"], m["root"]) for m in adapters] == [(a["name"], a["name"]) for a in registered]
    assert str(tiny_model.base.parent) not in json.dumps(listing)
    assert all(m["parent"] == "tiny-base" for m in adapters)
    assert all(m["object"] == "model" and m["owned_by"] == "vllm" for m in listing["data"])


def test_openai_client(tiny_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    assert {"tiny-base", "a0"} <= {m.id for m in client.models.list()}
    c = client.completions.create(model="a0", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat.choices[0].message.content
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "no-such-adapter", "prompt": "x"}, 404, "model"),
        ({"model": "a0", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "a0", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "a0", "prompt": "x", "n": 0}, 400, None),  # vLLM's SamplingParams' refusal
        ({"model": "a0", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ({"model": "a0", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ({"model": "a0"}, 400, "prompt"),
        ({"model": "a0", "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ({"model": "a0", "prompt": "word " * 600}, 400, "input_tokens"),
        ({"model": "a0", "prompt": [999999]}, 400, "prompt"),
        ({"model": "a0", "prompt": "x", "priority": "high"}, 400, "priority"),
    ],
)
def test_completion_errors_are_openai_shaped(tiny_server, body, status, param):
    r = httpx.post(f"{tiny_server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"] and err["type"]


def test_malformed_json_and_bad_chat(tiny_server):
    r = httpx.post(
        f"{tiny_server.url}/v1/completions",
        content=b'{"model": "a0", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={"model": "a0", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(
        f"{tiny_server.url}/v1/chat/completions", json={"model": "a0", "messages": [{"role": "user", "content": 7}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_health_and_metrics(tiny_server):
    assert httpx.get(f"{tiny_server.url}/health").json()["status"] == "ok"
    complete(tiny_server.url, model="a1", prompt=PROMPTS[0], max_tokens=4)
    text = httpx.get(f"{tiny_server.url}/metrics").text
    for needle in [
        'dlora_requests_total{adapter="a1",status="ok"}',
        "dlora_time_to_first_token_seconds_bucket",
        'dlora_time_per_output_token_seconds_count{adapter="a1"}',
        "dlora_e2e_request_latency_seconds",
        'dlora_requests_running{adapter="a1"} 0.0',
        'dlora_adapters_resident{replica="0",state="host"}',
        'dlora_adapters_resident{replica="0",state="device"}',
        'dlora_adapter_host_bytes{replica="0"}',
        'dlora_replica_healthy{replica="0"} 1.0',
    ]:
        assert needle in text, needle


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _unfinished(url: str) -> float:
    return _metric(httpx.get(f"{url}/metrics").text, "dlora_replica_unfinished_requests")


def test_client_disconnect_aborts_in_the_engine(tiny_server):
    url = tiny_server.url
    body = {"model": "a2", "prompt": "x", "max_tokens": 500, "ignore_eos": True}
    t0 = time.monotonic()
    complete(url, **body)
    full_run = time.monotonic() - t0
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    closed = time.monotonic()
    # The engine must drop the request long before it could have finished it by itself.
    while _unfinished(url) > 0 and time.monotonic() - closed < full_run:
        time.sleep(0.02)
    assert _unfinished(url) == 0
    assert time.monotonic() - closed < full_run / 2, (time.monotonic() - closed, full_run)
    assert 'dlora_requests_total{adapter="a2",status="aborted"}' in httpx.get(f"{url}/metrics").text
