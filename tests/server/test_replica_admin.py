"""GET /v1/replicas and POST /v1/replicas/{id}/drain on the real app, router and autoscaler over
simulated replicas (ToyReplica: deterministic tokens, no engine): an operator's drain moves the
replica's requests with none lost or changed and removes it; bad ids, a replica not serving, the
last one and a cluster without autoscaling get OpenAI-style errors. Draining with real engines
and streams in flight: tests/cluster/test_ray_replicas.py and bench/autoscale."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from dlora.app.asgi import _refresh_gauges
from dlora.config import from_dict
from dlora.sim.toy_replica import ToyReplica
from tests import harness
from tests.asgi_app import app_over

# The autoscaler's own decisions stay out of the way: one heartbeat an hour.
AUTOSCALE = {"min_replicas": 1, "max_replicas": 3, "heartbeat_s": 3600}


@contextlib.asynccontextmanager
async def toy_cluster(tiny_model, state_dir, autoscale: dict | None = AUTOSCALE):
    raw = harness.tiny_config(tiny_model, state_dir, 0)
    raw["cluster"] = {"num_replicas": 2, "dispatch": "least_loaded"}
    if autoscale is not None:
        raw["cluster"]["autoscale"] = autoscale
    cfg = from_dict(raw)
    replicas = [ToyReplica(i, step_s=0.01, max_running=2) for i in range(2)]
    make_replica = lambda rid: ToyReplica(rid, step_s=0.01)  # noqa: E731
    async with app_over(cfg, replicas, timeout_s=60, make_replica=make_replica) as served:
        yield served


async def completion(http: httpx.AsyncClient, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_an_operator_drain_moves_the_replicas_requests_and_removes_it(tiny_model, tmp_path):
    jobs = [(m, p) for m in ("tiny-base", "a0", "a1") for p in ("def f(", "x = [")]

    async def run():
        async with toy_cluster(tiny_model, tmp_path / "state") as (http, state):
            listed = (await http.get("/v1/replicas")).json()
            assert [{k: v for k, v in d.items() if k != "weights"} for d in listed["data"]] == [
                {"id": 0, "state": "serving", "given_up": False, "requests": 0},
                {"id": 1, "state": "serving", "given_up": False, "requests": 0},
            ]  # weights: tests/server/test_replica_weights.py
            reference = [await completion(http, m, p) for m, p in jobs]
            tasks = [asyncio.create_task(completion(http, m, p)) for m, p in jobs]
            routed = state.router.routed_counts
            while not (routed().get(0, 0) >= 2 and routed().get(1, 0) >= 2):
                await asyncio.sleep(0.005)
            busiest = max((0, 1), key=lambda r: routed().get(r, 0))
            r = await http.post(f"/v1/replicas/{busiest}/drain")
            assert r.status_code == 202 and r.json() == {"id": busiest, "state": "draining"}
            states = {d["id"]: d["state"] for d in (await http.get("/v1/replicas")).json()["data"]}
            assert states[busiest] == "draining" and states[1 - busiest] == "serving"
            _refresh_gauges(state)
            gauges = state.metrics.render().decode()
            assert 'dlora_replicas{state="draining"} 1.0' in gauges and 'dlora_replicas{state="serving"} 1.0' in gauges
            assert await asyncio.gather(*tasks) == reference  # nothing lost, repeated or changed
            while state.router.find_slot(busiest) is not None:
                await asyncio.sleep(0.01)
            assert [d["id"] for d in (await http.get("/v1/replicas")).json()["data"]] == [1 - busiest]
            (event,) = state.elastic.events
            assert (event.direction, event.reason, event.moved > 0) == ("in", "operator", True)
            _refresh_gauges(state)
            text = state.metrics.render().decode()
            assert 'dlora_scale_events_total{direction="in",reason="operator"} 1.0' in text
            # the one left is the last serving replica: draining it would leave its work nowhere
            r = await http.post(f"/v1/replicas/{1 - busiest}/drain")
            assert r.status_code == 409
            err = r.json()["error"]
            assert "last serving replica" in err["message"] and err["param"] == "replica_id"

    asyncio.run(run())


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/v1/replicas/7/drain", 404, "no replica 7"),
        ("/v1/replicas/x/drain", 400, "replica_id"),
        ("/v1/replicas/-1/drain", 404, "no replica -1"),
    ],
)
def test_a_drain_of_no_such_replica_is_an_error_naming_it(tiny_model, tmp_path, path, status, says):
    async def run():
        async with toy_cluster(tiny_model, tmp_path / "state") as (http, state):
            r = await http.post(path)
            assert r.status_code == status and says in r.json()["error"]["message"]
            assert [s.serving for s in state.router.slots] == [True, True]

    asyncio.run(run())


def test_a_second_drain_of_the_same_replica_is_a_409_and_a_fixed_cluster_drains_none(tiny_model, tmp_path):
    async def run():
        async with toy_cluster(tiny_model, tmp_path / "state") as (http, state):
            state.router.slot(0).healthy = False  # down: nothing serving there to drain
            listed = (await http.get("/v1/replicas")).json()["data"]
            assert [(d["id"], d["state"]) for d in listed] == [(0, "down"), (1, "serving")]
            r = await http.post("/v1/replicas/0/drain")
            assert r.status_code == 409 and "not serving (not healthy)" in r.json()["error"]["message"]
            state.router.slot(0).healthy = True
            tasks = [asyncio.create_task(completion(http, "a0", p)) for p in ("def f(", "x = [", "y = 1")]
            while not state.router.routed_counts().get(0):
                await asyncio.sleep(0.005)
            assert (await http.post("/v1/replicas/0/drain")).status_code == 202
            r = await http.post("/v1/replicas/0/drain")  # its requests are still moving off it
            assert r.status_code == 409 and "not serving (draining)" in r.json()["error"]["message"]
            await asyncio.gather(*tasks)
            while state.router.find_slot(0) is not None:
                await asyncio.sleep(0.01)
            r = await http.post("/v1/replicas/0/drain")  # gone now
            assert r.status_code == 404 and "no replica 0" in r.json()["error"]["message"]
        async with toy_cluster(tiny_model, tmp_path / "fixed", autoscale=None) as (http, state):
            r = await http.post("/v1/replicas/1/drain")
            assert r.status_code == 409 and "cluster.autoscale" in r.json()["error"]["message"]
            assert [s.serving for s in state.router.slots] == [True, True]

    asyncio.run(run())
