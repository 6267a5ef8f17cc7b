"""The server with two replicas: same greedy outputs, both replicas serve, per-replica metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.harness import TINY_KV_BLOCKS as KV_BLOCKS
from tests.harness import metric

pytestmark = pytest.mark.engine  # the shared two-replica `dlora serve` process (tests/conftest.py)

PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]


def test_mixed_batch_over_two_replicas_equals_hf(two_replica_server, oracle):
    url = two_replica_server.url
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok",
        "replicas_healthy": 2,
        "replicas": 2,
        "replicas_given_up": [],
    }
    jobs = [(m, p) for m in ["tiny-base", "a0", "a1", "a2"] for p in PROMPTS]
    resubmitted_before = metric(url, "dlora_request_resubmissions_total")

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:

            async def one(m, p):
                r = await c.post(
                    f"{url}/v1/completions",
                    json={"model": m, "prompt": p, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            return await asyncio.gather(*(one(m, p) for m, p in jobs))

    for (model, _), choice in zip(jobs, asyncio.run(run())):
        adapter = None if model == "tiny-base" else model
        assert choice["token_ids"] == oracle.greedy(adapter, choice["prompt_token_ids"], 24), model

    text = httpx.get(f"{url}/metrics").text
    for rid in ("0", "1"):
        assert f'dlora_replica_healthy{{replica="{rid}"}} 1.0' in text
        assert f'dlora_replica_kv_usage{{replica="{rid}"}}' in text
        assert f'dlora_adapters_resident{{replica="{rid}",state="host"}} 3.0' in text
    capacity = {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dlora_replica_kv_capacity_tokens{")
    }
    assert capacity.keys() == {"0", "1"} and capacity["0"] == capacity["1"] > 0  # same engine config
    block = capacity["0"] / KV_BLOCKS  # the engine allocated exactly engine.num_kv_blocks blocks
    assert block in (16, 32, 64, 128), capacity
    assert "dlora_migrations_total" in text
    assert metric(url, "dlora_request_resubmissions_total") == resubmitted_before  # no replica failed meanwhile
    listed = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters").json()["data"]}
    assert listed["a1"]["resident_on"] == [0, 1]  # the registry is cluster-wide


def _total(text: str, name: str) -> float:
    """A metric summed over its label sets (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def _histograms(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        f"{h}_{part}": _total(text, f"dlora_{h}_{part}")
        for part in ("count", "sum")
        for h in ("request_queue_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds")
    }


def test_queue_time_is_observed_once_per_request_and_is_part_of_its_ttft(two_replica_server):
    url = two_replica_server.url
    before = _histograms(url)
    models = ["tiny-base", "a0", "a1", "a2"] * 5  # 20 requests at once over both replicas

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:
            rs = await asyncio.gather(
                *(
                    c.post(
                        f"{url}/v1/completions",
                        json={"model": m, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0},
                    )
                    for i, m in enumerate(models)
                )
            )
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]

    asyncio.run(run())
    # The replicas' measurements reach the router with their stats, which every scrape reads first.
    deadline = time.monotonic() + 15
    while True:
        after = _histograms(url)
        if after["request_queue_time_seconds_count"] - before["request_queue_time_seconds_count"] >= len(models):
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.2)
    delta = {k: after[k] - before[k] for k in after}
    assert delta["request_queue_time_seconds_count"] == len(models)
    assert delta["e2e_request_latency_seconds_count"] == len(models)
    # Waiting ends when an engine first schedules the request: before its prefill and first token.
    assert 0 < delta["request_queue_time_seconds_sum"] < delta["time_to_first_token_seconds_sum"]
    assert delta["request_queue_time_seconds_sum"] < delta["e2e_request_latency_seconds_sum"]
