"""A property-based fuzzer of the OpenAI routes against one real server.

Bodies are drawn from the server's own OpenAPI schema (GET /openapi.json) and then mutated: wrong
types, huge, negative and non-finite numbers written as raw JSON text (1e999, -0, NaN, Infinity),
lone surrogates, deep nesting, extra and missing fields, streamed or not. Raw byte bodies follow:
invalid JSON, invalid UTF-8, empty bodies, wrong content types. Whatever arrives, the server must
answer within a bound and never with a 5xx; an error is OpenAI-shaped JSON showing no server
internals, and a 200 stream ends with `data: [DONE]`. Afterwards /health answers at once and a
greedy request returns the very tokens it returned before the fuzzing.

Runs are reproducible (derandomize, no example database) and run a fixed number of examples. Each
exchange has a generous hang guard: an answer (a whole stream included) that takes longer fails the
test; there is no speed bound.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SCHEMA_NAMES = {COMPLETIONS: "CompletionRequest", CHAT: "ChatCompletionRequest"}
MODELS = ["a0", "a1", "a2", "tiny-base"]
# The hang guard: no answer of the tiny server (at most 512 tokens) comes near this on a busy 2-core
# machine; a request still unanswered after it is stuck.
HANG_GUARD_S = 120.0
SCHEMA_EXAMPLES = 100  # per endpoint
RAW_EXAMPLES = 200
# Server internals a client must never see: Python tracebacks and paths, Ray and its actors.
LEAKS = re.compile(r'Traceback|File "|\.py\b|\bray\b|\bactor|ActorID', re.IGNORECASE)
GREEDY = {
    COMPLETIONS: {
        "model": "a0",
        "prompt": "The quick brown fox",
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    },
    CHAT: {
        "model": "a1",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    },
}
# The same kind of body every test server accepts: the seed of the byte-level mutations.
VALID_RAW = {
    COMPLETIONS: b'{"model": "a0", "prompt": "hi", "max_tokens": 2}',
    CHAT: b'{"model": "a0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}',
}


# ---------------------------------------------------------------------------------------------
# JSON a well-behaved encoder never writes


@dataclass(frozen=True)
class Raw:
    """JSON text spliced into a body as is: literals json.dumps refuses or rewrites."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'...' if len(self.text) > 40 else ''}, {len(self.text)} chars)"


def nested(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


LITERALS = [
    Raw(t)
    for t in (
        "1e999",
        "-1e999",
        "-0",
        "-0.0",
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "1e-400",
        "4.9e-324",
        str(2**64),
        str(-(2**63) - 1),
        str(2**63),
        "9" * 5000,
        "-" + "9" * 5000,
        "1E2",
        "0.0",
        "2.5",
        '"\\ud800"',
        '"a\\udfff"',
        '"\\udc00\\ud800"',
        '"\\u0000"',
        "true",
        "false",
        "null",
        "[]",
        "{}",
    )
] + [nested(d) for d in (64, 500, 990, 3000, 100_000)]


def render(value: Any) -> bytes:
    """`value` as JSON text with every Raw spliced in. Markers stand in for the Raw values while
    json.dumps writes the rest (ensure_ascii: a lone surrogate stays an escape, as JSON allows)."""
    raws: dict[str, str] = {}

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            marker = f"\x00raw{len(raws)}\x00"
            raws[marker] = v.text
            return marker
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for marker, literal in raws.items():
        text = text.replace(json.dumps(marker), literal)
    return text.encode("ascii")


def surrogate_text() -> st.SearchStrategy[str]:
    lone = st.integers(0xD800, 0xDFFF).map(chr)
    return st.tuples(st.text(max_size=8), lone, st.text(max_size=8)).map("".join)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(LITERALS)
    | surrogate_text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10) | surrogate_text(), inner, max_size=4)
    ),
    max_leaves=12,
)


# ---------------------------------------------------------------------------------------------
# Bodies from the schema, made cheap to serve, then mutated


# Prompts the tiny model takes: text, and token ids within its vocabulary of 2048.
token_ids = st.lists(st.integers(0, 2047), min_size=1, max_size=8)
prompts = (
    st.text(max_size=40)
    | token_ids
    | st.lists(st.text(max_size=20), min_size=1, max_size=3)
    | st.lists(token_ids, min_size=1, max_size=3)
)


@st.composite
def cheap(draw, body: dict) -> dict:
    """Mostly a served model and a few tokens, so that generated bodies that pass validation cost
    the engine little; now and then the schema's own (unbounded) values or the defaults."""
    body = dict(body)
    model = draw(st.sampled_from(MODELS + [None]))
    if model is not None:
        body["model"] = model
    choice = draw(st.sampled_from(["small"] * 6 + ["medium", "huge", "schema", "absent"]))
    if choice == "small":
        body["max_tokens"] = draw(st.integers(1, 4))
    elif choice == "medium":
        body["max_tokens"] = draw(st.integers(5, 64))
    elif choice == "huge":
        body["max_tokens"] = draw(st.integers(400, 2**70))
    elif choice == "absent":
        body.pop("max_tokens", None)
        body.pop("max_completion_tokens", None)
    if "n" in body:
        body["n"] = draw(st.sampled_from([1, 1, 1, 2, 3, body["n"]]))
    body["stream"] = draw(st.booleans())  # the schema's optional field is too seldom true
    if "prompt" in body:
        # The schema's token ids are mostly out of the vocabulary: the 400 says so before any work.
        body["prompt"] = draw(
            st.sampled_from([body["prompt"]] * 2 + [None, None, None]).flatmap(
                lambda p: st.just(p) if p is not None else prompts
            )
        )
    return body


def mutation(fields: list[str]) -> st.SearchStrategy:
    """One change to a body (a dict), as a function of it."""
    name = st.sampled_from(fields)

    def set_to(values: st.SearchStrategy) -> st.SearchStrategy:
        return st.tuples(name, values).map(lambda kv: lambda b: b | {kv[0]: kv[1]})

    def drop(key: str):
        return lambda b: {k: v for k, v in b.items() if k != key}

    return st.one_of(
        name.map(drop),
        set_to(json_values),  # wrong types, and extra shapes of the right ones
        set_to(st.sampled_from(LITERALS)),
        set_to(surrogate_text() | st.lists(surrogate_text(), min_size=1, max_size=2)),
        st.tuples(st.text(max_size=12) | surrogate_text(), json_values).map(
            lambda kv: lambda b: b | {kv[0]: kv[1]}
        ),  # an extra field
        st.tuples(st.booleans(), st.booleans()).map(
            lambda s: lambda b: b | {"stream": s[0], "stream_options": {"include_usage": s[1]}}
        ),
        json_values.map(lambda v: lambda b: v),  # not an object at all
    )


def chat_specific() -> st.SearchStrategy:
    """Mutations of a chat body's messages, which the generic ones only replace as a whole."""
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "text", "image_url"]) | json_values},
        optional={"text": json_values | surrogate_text()},
    )
    content = json_values | surrogate_text() | st.lists(part | json_values, max_size=3)
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | json_values},
        optional={"content": content, "name": json_values},
    )
    return st.lists(message | json_values, max_size=3).map(lambda ms: lambda b: b | {"messages": ms})


# The JSON-schema keywords of pydantic's schemas for these bodies. A keyword outside this set fails
# the test rather than be ignored: the generated bodies would silently stop matching the schema.
SCHEMA_KEYWORDS = {
    "$ref",
    "anyOf",
    "const",
    "enum",
    "type",
    "title",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "items",
    "minItems",
    "maxItems",
    "properties",
    "required",
    "additionalProperties",
    # annotations: they say nothing of which values are valid
    "description",
    "deprecated",
    "contentMediaType",
}


def from_json_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values valid by `schema` (an OpenAPI component or a part of one)."""
    unknown = set(schema) - SCHEMA_KEYWORDS
    if unknown:
        raise ValueError(f"the fuzzer does not know the schema keyword(s) {sorted(unknown)}")
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_json_schema(components[name], components))
    if "anyOf" in schema:
        return st.one_of([from_json_schema(s, components) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return json_values
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))
    if kind == "integer":
        return _integers(schema)
    if kind == "number":
        return st.floats(
            schema.get("minimum", schema.get("exclusiveMinimum")),
            schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        least = schema.get("minItems", 0)
        items = from_json_schema(schema["items"], components) if "items" in schema else json_values
        return st.lists(items, min_size=least, max_size=schema.get("maxItems", least + 3))
    if kind == "object":
        props = {k: from_json_schema(v, components) for k, v in schema.get("properties", {}).items()}
        if not props:
            return st.dictionaries(st.text(max_size=10), json_values, max_size=4)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    raise ValueError(f"the fuzzer does not know the schema type {kind!r}")


def _integers(schema: dict) -> st.SearchStrategy[int]:
    # pydantic writes int64 bounds as floats (9.223372036854776e+18 is 2**63, one past int64's
    # largest value): the bodies keep that, and the server refuses the one value it lets through.
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    low = None if low is None else math.ceil(low) + ("exclusiveMinimum" in schema and low == math.ceil(low))
    high = None if high is None else math.floor(high) - ("exclusiveMaximum" in schema and high == math.floor(high))
    return st.integers(low, high)


def schema_strategy(openapi: dict, name: str) -> st.SearchStrategy[dict]:
    components = openapi["components"]["schemas"]
    return from_json_schema(components[name], components)


@st.composite
def request_bodies(draw, openapi: dict, path: str) -> tuple[Any, bool]:
    """(body, mutated): a schema-valid body made cheap, with 0-3 mutations applied."""
    name = SCHEMA_NAMES[path]
    body = draw(cheap(draw(schema_strategy(openapi, name))))
    fields = sorted(openapi["components"]["schemas"][name]["properties"])
    changes = mutation(fields)
    if path == CHAT:  # half the changes to the messages (`|` would flatten them into 1 in 8)
        changes = st.sampled_from([changes, chat_specific()]).flatmap(lambda s: s)
    steps = draw(st.lists(changes, max_size=3))
    for change in steps:
        if isinstance(body, dict):
            body = change(body)
    return body, bool(steps)


@st.composite
def raw_requests(draw) -> tuple[str, bytes, str | None]:
    """(path, body bytes, content type) that are not the JSON object the route expects, or are
    it in a form the JSON parser or the content-type check may trip on."""
    path = draw(st.sampled_from([COMPLETIONS, CHAT]))
    valid = VALID_RAW[path]
    body = draw(
        st.one_of(
            st.binary(max_size=64),
            st.sampled_from(
                [
                    b"",
                    b" ",
                    b"{",
                    b"}",
                    b"{}",
                    b"[]",
                    b"null",
                    b"0",
                    b'"x"',
                    b"\x00",
                    b"\xff\xfe\xfd",
                    b"\xef\xbb\xbf" + valid,
                    valid.decode().encode("utf-16"),
                    valid.decode().encode("utf-32"),
                    b"[" * 100_000,
                    b'{"a":' * 50_000,
                    valid[:-1] + b', "max_tokens": 3}',
                    valid[:-1] + b', "prompt": ["x"], "prompt": 5}',
                ]
            ),
            st.integers(0, len(valid) - 1).map(lambda k: valid[:k]),  # truncated
            st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=4)).map(
                lambda t: valid[: t[0]] + t[1] + valid[t[0] :]
            ),  # bytes inserted
            st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]).map(
                lambda bad: valid.replace(b'"hi"', b'"h' + bad + b'i"')
            ),  # invalid UTF-8 inside a string
        )
    )
    content_type = draw(
        st.sampled_from(
            [
                "application/json",
                "application/json",
                None,
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=xyz",
                "application/json; charset=utf-16",
                "application/merge-patch+json",
                "application/jsonx",
                "*/*",
                "application/json; charset=\xff",
            ]
        )
    )
    return path, body, content_type


# ---------------------------------------------------------------------------------------------
# One exchange and what it must look like


@dataclass
class Answer:
    status: int
    content_type: str
    text: str
    seconds: float
    events: list[str] = field(default_factory=list)


def send(client: httpx.Client, path: str, body: bytes, content_type: str | None) -> Answer:
    headers = {} if content_type is None else {"content-type": content_type.encode("latin-1")}
    t0 = time.monotonic()
    with client.stream("POST", path, content=body, headers=headers) as r:
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            events = [line for line in r.iter_lines() if line.strip()]
            return Answer(r.status_code, ctype, "\n".join(events), time.monotonic() - t0, events)
        r.read()
        return Answer(r.status_code, ctype, r.text, time.monotonic() - t0)


def leaks(answer_text: str, request: bytes) -> list[str]:
    """Internals in an answer: what LEAKS finds that the client did not send itself (a model name
    "ray" comes back in the 404's message, and that is no leak)."""
    sent = request.decode("utf-8", "replace").lower()
    return [m for m in LEAKS.findall(answer_text) if m.lower() not in sent]


def assert_error_shape(obj: Any, status: int, request: bytes, where: str) -> None:
    """An OpenAI error showing no internals. (Generated text is not searched for them: the tiny
    model's output is random tokens of code, "traceback" among them.)"""
    assert isinstance(obj, dict) and isinstance(obj.get("error"), dict), where
    assert not leaks(json.dumps(obj), request), where
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] == status, where


def assert_sane(answer: Answer, request: bytes) -> None:
    where = (
        f"status {answer.status} after {answer.seconds:.1f}s; body sent: {request[:2000]!r}; "
        f"answer: {answer.text[:2000]!r}"
    )
    assert answer.seconds < HANG_GUARD_S, where
    assert answer.status < 500, where
    if answer.events:
        assert answer.status == 200 and answer.events[-1] == "data: [DONE]", where
        for event in answer.events[:-1]:
            assert event.startswith("data: "), where
            chunk = json.loads(event[len("data: ") :])
            if "error" in chunk:
                assert chunk["error"]["code"] < 500, where
                assert_error_shape(chunk, chunk["error"]["code"], request, where)
            else:
                assert "choices" in chunk, where
        return
    assert answer.content_type.startswith("application/json"), where
    obj = json.loads(answer.text)
    if answer.status >= 400:
        assert_error_shape(obj, answer.status, request, where)
    else:
        assert answer.status == 200 and isinstance(obj.get("choices"), list) and "usage" in obj, where


# ---------------------------------------------------------------------------------------------
# Fixtures: one client, the schema, the greedy answers of the server before any fuzzing


@pytest.fixture(scope="module")
def client(tiny_server):
    # The read timeout is the hang guard for a stream that goes quiet.
    with httpx.Client(base_url=tiny_server.url, timeout=httpx.Timeout(HANG_GUARD_S, connect=5)) as c:
        yield c


class OpenAPI(dict):
    """The server's /openapi.json, shown by name in Hypothesis's failure reports, not in full."""

    def __repr__(self) -> str:
        return "<the server's /openapi.json>"


@pytest.fixture(scope="module")
def openapi(client) -> OpenAPI:
    r = client.get("/openapi.json")
    assert r.status_code == 200, r.text
    return OpenAPI(r.json())


def greedy_answers(client: httpx.Client) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for path, body in GREEDY.items():
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["text"] if path == COMPLETIONS else choice["message"]["content"]
        out[path] = (text, choice["token_ids"])
    return out


def exchange(client: httpx.Client, path: str, body: bytes, content_type: str | None) -> None:
    try:
        answer = send(client, path, body, content_type)
    except httpx.TimeoutException as e:
        raise AssertionError(
            f"no answer within {HANG_GUARD_S}s ({type(e).__name__}); body sent: {body[:2000]!r}"
        ) from e
    assert_sane(answer, body)


def noted_exchange(client: httpx.Client, path: str, body: bytes, content_type: str | None) -> None:
    """`exchange`, with what was sent in Hypothesis's report of a failing example."""
    note(f"POST {path} content-type={content_type!r} body={body[:4000]!r}")
    exchange(client, path, body, content_type)


FUZZ_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, print_blob=False, suppress_health_check=list(HealthCheck)
)


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@settings(max_examples=SCHEMA_EXAMPLES, **FUZZ_SETTINGS)
@given(data=st.data())
def test_bodies_from_the_schema_and_mutated_never_get_a_5xx(client, openapi, path, data):
    body, _ = data.draw(request_bodies(openapi, path), label="body")
    noted_exchange(client, path, render(body), "application/json")


# Bodies that once got a 500: run by the raw fuzzer every time, and before the unharmed-server check.
ONCE_GOT_A_500 = [
    (
        CHAT,
        b'{"model": "a0", "messages": [{"role": "system", "content": [{"type": "text", "text": null}]}], '
        b'"max_tokens": 1}',
        "application/json",
    ),
    (
        CHAT,
        b'{"model": "a0", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}], '
        b'"max_tokens": 1, "stream": true}',
        "application/json",
    ),
]
# What the unharmed-server check sends between its two greedy requests: the shapes the fuzzers
# draw from, one of each (a test of its own, so it needs no other test to have run first).
HOSTILE = [
    *ONCE_GOT_A_500,
    (COMPLETIONS, b"\xff\xfe\xfd", "application/json"),
    (COMPLETIONS, b"[" * 100_000, "application/json"),
    (CHAT, b'{"a":' * 50_000, "application/json"),
    (COMPLETIONS, VALID_RAW[COMPLETIONS], "text/plain"),
    (COMPLETIONS, b'{"model": "a0", "prompt": "hi", "max_tokens": 1e999}', "application/json"),
    (COMPLETIONS, b'{"model": "a1", "prompt": "\\ud800", "max_tokens": 2, "stream": true}', "application/json"),
    (CHAT, b'{"model": "a2", "messages": [], "max_tokens": -1, "n": NaN}', "application/json"),
    (COMPLETIONS, b'{"model": "a0", "prompt": "hi", "max_tokens": 4, "stream": true, "n": 2}', "application/json"),
]


@settings(max_examples=RAW_EXAMPLES, **FUZZ_SETTINGS)
@given(request=raw_requests())
@example(request=ONCE_GOT_A_500[0])
@example(request=ONCE_GOT_A_500[1])
def test_raw_bytes_and_wrong_content_types_never_get_a_5xx(client, request):
    noted_exchange(client, *request)


def test_the_server_is_unharmed_by_hostile_bodies(tiny_server, client):
    before = greedy_answers(client)
    for request in HOSTILE:
        exchange(client, *request)
    r = httpx.get(f"{tiny_server.url}/health", timeout=30)
    assert r.status_code == 200, r.text
    assert greedy_answers(client) == before
    # Every admitted completion was released once answered (a leak would end in 429s for everyone).
    deadline = time.monotonic() + 30
    while (in_flight := admitted(client)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert in_flight == 0


def admitted(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("dlora_admitted_completions "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("/metrics has no dlora_admitted_completions")
