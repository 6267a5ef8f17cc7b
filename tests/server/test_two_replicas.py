"""The server with two replicas: same greedy outputs, both replicas serve, per-replica metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests import harness

PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]


@pytest.fixture(scope="module")
def two_replica_server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    cfg = harness.tiny_config(tiny_model, tmp / "state", harness.free_port(),
                              **{"cluster": {"num_replicas": 2, "dispatch": "least_loaded", "monitor_interval_s": 0.5}})
    server = harness.launch(tmp, cfg)
    yield server
    server.stop()


def test_mixed_batch_over_two_replicas_equals_hf(two_replica_server, oracle):
    url = two_replica_server.url
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "replicas_healthy": 2, "replicas": 2}
    jobs = [(m, p) for m in ["tiny-base", "a0", "a1", "a2"] for p in PROMPTS]

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:
            async def one(m, p):
                r = await c.post(f"{url}/v1/completions", json={
                    "model": m, "prompt": p, "max_tokens": 24, "temperature": 0, "return_token_ids": True})
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
        assert f'dlora_adapters_resident{{replica="{rid}"}} 3.0' in text
    assert "dlora_migrations_total" in text and "dlora_request_resubmissions_total 0.0" in text
    listed = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters").json()["data"]}
    assert listed["a1"]["resident_on"] == [0, 1]  # the registry is cluster-wide
