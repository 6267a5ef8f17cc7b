"""The admin routes and /metrics for SLOs, in process (no engine): a load body's `slo` is parsed
(bad values: a 400 in OpenAI's error shape naming the key, nothing registered), shown by
GET /v1/adapters with where it comes from, kept by an in-place update; the router's counts render
as the dlora_slo_* families, and an unloaded adapter's series go. The same on a real server:
tests/server/test_slo.py."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from dlora.adapters.lifecycle import ref_of
from dlora.config import DloraConfig
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.server import errors, routes_admin
from dlora.server.metrics import Metrics
from dlora.sim.toy_replica import ToyReplica
from dlora.slo.config import SloConfig
from tests.adapters.conftest import make_adapter, make_base
from tests.adapters.test_registration_placement import manager

LOOSE = {"ttft_s": 60, "tpot_s": 10}  # met by any toy request
TIGHT = {"ttft_s": 60, "tpot_s": 1e-6}  # no toy step is that short


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    root = tmp_path_factory.mktemp("micro")
    base = make_base(root / "base")
    return {"base": base, "good": make_adapter(base, root / "good")}


def serve(micro, state_dir, slo: SloConfig | None = None):
    """The admin routes over an adapter manager and router on a simulated replica."""
    mgr, router = manager(micro, state_dir, [ToyReplica(0)], slo=slo)
    app = FastAPI()
    errors.install(app)
    app.include_router(routes_admin.router)
    app.state.dlora = SimpleNamespace(cfg=DloraConfig(), adapters=mgr, router=router, metrics=Metrics())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dlora")
    return client, mgr, router, app.state.dlora.metrics


def load(client, name: str, path, **extra):
    # json.dumps writes NaN as JSON's NaN, which the server's parser takes (httpx's json= refuses it).
    body = json.dumps({"lora_name": name, "lora_path": str(path), **extra})
    return client.post("/v1/load_lora_adapter", content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("slo", "named"),
    [
        ({"ttft_s": -1, "tpot_s": 0.05}, "slo.ttft_s=-1: must be a finite number of seconds > 0"),
        ({"ttft_s": 0.5, "tpot_s": 0}, "slo.tpot_s=0: must be a finite number of seconds > 0"),
        ({"ttft_s": math.nan, "tpot_s": 0.05}, "slo.ttft_s: must be a finite number, got nan"),
        ({"ttft_s": "fast", "tpot_s": 0.05}, "slo.ttft_s='fast'"),
        ({"ttft_s": 0.5, "tpot_s": None}, "slo.tpot_s=None"),
        ({"ttft_s": 0.5}, "slo.tpot_s: missing"),
        ({"ttft_s": 0.5, "tpot_s": 0.05, "e2e_s": 3}, "slo.e2e_s: unknown key"),
        ([0.5, 0.05], "slo=[0.5, 0.05]: must be an object"),
        ("fast", "slo='fast': must be an object"),
    ],
)
def test_a_bad_slo_is_a_400_naming_the_key_and_registers_nothing(micro, tmp_path, slo, named):
    async def run():
        client, mgr, router, _ = serve(micro, tmp_path / "state")
        await router.start()
        r = await load(client, "a", micro["good"], slo=slo)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"].startswith(named)
        assert (err["type"], err["param"], err["code"]) == ("BadRequestError", "slo", 400)
        assert "a" not in mgr.registry and router.slo.target("a") is None
        await router.shutdown()

    asyncio.run(run())


def test_the_listing_shows_each_adapters_slo_and_where_it_comes_from(micro, tmp_path):
    async def run():
        client, _, router, _ = serve(micro, tmp_path / "state")
        await router.start()
        assert (await load(client, "own", micro["good"], slo={"ttft_s": 0.5, "tpot_s": 0.05})).status_code == 200
        assert (await load(client, "plain", micro["good"])).status_code == 200
        # An in-place update keeps the SLO unless it gives one.
        assert (await load(client, "own", micro["good"], load_inplace=True)).status_code == 200
        listing = (await client.get("/v1/adapters")).json()
        by_name = {a["name"]: a for a in listing["data"]}
        assert by_name["own"]["version"] == 2
        assert by_name["own"]["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05, "relative_k": None, "source": "adapter"}
        relative = {"ttft_s": None, "tpot_s": None, "relative_k": 5.0, "source": "relative"}
        assert by_name["plain"]["slo"] == relative and listing["slo_default"] == relative
        basis = router.slo.basis
        assert listing["isolated"] == {
            "per_iteration_s": basis.per_iteration_s,
            "per_decode_token_s": basis.per_decode_token_s,
            "per_prefill_token_s": basis.per_prefill_token_s,
        }
        await router.shutdown()

        client, _, router, _ = serve(micro, tmp_path / "other", slo=SloConfig(ttft_s=1.0, tpot_s=0.1))
        await router.start()
        assert (await load(client, "plain", micro["good"])).status_code == 200
        listing = (await client.get("/v1/adapters")).json()
        absolute = {"ttft_s": 1.0, "tpot_s": 0.1, "relative_k": None, "source": "default"}
        assert listing["data"][0]["slo"] == absolute == listing["slo_default"]
        await router.shutdown()

    asyncio.run(run())


def samples(metrics: Metrics, router) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, for the dlora_slo_* families of a scrape."""
    metrics.update_cluster(router, 0)
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("dlora_slo_"):
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_metrics_render_per_adapter_outcomes_and_an_unloaded_adapter_goes(micro, tmp_path):
    async def run():
        client, mgr, router, metrics = serve(micro, tmp_path / "state")
        await router.start()
        assert (await load(client, "met", micro["good"], slo=LOOSE)).status_code == 200
        assert (await load(client, "missed", micro["good"], slo=TIGHT)).status_code == 200
        jobs = [("met", 3), ("missed", 2), (None, 1)]
        for name, n in jobs:
            adapter = None if name is None else ref_of(mgr.lookup(name))
            for i in range(n):
                async for _ in router.generate(
                    GenerateRequest(f"{name}-{i}", (1, 2), SamplingSpec(max_tokens=4), adapter)
                ):
                    pass
        got = samples(metrics, router)
        met = lambda adapter, outcome: got["dlora_slo_requests_total", (("adapter", adapter), ("outcome", outcome))]  # noqa: E731
        assert (met("met", "met"), met("met", "missed")) == (3, 0)
        assert (met("missed", "met"), met("missed", "missed")) == (0, 2)
        assert met("", "met") + met("", "missed") == 1  # the base model, held to the relative default
        assert got["dlora_slo_attainment", (("adapter", "met"),)] == 1.0
        assert got["dlora_slo_attainment", (("adapter", "missed"),)] == 0.0
        counts = router.slo.counts()["met"]
        normalized = got["dlora_slo_normalized_latency", (("adapter", "met"),)]
        assert normalized > 0 and math.isclose(normalized, counts.mean_normalized_latency)

        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "missed"})).status_code == 200
        after = samples(metrics, router)
        assert not any(("adapter", "missed") in labels for _, labels in after)
        assert ("dlora_slo_attainment", (("adapter", "met"),)) in after
        await router.shutdown()

    asyncio.run(run())
