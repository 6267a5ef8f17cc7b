"""A request's values checked in the API process (no server, no engine): vLLM's rules, the operator's
policy, template rendering off the event loop, and error mapping."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import pydantic
import pytest

from dlora.cluster.errors import NoReplicaError, RequestTimeout, ResubmissionLimit
from dlora.config import ServerConfig
from dlora.replica.errors import ReplicaFailure, RequestRejected
from dlora.replica.messages import SamplingSpec, TokenLogprob
from dlora.server import formatting as fmt
from dlora.server import templates
from dlora.server.errors import APIError, as_api_error
from dlora.server.generation import ChoiceResult, make_jobs
from dlora.server.protocol import ChatCompletionRequest, CompletionRequest
from dlora.server.validation import check_policy, check_sampling, check_values

VOCAB = 100


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.message
    return e.value


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(**({"model": "m", "prompt": "hello", "max_tokens": 4} | fields))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(**({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields))


def jobs(body: CompletionRequest):
    return make_jobs("cmpl-1", [[1, 2, 3]], body, None, None, max_model_len=64, vocab_size=VOCAB)


# --- values anywhere in the body -------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(model="a\ud800"), "model"),
        (completion(prompt="x\udfff"), "prompt"),
        (completion(prompt=["fine", "bad\ud800"]), "prompt.1"),
        (completion(stop=["ok", "\ud83d"]), "stop.1"),
        (completion(user="\udc00"), "user"),
        (chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages.0.content"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
            "messages.0.content.0.text",
        ),
        (chat(chat_template_kwargs={"flag\ud800": True}), "chat_template_kwargs"),
    ],
)
def test_lone_surrogates_are_refused_naming_where_without_echoing_them(body, param):
    err = refused(check_values, body)
    assert err.param == param
    err.message.encode("utf-8")  # the message itself must be sendable


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": json.loads("1e309")}, "repetition_penalty"),  # what JSON parsing makes of it
        ({"top_k": 2**70}, "top_k"),
        ({"min_tokens": 2**64}, "min_tokens"),
    ],
)
def test_non_finite_floats_and_integers_beyond_int64_are_refused(fields, param):
    assert refused(check_values, completion(**fields)).param == param


def test_non_finite_values_inside_template_kwargs_are_refused_too():
    assert refused(check_values, chat(chat_template_kwargs={"x": [1.0, math.nan]})).param == "chat_template_kwargs.x.1"


def test_an_ordinary_body_passes():
    check_values(completion(stop=["\n"], seed=-5, priority=3, prompt=[[1, 2], [3]], temperature=0.7))
    check_values(chat(chat_template_kwargs={"enable_thinking": False, "n": 2**63 - 1}))


@pytest.mark.parametrize("field", ["seed", "priority"])
@pytest.mark.parametrize("value", [2**63, 2**64, -(2**63) - 1])
def test_seed_and_priority_must_fit_int64_as_in_vllm(field, value):
    with pytest.raises(pydantic.ValidationError) as e:
        completion(**{field: value})
    assert e.value.errors()[0]["loc"] == (field,)
    completion(**{field: 2**63 - 1})
    completion(**{field: -(2**63)})


# --- the operator's policy -------------------------------------------------------------------------


def test_client_priority_is_refused_unless_allowed():
    strict, open_ = ServerConfig(), ServerConfig(allow_client_priority=True)
    err = refused(check_policy, completion(priority=-1), strict)
    assert err.param == "priority" and "not enabled" in err.message
    check_policy(completion(priority=0), strict)
    check_policy(completion(priority=-1), open_)
    check_policy(chat(priority=7), open_)


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(chat_template_kwargs={"chat_template": "{{ 'pwned' }}"}), "chat_template_kwargs.chat_template"),
        (chat(chat_template="{{ 'pwned' }}"), "chat_template"),
    ],
)
def test_request_templates_are_refused_unless_trusted(body, param):
    err = refused(check_policy, body, ServerConfig())
    assert err.param == param and "trust_request_chat_template" in err.message
    check_policy(body, ServerConfig(trust_request_chat_template=True))


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "messages"])
def test_template_kwargs_cannot_change_what_rendering_returns(key):
    body = chat(chat_template_kwargs={key: True, "enable_thinking": True})
    assert (
        refused(check_policy, body, ServerConfig(trust_request_chat_template=True)).param
        == f"chat_template_kwargs.{key}"
    )


def test_other_template_kwargs_are_allowed():
    check_policy(chat(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False}), ServerConfig())


# --- sampling values, by the SamplingParams the engine builds ---------------------------------------


@pytest.mark.parametrize(
    "spec, param, words",
    [
        (SamplingSpec(max_tokens=4, stop=("",)), "stop", "empty string"),
        (SamplingSpec(max_tokens=4, stop=("a", "")), "stop", "empty string"),
        (SamplingSpec(max_tokens=4, min_tokens=5), "min_tokens", "max_tokens"),
        (SamplingSpec(max_tokens=4, stop_token_ids=(VOCAB,)), "stop_token_ids", "out-of-vocab"),
        (SamplingSpec(max_tokens=4, stop_token_ids=(3, -1)), "stop_token_ids", "out-of-vocab"),
        (SamplingSpec(max_tokens=4, repetition_penalty=math.inf), "repetition_penalty", "finite"),
        (SamplingSpec(max_tokens=4, repetition_penalty=0.0), "repetition_penalty", "greater than zero"),
        (SamplingSpec(max_tokens=4, repetition_penalty=1e39), "repetition_penalty", "at most"),
        (SamplingSpec(max_tokens=4, temperature=math.nan), "temperature", "finite"),
        (SamplingSpec(max_tokens=4, top_k=-2), "top_k", "top_k"),
        (SamplingSpec(max_tokens=4, seed=2**63), "seed", "seed"),
    ],
)
def test_vllms_sampling_rules_refuse_with_the_field_named(spec, param, words):
    err = refused(check_sampling, spec, VOCAB)
    assert err.param == param and words in err.message


def test_a_huge_list_of_bad_stop_ids_gives_a_short_message():
    err = refused(check_sampling, SamplingSpec(max_tokens=4, stop_token_ids=tuple(range(VOCAB, VOCAB + 10_000))), VOCAB)
    assert len(err.message) < 300


def test_good_sampling_values_pass():
    check_sampling(
        SamplingSpec(
            max_tokens=4,
            min_tokens=4,
            stop=("\n",),
            stop_token_ids=(0, VOCAB - 1),
            seed=2**63 - 1,
            repetition_penalty=1.3,
            top_k=-1,
        ),
        VOCAB,
    )


def test_make_jobs_checks_every_sample_before_any_engine_sees_it():
    assert refused(jobs, completion(stop=[""])).param == "stop"
    assert refused(jobs, completion(min_tokens=9, max_tokens=4)).param == "min_tokens"
    assert refused(jobs, completion(stop_token_ids=[5000])).param == "stop_token_ids"
    # Sample i of a seeded request runs with seed + i: the last one must still fit int64.
    assert refused(jobs, completion(seed=2**63 - 1, n=2)).param == "seed"
    assert [j.request.sampling.seed for j in jobs(completion(seed=2**63 - 2, n=2))] == [2**63 - 2, 2**63 - 1]


# --- templates off the event loop ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.base)


MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"


def test_chat_prompt_renders_the_models_template(tokenizer):
    ids = asyncio.run(templates.chat_prompt(tokenizer, MESSAGES, True, {}, None, 5.0))
    expected = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    # A template flag given as a kwarg reaches the template.
    no_prompt = asyncio.run(
        templates.chat_prompt(tokenizer, MESSAGES, True, {"add_generation_prompt": False}, None, 5.0)
    )
    assert tokenizer.decode(no_prompt).rstrip().endswith("hi")


def test_a_trusted_request_template_is_used(tokenizer):
    ids = asyncio.run(templates.chat_prompt(tokenizer, MESSAGES, True, {}, "{{ messages[0]['content'] }}!", 5.0))
    assert tokenizer.decode(ids) == "hi!"


def test_a_looping_template_is_cut_off_and_its_thread_freed(tokenizer):
    async def run():
        t0 = time.monotonic()
        with pytest.raises(APIError) as e:
            await templates.chat_prompt(tokenizer, MESSAGES, True, {}, NESTED_LOOPS, 0.5)
        elapsed = time.monotonic() - t0
        # The event loop stayed free meanwhile: this render is bounded and answered.
        ok = await asyncio.wait_for(templates.chat_prompt(tokenizer, MESSAGES, True, {}, None, 5.0), 5.0)
        return e.value, elapsed, ok

    for _ in range(templates._POOL._max_workers + 1):  # more than the pool has threads: each was freed
        err, elapsed, ok = asyncio.run(run())
        assert err.status == 400 and err.param == "chat_template"
        assert err.message == "chat template rendering took longer than 0.5 s"
        assert elapsed < 3.0 and ok


def test_a_broken_template_is_a_400_on_messages(tokenizer):
    with pytest.raises(APIError) as e:
        asyncio.run(templates.chat_prompt(tokenizer, MESSAGES, True, {}, "{% for %}", 5.0))
    assert e.value.status == 400 and e.value.param == "messages" and "chat template failed" in e.value.message


def test_prompts_are_tokenised_off_the_loop(tokenizer):
    ids = asyncio.run(templates.encode_prompts(tokenizer, ["hello world", "x" * 20_000]))
    assert ids[0] == tokenizer("hello world", add_special_tokens=True)["input_ids"] and len(ids[1]) > 1


# --- what clients see of errors --------------------------------------------------------------------


def test_engine_rejections_keep_their_message_and_param():
    err = as_api_error(RequestRejected("min_tokens must be <= max_tokens", "min_tokens"), "cmpl-1")
    assert (err.status, err.message, err.param) == (400, "min_tokens must be <= max_tokens", "min_tokens")
    same = APIError(429, "too many", None)
    assert as_api_error(same, "cmpl-1") is same


@pytest.mark.parametrize(
    "exc, status",
    [
        (NoReplicaError("no replica is up (failed or rebuilding); retry later"), 503),
        (ResubmissionLimit("the request's replica failed 3 times"), 502),
        (RequestTimeout("the request passed its deadline of 600 s"), 504),
    ],
)
def test_cluster_errors_keep_their_status_and_message(exc, status):
    err = as_api_error(exc, "cmpl-9")
    assert err.status == status and str(exc) in err.message and "cmpl-9" in err.message


def test_a_replica_failure_that_reaches_the_route_is_a_503_without_its_text():
    err = as_api_error(ReplicaFailure("actor 8f3a died in /x/engine.py"), "cmpl-9")
    assert err.status == 503 and "cmpl-9" in err.message and "8f3a" not in err.message


def test_anything_else_is_a_generic_500_logged_under_the_request_id(caplog):
    inner = 'Traceback (most recent call last):\n  File "/x/ray_replica.py", line 3\nActorID: 8f3a'
    with caplog.at_level(logging.ERROR, logger="dlora.server.errors"):
        err = as_api_error(RuntimeError(inner), "chatcmpl-42")
    assert err.status == 500 and err.message == "internal error while generating (request id chatcmpl-42)"
    assert "chatcmpl-42" in caplog.text and "ActorID: 8f3a" in caplog.text


# --- logprobs that JSON cannot carry ---------------------------------------------------------------


def test_non_finite_logprobs_are_floored_as_vllm_does():
    lps = [TokenLogprob(1, -math.inf, "a", ((2, math.nan, "b"), (3, -0.5, "c"))), TokenLogprob(4, -1.0, "d")]
    r = ChoiceResult(0, 0, text="ad", token_ids=[1, 4], logprobs=lps, finish_reason="length")
    whole = fmt.completion_choice(r, "", None)
    assert whole["logprobs"]["token_logprobs"] == [-9999.0, -1.0]
    assert whole["logprobs"]["top_logprobs"][0] == {"b": -9999.0, "c": -0.5, "a": -9999.0}
    chat_choice = fmt.chat_choice(r, False)
    assert [c["logprob"] for c in chat_choice["logprobs"]["content"]] == [-9999.0, -1.0]
    assert chat_choice["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -9999.0
    # Both whole responses and SSE chunks are strict JSON.
    json.dumps([whole, chat_choice, fmt.chat_logprobs(lps), fmt.completion_logprobs(lps, 0)], allow_nan=False)
    assert "NaN" not in fmt.sse({"choices": [whole]}) and "Infinity" not in fmt.sse({"choices": [chat_choice]})
