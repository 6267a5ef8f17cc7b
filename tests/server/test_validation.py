"""A request's values checked in the API process (no server, no engine): values the engines can carry,
the operator's policy, vLLM's sampling rules, and what clients see of errors."""

from __future__ import annotations

import json
import logging
import math
import sys

import pytest

from dlora.cluster.errors import NoReplicaError, RequestTimeout, ResubmissionLimit
from dlora.config import ServerConfig
from dlora.replica.errors import ReplicaFailure, RequestRejected
from dlora.replica.messages import SamplingSpec
from dlora.server.errors import APIError, as_api_error
from dlora.server.validation import check_body, check_priority, check_sampling, check_values

VOCAB = 100


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.message
    return e.value


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 4} | fields


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields


# --- values anywhere in the body -------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(model="a\ud800"), "model"),
        (completion(prompt="x\udfff"), "prompt"),
        (completion(prompt=["fine", "bad\ud800"]), "prompt.1"),
        (completion(stop=["ok", "\ud83d"]), "stop.1"),
        (completion(user="\udc00"), "user"),
        (completion(unknown_field={"deep": ["\udc00"]}), "unknown_field.deep.0"),
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
        ({"seed": 2**63}, "seed"),
        ({"priority": -(2**63) - 1}, "priority"),
    ],
)
def test_non_finite_floats_and_integers_beyond_int64_are_refused(fields, param):
    assert refused(check_values, completion(**fields)).param == param


def test_non_finite_values_inside_template_kwargs_are_refused_too():
    assert refused(check_values, chat(chat_template_kwargs={"x": [1.0, math.nan]})).param == "chat_template_kwargs.x.1"


def test_an_ordinary_body_passes():
    check_values(completion(stop=["\n"], seed=-5, priority=3, prompt=[[1, 2], [3]], temperature=0.7))
    check_values(chat(chat_template_kwargs={"enable_thinking": False, "n": 2**63 - 1}, seed=-(2**63)))


def test_a_body_nested_deeper_than_pythons_recursion_limit_is_read():
    deep: object = "\ud800"
    for _ in range(5 * sys.getrecursionlimit()):
        deep = [deep]
    assert refused(check_values, completion(extra=deep)).param.startswith("extra.0.0.0")


# --- the operator's policy -------------------------------------------------------------------------


def test_client_priority_is_refused_unless_allowed():
    strict, open_ = ServerConfig(), ServerConfig(allow_client_priority=True)
    err = refused(check_priority, completion(priority=-1), None, strict)
    assert err.param == "priority" and "not enabled" in err.message
    check_priority(completion(priority=0), None, strict)
    check_priority(completion(), None, strict)
    check_priority(completion(priority=-1), None, open_)
    check_priority(chat(priority=7), None, open_)


def test_vllms_priority_header_is_gated_too_and_wins_over_the_body():
    strict, open_ = ServerConfig(), ServerConfig(allow_client_priority=True)
    assert refused(check_priority, completion(), "-5", strict).param == "priority"
    check_priority(completion(priority=3), "0", strict)  # the header's 0 is what vLLM would run
    check_priority(completion(), "not a number", strict)  # vLLM ignores it: the body's 0 runs
    check_priority(completion(), "-5", open_)
    assert refused(check_priority, completion(), str(2**64), open_).param == "priority"


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "messages", "chat_template"])
def test_template_kwargs_cannot_change_what_rendering_returns(key):
    body = chat(chat_template_kwargs={key: True, "enable_thinking": True})
    assert refused(check_body, body, None, ServerConfig(trust_request_chat_template=True)).param == (
        f"chat_template_kwargs.{key}"
    )


def test_other_template_kwargs_and_bodies_that_are_not_objects_pass():
    check_body(
        chat(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False}), None, ServerConfig()
    )
    check_body([1, 2], None, ServerConfig())  # vLLM's request model refuses it, naming why
    check_body(chat(chat_template_kwargs="not an object"), None, ServerConfig())


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


# --- what clients see of errors --------------------------------------------------------------------


def test_engine_rejections_keep_their_message_and_param():
    err = as_api_error(RequestRejected("min_tokens must be <= max_tokens", "min_tokens"), "cmpl-1")
    assert (err.status, err.message, err.param) == (400, "min_tokens must be <= max_tokens", "min_tokens")
    same = APIError(429, "too many", None)
    assert as_api_error(same, "cmpl-1") is same


def test_an_adapter_no_node_could_get_is_a_503_that_names_the_adapter_and_no_node_or_path():
    from dlora.replica.errors import AdapterUnavailable

    exc = AdapterUnavailable("pirate", "10.0.0.7", "fetch failed: /var/cache/dlora/node/ab12: No space left")
    err = as_api_error(exc, "cmpl-9")
    assert err.status == 503 and "'pirate'" in err.message and "cmpl-9" in err.message
    assert "10.0.0.7" not in err.message and "/var/cache" not in err.message


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
