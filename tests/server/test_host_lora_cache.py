"""Adapters placed by demand on a real two-replica server with a host LoRA cache counted in bytes.

Registration loads an unpinned adapter on one replica; a request sent to the other loads it there
too, and `/v1/adapters` then lists both; an unload frees every replica's host entry (its bytes);
with `engine.max_cpu_lora_mib` full, the least recently used unpinned adapter is unloaded and is
still served afterwards (loaded again).

Sizes of the tiny adapters' safetensors files: a0 (pinned) ~114 KiB, a1 ~58 KiB, a2 ~259 KiB. With a
0.5 MiB budget a replica holds a0 + a1 + a2 (~431 KiB) but not a0 + a2 + another copy of a2's size.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests import harness

pytestmark = pytest.mark.engine  # a two-replica `dlora serve` process

BUDGET_MIB = 0.5
BUDGET = int(BUDGET_MIB * (1 << 20))
PROMPT = "def main("
TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement")
    cfg = harness.tiny_config(
        tiny_model,
        tmp / "state",
        harness.free_port(),
        # least_loaded: of two requests at once, the second goes to the replica the first is not on.
        # No migration and no preload: every copy here comes from a request.
        **{
            "cluster": {
                "num_replicas": 2,
                "dispatch": "least_loaded",
                "monitor_interval_s": 0.3,
                "migration": False,
                "placement_interval_s": 3600.0,
            }
        },
    )
    cfg["engine"]["max_cpu_lora_mib"] = BUDGET_MIB
    srv = harness.launch(tmp, cfg)
    yield srv
    srv.stop(wait=False)


def listed(url: str) -> dict[str, dict]:
    return {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]}


def until(read, ok, timeout_s: float = 20.0):
    """`read()` once `ok` holds of it (the balancer reads the replicas every monitor interval)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if ok(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def on(url: str, name: str) -> list[int]:
    return listed(url).get(name, {}).get("resident_on", [])


def metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{sample} not in /metrics")


def host_bytes(url: str) -> dict[int, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {rid: metric(text, f'dlora_adapter_host_bytes{{replica="{rid}"}}') for rid in (0, 1)}


def register(url: str, name: str, path) -> None:
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=120)
    assert r.status_code == 200, r.text


def complete_pair(url: str, model: str) -> list[dict]:
    """Two requests at once (least_loaded sends them to different replicas when they overlap)."""

    async def run():
        async with httpx.AsyncClient(timeout=180) as c:
            body = {"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True}
            rs = await asyncio.gather(*(c.post(f"{url}/v1/completions", json=body) for _ in range(2)))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        return [r.json()["choices"][0] for r in rs]

    return asyncio.run(run())


def spread(url: str, model: str, weights: str, oracle) -> None:
    """Requests for `model` until both replicas hold it; every answer is HF's for `weights`."""
    for _ in range(6):
        for choice in complete_pair(url, model):
            assert choice["token_ids"] == oracle.greedy(weights, choice["prompt_token_ids"], TOKENS)
        if until(lambda: on(url, model), lambda r: r == [0, 1], timeout_s=3) == [0, 1]:
            return
    raise AssertionError(f"{model} never reached both replicas: {listed(url)[model]}")


def test_registration_loads_on_one_replica_demand_on_the_other_and_unload_frees_both(server, tiny_model, oracle):
    url = server.url
    start = until(lambda: listed(url), lambda got: all(got[a]["resident_on"] for a in ("a0", "a1", "a2")))
    assert start["a0"]["resident_on"] == [0, 1]  # pinned: everywhere
    assert len(start["a1"]["resident_on"]) == 1 and len(start["a2"]["resident_on"]) == 1  # one each
    before = until(lambda: host_bytes(url), lambda b: all(v > 0 for v in b.values()))

    register(url, "x", tiny_model.adapters["a1"])
    first = until(lambda: on(url, "x"), bool)
    assert len(first) == 1, first  # one replica checked it; the other has not loaded it
    size = listed(url)["x"]["size_bytes"]
    assert size == (tiny_model.adapters["a1"] / "adapter_model.safetensors").stat().st_size

    spread(url, "x", "a1", oracle)  # a request on the replica without it loads it there first
    x = listed(url)["x"]
    assert x["state"] == "resident" and [p["replica"] for p in x["replicas"]] == [0, 1]
    # Just served, nothing else since: it still holds a LoRA slot on both engines
    assert {p["state"] for p in x["replicas"]} == {"device"}, x
    text = httpx.get(f"{url}/metrics").text
    for rid in (0, 1):
        assert metric(text, f'dlora_adapters_resident{{replica="{rid}",state="device"}}') >= 1
    assert until(lambda: host_bytes(url), lambda b: b == {r: v + size for r, v in before.items()}) == {
        r: v + size for r, v in before.items()
    }

    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=60)
    assert r.status_code == 200, r.text
    assert "x" not in listed(url)
    assert until(lambda: host_bytes(url), lambda b: b == before) == before  # every replica's entry is gone


def test_a_full_host_cache_unloads_the_least_recently_used_adapter_which_is_served_again(server, tiny_model, oracle):
    url = server.url
    until(lambda: listed(url), lambda got: all(got[a]["resident_on"] for a in ("a0", "a1", "a2")))
    a2_home = on(url, "a2")
    assert len(a2_home) == 1
    register(url, "y", tiny_model.adapters["a2"])  # a2's size: a2 and y do not both fit beside a0 and a1
    spread(url, "y", "a2", oracle)  # y's copy on a2's replica unloads a2 there, its only copy
    assert until(lambda: on(url, "a2"), lambda r: r == []) == []
    assert listed(url)["a2"]["state"] == "registered"
    assert all(v <= BUDGET for v in host_bytes(url).values())

    for choice in complete_pair(url, "a2"):  # loaded again, in place of the least recently used
        assert choice["token_ids"] == oracle.greedy("a2", choice["prompt_token_ids"], TOKENS)
    assert until(lambda: on(url, "a2"), bool)
    assert listed(url)["a0"]["resident_on"] == [0, 1]  # the pinned adapter never leaves
    for _ in range(5):  # the budget holds at every read
        assert all(v <= BUDGET for v in host_bytes(url).values())
        time.sleep(0.3)
