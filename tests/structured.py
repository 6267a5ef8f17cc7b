"""Structured-output requests (JSON schema, named and required tool calls) and what their answers
must satisfy, shared by the tests that send them through dlora's mechanisms (switching, a replica
killed mid-stream, the Batch API)."""

from __future__ import annotations

import json

import jsonschema

# Bounded choices, so a greedy answer of the tiny model ends (the test servers allow no free JSON
# whitespace: harness.tiny_config) and the grammar has a state worth resuming.
ORDER = {
    "type": "object",
    "properties": {
        "size": {"enum": ["small", "large"]},
        "count": {"enum": [1, 2, 3]},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["size", "count", "tags"],
    "additionalProperties": False,
}
# A long structured answer: still running when a replica is killed under it.
LONG_ORDER = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 40, "maxItems": 40}},
    "required": ["tags"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "place_order", "description": "Place an order", "parameters": ORDER},
}
MESSAGES = [{"role": "user", "content": "Order something for me."}]


def json_completion(model: str, prompt: str, schema: dict = ORDER, max_tokens: int = 120) -> dict:
    """/v1/completions under vLLM's `structured_outputs.json`."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }


def json_chat(model: str) -> dict:
    """/v1/chat/completions with OpenAI's `response_format: json_schema`."""
    return {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 120,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}},
    }


def tool_chat(model: str, tool_choice: str | dict) -> dict:
    """/v1/chat/completions that must call `place_order` (`tool_choice` "required" or named)."""
    return {
        "model": model,
        "messages": MESSAGES,
        "max_tokens": 160,
        "temperature": 0,
        "tools": [TOOL],
        "tool_choice": tool_choice,
    }


NAMED = {"type": "function", "function": {"name": "place_order"}}


def answer_of(url_path: str, response: dict, schema: dict = ORDER) -> object:
    """The structured value a response carries, checked against its schema: the completion's or
    message's JSON text, or the tool call's arguments."""
    choice = response["choices"][0]
    assert choice["finish_reason"] in ("stop", "tool_calls"), choice
    if url_path == "/v1/completions":
        text = choice["text"]
    elif choice["message"].get("tool_calls"):
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "place_order"
        text = call["function"]["arguments"]
    else:
        text = choice["message"]["content"]
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value
