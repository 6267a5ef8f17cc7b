"""dlora's OpenAI API answers as vLLM's own server does, on the same tiny fp32 model and adapters.

Each kind of request goes to vLLM's `api_server` (tests/vllm_reference.py: started once, its answers
cached next to the test model) and to a dlora server, and the two answers are compared field by
field, streams chunk by chunk (tests/api_diff.py): greedy text and token ids equal, logprobs within
rounding, errors by status, type and param. Every kind runs on the one-replica server; a few that
cover each path (greedy, a stream, logprobs, an adapter, a structured output) also run on two
replicas and on the server that switches between merged and unmerged steps every few steps (the
shared servers' cost is paid once per run; these tests add only their requests).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests import api_diff, vllm_reference
from tests.vllm_reference import Call

pytestmark = pytest.mark.engine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPT = "def main("
PROMPT_IDS = [1, 472, 923, 265, 11]  # PROMPT as the tiny tokenizer encodes it (with <s>)
# a1's first token after this prompt is one of three with logprobs -0.17, -2.1 and -3.6: at
# temperature 2 seeded choices differ (a greedy-looking prompt would give every choice the same text).
SAMPLED_PROMPT = "class Foo:\n    def"
MESSAGES = [{"role": "user", "content": "hello there"}]
GREEDY: dict[str, Any] = {"temperature": 0}
SEEDED_PAIR: dict[str, Any] = {"n": 2, "seed": 2, "temperature": 2}
USAGE: dict[str, Any] = {"stream_options": {"include_usage": True}}
LONG_IDS = list(range(100, 600))  # 500 tokens of the 512 in the context
# Prompts no other request sends, of at least two full KV blocks (128 tokens on CPU): sent twice,
# the repeat finds the first's blocks in the prefix cache.
CACHED_IDS = list(range(1200, 1500))
CACHED_CHAT = "chat_cached_prompt"
CACHED_MESSAGES = [{"role": "user", "content": " ".join(f"item{i}" for i in range(120))}]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            # a choice of values: the tiny model fills a free string until max_tokens
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Kind:
    """A request and, where the kind is about a feature, what vLLM's answer shows of it (so a kind
    cannot pass by both servers ignoring the feature alike)."""

    call: Call
    shows: Callable[[dict], bool] | None = None

    @property
    def name(self) -> str:
        return self.call.name


def completion(name: str, model: str, shows: Callable[[dict], bool] | None = None, **body) -> Kind:
    return Kind(Call(name, COMPLETIONS, {"model": model} | body), shows)


def chat(name: str, model: str, shows: Callable[[dict], bool] | None = None, **body) -> Kind:
    return Kind(Call(name, CHAT, {"model": model, "messages": MESSAGES} | body), shows)


def repeated(kind: Kind) -> Kind:
    """The kind's request sent twice, the second answer compared."""
    return Kind(dataclasses.replace(kind.call, times=2), kind.shows)


def cached_tokens(answer: dict) -> int:
    usage = answer["body"]["usage"] if "body" in answer else answer["chunks"][-1]["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def choice(answer: dict, i: int = 0) -> dict:
    return answer["body"]["choices"][i]


def refused(status: int) -> Callable[[dict], bool]:
    return lambda answer: answer["status"] == status and "error" in answer["body"]


def streamed_choices(answer: dict) -> set[int]:
    return {c["index"] for chunk in answer["chunks"] for c in chunk["choices"]}


KINDS = [
    completion("text", "tiny-base", prompt=PROMPT, max_tokens=12, return_token_ids=True, **GREEDY),
    completion("token_id_prompt", "a1", prompt=PROMPT_IDS, max_tokens=8, return_token_ids=True, **GREEDY),
    completion(
        "default_max_tokens",
        "a0",
        lambda a: a["body"]["usage"]["completion_tokens"] == 16,  # vLLM's default for completions
        prompt="import os\nimport sys\n",
        **GREEDY,
    ),
    completion(
        "seeded_pair",
        "a1",
        lambda a: choice(a, 0)["text"] != choice(a, 1)["text"],
        prompt=SAMPLED_PROMPT,
        max_tokens=8,
        **SEEDED_PAIR,
    ),
    completion(
        "echo",
        "a2",
        lambda a: choice(a)["text"].startswith("for i"),
        prompt="for i in range(",
        echo=True,
        max_tokens=5,
        **GREEDY,
    ),
    completion("logprobs", "tiny-base", prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY),
    completion(
        "prompt_scoring",
        "a1",
        lambda a: choice(a)["text"] == PROMPT and len(choice(a)["logprobs"]["tokens"]) == len(PROMPT_IDS),
        prompt=PROMPT,
        echo=True,
        logprobs=1,
        max_tokens=0,
    ),
    completion(
        "stop",
        "tiny-base",
        lambda a: choice(a)["stop_reason"] == "atch",
        prompt=PROMPT,
        max_tokens=12,
        stop=["atch"],
        **GREEDY,
    ),
    completion(
        "truncate_prompt_tokens",
        "a2",
        lambda a: a["body"]["usage"]["prompt_tokens"] == 4,
        prompt="import os\nimport sys\nimport json\n",
        truncate_prompt_tokens=4,
        max_tokens=6,
        return_token_ids=True,
        **GREEDY,
    ),
    completion(
        "logit_bias",
        "a0",
        lambda a: choice(a)["token_ids"][0] != 1365,  # the unbiased greedy first token
        prompt=PROMPT,
        max_tokens=8,
        logit_bias={"1365": -100},
        return_token_ids=True,
        **GREEDY,
    ),
    completion(
        "bad_words",
        "tiny-base",
        lambda a: "only" not in choice(a)["text"],  # greedy starts "onlyonly" without it
        prompt=PROMPT,
        max_tokens=12,
        bad_words=["only"],
        **GREEDY,
    ),
    completion(
        "allowed_token_ids",
        "a2",
        lambda a: set(choice(a)["token_ids"]) <= {425, 687, 64, 406},
        prompt=PROMPT,
        max_tokens=10,
        allowed_token_ids=[425, 687, 64, 406],
        return_token_ids=True,
        **GREEDY,
    ),
    completion(
        "prompt_logprobs",
        "tiny-base",
        lambda a: len(choice(a)["prompt_logprobs"]) == len(PROMPT_IDS),
        prompt=PROMPT,
        max_tokens=3,
        prompt_logprobs=2,
        **GREEDY,
    ),
    completion(
        "max_tokens_clamped",
        "a1",
        lambda a: a["body"]["usage"]["completion_tokens"] == 512 - len(LONG_IDS),
        prompt=LONG_IDS,
        max_tokens=50,
        **GREEDY,
    ),
    completion("stream", "a1", prompt=SAMPLED_PROMPT, max_tokens=10, stream=True, **USAGE, **GREEDY),
    completion(
        "stream_seeded_pair",
        "a1",
        # two choices, and a usage chunk counting the prompt (8 tokens) once
        lambda a: streamed_choices(a) == {0, 1} and a["chunks"][-1]["usage"]["prompt_tokens"] == 8,
        prompt=SAMPLED_PROMPT,
        max_tokens=6,
        stream=True,
        **USAGE,
        **SEEDED_PAIR,
    ),
    completion("stream_logprobs", "a0", prompt=PROMPT, max_tokens=5, logprobs=2, stream=True, **GREEDY),
    chat("chat", "a0", max_tokens=10, return_token_ids=True, **GREEDY),
    chat("chat_stream", "a2", max_tokens=6, stream=True, **USAGE, **GREEDY),
    chat("chat_logprobs", "tiny-base", max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY),
    chat(
        "chat_json_schema",
        "a0",
        lambda a: choice(a)["message"]["content"].startswith("{"),
        max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        **GREEDY,
    ),
    chat(
        "chat_json_object",
        "tiny-base",
        lambda a: choice(a)["message"]["content"].startswith("{"),
        max_tokens=20,
        response_format={"type": "json_object"},
        **GREEDY,
    ),
    chat(
        "tools_required",
        "tiny-base",
        lambda a: choice(a)["message"]["tool_calls"][0]["function"]["name"] == "get_weather",
        max_tokens=40,
        tools=TOOLS,
        tool_choice="required",
        **GREEDY,
    ),
    chat(
        "tools_named",
        "a1",
        lambda a: choice(a)["message"]["tool_calls"][0]["function"]["name"] == "get_weather",
        max_tokens=40,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    ),
    completion(
        "structured_choice",
        "a1",
        lambda a: choice(a)["text"] in ("yes", "no"),
        prompt=PROMPT,
        max_tokens=5,
        structured_outputs={"choice": ["yes", "no"]},
        **GREEDY,
    ),
    completion(
        "structured_regex",
        "a2",
        lambda a: choice(a)["text"].isdigit() and len(choice(a)["text"]) == 3,
        prompt="x=",
        max_tokens=10,
        structured_outputs={"regex": "[0-9]{3}"},
        **GREEDY,
    ),
    completion(
        "structured_json",
        "tiny-base",
        lambda a: choice(a)["text"].startswith("{"),
        prompt="x=",
        max_tokens=20,
        structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}},
        **GREEDY,
    ),
    completion(
        "structured_grammar",
        "a0",
        lambda a: choice(a)["text"] in ("yes", "no", "maybe"),
        prompt="x=",
        max_tokens=10,
        structured_outputs={"grammar": 'root ::= "yes" | "no" | "maybe"'},
        **GREEDY,
    ),
    Kind(Call("tokenize", "/tokenize", {"model": "a1", "prompt": PROMPT}), lambda a: a["body"]["tokens"] == PROMPT_IDS),
    Kind(Call("tokenize_chat", "/tokenize", {"model": "a2", "messages": MESSAGES, "add_generation_prompt": True})),
    Kind(Call("detokenize", "/detokenize", {"model": "tiny-base", "tokens": PROMPT_IDS})),
    completion("unknown_model", "no-such-adapter", refused(404), prompt=PROMPT, max_tokens=4),
    chat("chat_unknown_model", "no-such-adapter", refused(404), max_tokens=4),
    completion("prompt_over_context", "a1", refused(400), prompt=list(range(100, 620)), max_tokens=4),
    chat(
        "invalid_json_schema",
        "a0",
        refused(400),
        max_tokens=10,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ),
    completion("greedy_pair", "tiny-base", refused(400), prompt=PROMPT, max_tokens=4, n=2, **GREEDY),
    # every full block of the first request's prompt (vLLM recomputes at least the last token)
    repeated(
        completion("cached_prompt", "a2", lambda a: cached_tokens(a) == 256, prompt=CACHED_IDS, max_tokens=3, **GREEDY)
    ),
    repeated(
        Kind(
            Call(
                CACHED_CHAT,
                CHAT,
                {"model": "a1", "messages": CACHED_MESSAGES, "max_tokens": 3, "stream": True, **USAGE, **GREEDY},
            ),
            lambda a: cached_tokens(a) >= 128,
        )
    ),
]
BY_NAME = {kind.name: kind for kind in KINDS}
# The paths every server must take alike: greedy text, an adapter's greedy ids, logprobs, streams
# (one counting a seeded pair), a chat stream on an MLP-targeting adapter, a structured output.
REPRESENTATIVE = [
    "text",
    "token_id_prompt",
    "logprobs",
    "stream",
    "stream_seeded_pair",
    "chat_stream",
    "structured_regex",
]


@pytest.fixture(scope="session")
def vllm_answers(tiny_model) -> dict[str, dict]:
    """vLLM's answers to every kind (its server started at most once per run; a second worker waits)."""
    return vllm_reference.answers(tiny_model, [kind.call for kind in KINDS])


def answers_as_vllm(server, vllm_answers: dict[str, dict], name: str) -> None:
    kind = BY_NAME[name]
    reference = vllm_answers[name]
    with httpx.Client(timeout=vllm_reference.REQUEST_TIMEOUT_S) as client:
        ours = vllm_reference.send(client, server.url, kind.call)
    found = api_diff.differences(ours, reference)
    assert not found, f"{name}: dlora differs from vLLM:\n" + "\n".join(found[:20])
    assert shows_its_feature(kind, reference), f"{name}: vLLM's answer misses the feature: {reference}"


def shows_its_feature(kind: Kind, reference: dict) -> bool:
    if kind.shows is None:
        return True
    try:
        return kind.shows(reference)
    except (KeyError, IndexError, TypeError):  # an error, or an answer of another shape
        return False


# vllm_answers comes first: on a cold cache vLLM's server runs and stops before the dlora server starts.
@pytest.mark.parametrize("name", list(BY_NAME))
def test_one_replica_answers_as_vllm(vllm_answers, tiny_server, name):
    answers_as_vllm(tiny_server, vllm_answers, name)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_two_replicas_answer_as_vllm(vllm_answers, two_replica_server, name):
    answers_as_vllm(two_replica_server, vllm_answers, name)


# A repeat on two replicas reports its cached tokens as vLLM's one engine does (that dispatch picks the
# holder over a shorter queue is tests/cluster/test_router_prefix.py's, over toy replicas).
@pytest.mark.parametrize("name", ["cached_prompt", CACHED_CHAT])
def test_two_replicas_report_cached_prompts_as_vllm(vllm_answers, two_replica_server, name):
    answers_as_vllm(two_replica_server, vllm_answers, name)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_switching_replica_answers_as_vllm(vllm_answers, einsum_server, name):
    answers_as_vllm(einsum_server, vllm_answers, name)
