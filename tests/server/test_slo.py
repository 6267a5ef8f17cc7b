"""SLOs on a real server: an adapter loaded with an SLO through the admin API (a bad one is a 400
naming the key), served through the official OpenAI client, listed by GET /v1/adapters with its
SLO, counted in /metrics (met, attainment, normalized latency), kept by an in-place update, and
gone from /metrics once unloaded. The same routes in process, without engines: test_slo_admin.py."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.engine  # the shared `dlora serve` process (tiny_server)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NAME = "slo-a3"  # a3's files under a name no other test uses; unloaded at the end
LOOSE = {"ttft_s": 60.0, "tpot_s": 10.0}  # met by every tiny-model request
PROMPTS = ("def f(", "x = 1", "print(")


def admin(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=120)


def listed(url: str) -> dict:
    return httpx.get(f"{url}/v1/adapters", headers=AUTH, timeout=30).json()


def slo_samples(url: str) -> dict[tuple[str, str, str | None], float]:
    """(sample name, adapter, outcome) -> value for the dlora_slo_* samples of a scrape. The router
    counts a request before its last chunk is sent, so no wait for the balancer's loop is needed."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name.startswith("dlora_slo_"):
                out[s.name, s.labels["adapter"], s.labels.get("outcome")] = s.value
    return out


def test_an_adapters_slo_is_listed_counted_exported_and_dropped_with_it(tiny_server, tiny_model):
    from openai import OpenAI

    url = tiny_server.url
    path = str(tiny_model.adapters["a3"])
    bad = admin(
        url, "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": path, "slo": {"ttft_s": -1, "tpot_s": 1}}
    )
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert (err["type"], err["param"]) == ("BadRequestError", "slo")
    assert err["message"].startswith("slo.ttft_s=-1: must be a finite number of seconds > 0")
    assert NAME not in {a["name"] for a in listed(url)["data"]}

    r = admin(url, "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": path, "slo": LOOSE})
    assert r.status_code == 200, r.text
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for prompt in PROMPTS:
            c = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0)
            assert c.usage.completion_tokens == 4
        client.completions.create(model="tiny-base", prompt=PROMPTS[0], max_tokens=2, temperature=0)

        listing = listed(url)
        by_name = {a["name"]: a for a in listing["data"]}
        assert by_name[NAME]["slo"] == {**LOOSE, "relative_k": None, "source": "adapter"}
        relative = {"ttft_s": None, "tpot_s": None, "relative_k": 5.0, "source": "relative"}
        assert by_name["a1"]["slo"] == relative == listing["slo_default"]  # the tiny config sets no slo:
        assert set(listing["isolated"]) == {"per_iteration_s", "per_decode_token_s", "per_prefill_token_s"}
        assert all(v >= 0 for v in listing["isolated"].values())

        samples = slo_samples(url)
        assert samples["dlora_slo_requests_total", NAME, "met"] == len(PROMPTS)
        assert samples["dlora_slo_requests_total", NAME, "missed"] == 0
        assert samples["dlora_slo_attainment", NAME, None] == 1.0
        assert samples["dlora_slo_normalized_latency", NAME, None] > 0
        assert samples["dlora_slo_requests_total", "", "met"] + samples["dlora_slo_requests_total", "", "missed"] >= 1

        r = admin(url, "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": path, "load_inplace": True})
        assert r.status_code == 200, r.text
        updated = {a["name"]: a for a in listed(url)["data"]}[NAME]
        assert updated["version"] == 2 and updated["slo"]["source"] == "adapter"
        assert (updated["slo"]["ttft_s"], updated["slo"]["tpot_s"]) == (LOOSE["ttft_s"], LOOSE["tpot_s"])
        # the counts are the adapter's, whatever its version
        assert slo_samples(url)["dlora_slo_requests_total", NAME, "met"] == len(PROMPTS)
    finally:
        assert admin(url, "/v1/unload_lora_adapter", {"lora_name": NAME}).status_code == 200
    assert not any(adapter == NAME for _, adapter, _ in slo_samples(url))
