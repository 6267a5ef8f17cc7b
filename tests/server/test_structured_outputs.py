"""Structured outputs through dlora's switching: JSON-schema completions, `response_format` chats and
tool calls (required and named) on the base model and three adapters, all in flight at once on
`einsum_server` (its policy merges and unmerges adapters every few steps, and runs unmerged ones in
merged steps). Each answer parses, fits its schema, and equals the same request's answer alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests import harness
from tests.structured import NAMED, answer_of, json_chat, json_completion, tool_chat

pytestmark = pytest.mark.engine  # a `dlora serve` process

JOBS = [
    ("/v1/completions", json_completion("tiny-base", "def main(")),
    ("/v1/completions", json_completion("a0", "for i in range(")),
    ("/v1/completions", json_completion("a1", "def main(")),
    ("/v1/completions", json_completion("a2", "import os")),
    ("/v1/chat/completions", json_chat("a1")),
    ("/v1/chat/completions", tool_chat("a2", NAMED)),
    ("/v1/chat/completions", tool_chat("a0", "required")),
]


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def switches(url: str) -> float:
    harness.wait_for_fresh_stats(url)  # /metrics shows replica stats as the balancer last read them
    return harness.metric(url, 'dlora_switches_total{replica="0"}')


def test_structured_outputs_hold_while_adapters_merge_and_unmerge(einsum_server):
    url = einsum_server.url
    alone = [post(url, path, body) for path, body in JOBS]
    before = switches(url)
    with ThreadPoolExecutor(len(JOBS)) as pool:
        together = list(pool.map(lambda job: post(url, *job), JOBS))
    assert switches(url) > before  # the mix did run across merges and unmerges
    for (path, body), one, mixed in zip(JOBS, alone, together):
        # the same greedy answer, token for token (tool calls' ids are random by nature)
        assert mixed["usage"] == one["usage"], body["model"]
        assert answer_of(path, mixed) == answer_of(path, one), body["model"]
