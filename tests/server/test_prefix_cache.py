"""A repeated prompt is found in its replica's prefix cache, as the engine reports it: /metrics
counts the prompt tokens sent and those found cached per replica and adapter, and the same text
under another adapter finds nothing (vLLM keys cached blocks by the adapter version)."""

from __future__ import annotations

import httpx
import pytest

from tests.harness import metric

pytestmark = pytest.mark.engine  # the shared tiny server (tests/conftest.py): one replica

PROMPT = list(range(10, 310))  # 300 token ids: at least two full KV blocks


def tokens(url: str, kind: str, adapter: str) -> float:
    try:
        return metric(url, f'dlora_prefix_cache_{kind}_tokens_total{{adapter="{adapter}",replica="0"}}')
    except KeyError:
        return 0.0


def complete(url: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def test_a_repeated_prompt_is_served_from_the_prefix_cache_of_its_adapter_only(tiny_server):
    url = tiny_server.url
    sent, hit = tokens(url, "prompt", "a1"), tokens(url, "hit", "a1")
    complete(url, "a1")
    complete(url, "a1")
    assert tokens(url, "prompt", "a1") - sent == 2 * len(PROMPT)
    # the repeat reused every full block of the first (vLLM recomputes at least the last token)
    assert 256 <= tokens(url, "hit", "a1") - hit < len(PROMPT)
    other_sent, other_hit = tokens(url, "prompt", "a2"), tokens(url, "hit", "a2")
    complete(url, "a2")
    assert tokens(url, "prompt", "a2") - other_sent == len(PROMPT)
    assert tokens(url, "hit", "a2") == other_hit
