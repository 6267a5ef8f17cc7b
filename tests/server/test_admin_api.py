"""Admin API on a real server: load → serve → unload → 404, validation, auth, in-flight safety."""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from dlora.models.tiny import ADAPTER_SPECS
from tests.conftest import ADMIN_TOKEN
from tests.oracle import greedy_choice_errors, teacher_forced_logits

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def admin(url, path, body, headers=AUTH):
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def complete(url, model, **extra):
    return httpx.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": model, "prompt": "def f(", "max_tokens": 6, "temperature": 0, "return_token_ids": True} | extra,
    )


def adapters_once(url, ready, timeout_s: float = 10.0) -> dict[str, dict]:
    """/v1/adapters by name, once `ready` holds (residency is as the balancer last read it, every
    monitor interval) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", headers=AUTH, timeout=30).json()["data"]}
        if ready(listed) or time.monotonic() > deadline:
            return listed
        time.sleep(0.2)


def test_load_serve_unload_round_trip(tiny_server, tiny_model, oracle):
    url = tiny_server.url
    assert complete(url, "a3").status_code == 404
    r = admin(url, "/v1/load_lora_adapter", {"lora_name": "a3", "lora_path": str(tiny_model.adapters["a3"])})
    assert r.status_code == 200, r.text
    choice = complete(url, "a3").json()["choices"][0]
    assert choice["token_ids"] == oracle.greedy("a3", choice["prompt_token_ids"], 6)
    spec = {s.name: s for s in ADAPTER_SPECS}["a3"]
    listed = adapters_once(url, lambda listed: listed["a3"]["state"] == "resident")
    assert listed["a3"]["rank"] == spec.rank and listed["a3"]["state"] == "resident"
    assert listed["a3"]["target_modules"] == list(spec.target_modules)
    assert listed["a0"]["pinned"] is True
    assert "a3" in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}

    assert admin(url, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
    r = complete(url, "a3")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "a3" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert admin(url, "/v1/unload_lora_adapter", {"lora_name": "a3"}).status_code == 404


def test_auth_is_required_for_admin_routes(tiny_server, tiny_model):
    url = tiny_server.url
    body = {"lora_name": "x", "lora_path": str(tiny_model.adapters["a3"])}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_TOKEN}):
        r = admin(url, "/v1/load_lora_adapter", body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{url}/v1/adapters").status_code == 401
    assert admin(url, "/v1/unload_lora_adapter", {"lora_name": "a0"}, headers={}).status_code == 401


def test_duplicate_name_is_409(tiny_server, tiny_model):
    r = admin(
        tiny_server.url, "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": str(tiny_model.adapters["a1"])}
    )
    assert r.status_code == 409 and r.json()["error"]["param"] == "lora_name"


def test_path_outside_roots_is_403(tiny_server, tiny_model, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(tiny_model.adapters["a3"], outside)
    r = admin(tiny_server.url, "/v1/load_lora_adapter", {"lora_name": "sneaky", "lora_path": str(outside)})
    assert r.status_code == 403, r.text
    r = admin(
        tiny_server.url,
        "/v1/load_lora_adapter",
        {"lora_name": "sneaky", "lora_path": str(tiny_model.base.parent / ".." / "elsewhere")},
    )
    assert r.status_code == 403


@pytest.mark.parametrize(
    "breakage, reason",
    [
        ("missing_config", "adapter_config.json not found"),
        ("corrupt_weights", "safetensors"),
        ("rank_too_big", "exceeds the configured max_lora_rank"),
        ("not_a_dir", "not a directory"),
    ],
)
def test_bad_adapter_files_are_400_with_reason_and_harm_nobody(tiny_server, tiny_model, breakage, reason):
    bad = tiny_model.base.parent / f"bad-{breakage}"
    shutil.rmtree(bad, ignore_errors=True)
    if breakage != "not_a_dir":
        shutil.copytree(tiny_model.adapters["a3"], bad)
    if breakage == "missing_config":
        (bad / "adapter_config.json").unlink()
    elif breakage == "corrupt_weights":
        (bad / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    elif breakage == "rank_too_big":
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["r"] = 64
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
    try:
        r = admin(tiny_server.url, "/v1/load_lora_adapter", {"lora_name": f"bad-{breakage}", "lora_path": str(bad)})
        assert r.status_code == 400, r.text
        assert reason in r.json()["error"]["message"]
        assert complete(tiny_server.url, f"bad-{breakage}").status_code == 404
        assert complete(tiny_server.url, "a1").status_code == 200  # the engine is unharmed
    finally:
        shutil.rmtree(bad, ignore_errors=True)


def test_bad_admin_bodies(tiny_server):
    r = admin(tiny_server.url, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = admin(tiny_server.url, "/v1/load_lora_adapter", {"lora_name": "bad name!", "lora_path": "/x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"


def test_unload_refuses_while_requests_are_in_flight(tiny_server):
    url = tiny_server.url
    started = threading.Event()
    result = {}

    def long_stream():
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=120,
            json={
                "model": "a2",
                "prompt": "x",
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            },
        ) as r:
            tokens = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    started.set()
            result["tokens"] = tokens

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(60)
    r = admin(url, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert r.status_code == 409, r.text
    assert "in flight" in r.json()["error"]["message"]
    t.join(120)
    assert result["tokens"] == 400  # the stream finished untouched
    assert complete(url, "a2").status_code == 200


def test_pinning_beyond_the_host_lora_cache_is_400_and_unpinned_still_loads(tiny_server, tiny_model):
    # The tiny server: max_cpu_loras 4, max_loras 2, a0 pinned -> room for one more pinned adapter.
    url = tiny_server.url
    path = str(tiny_model.adapters["a1"])
    try:
        assert (
            admin(url, "/v1/load_lora_adapter", {"lora_name": "pin1", "lora_path": path, "pinned": True}).status_code
            == 200
        )
        r = admin(url, "/v1/load_lora_adapter", {"lora_name": "pin2", "lora_path": path, "pinned": True})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "cannot pin 'pin2'" in err["message"] and "engine.max_cpu_loras" in err["message"]
        assert "pin2" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
        assert admin(url, "/v1/load_lora_adapter", {"lora_name": "pin2", "lora_path": path}).status_code == 200
        assert complete(url, "pin2").status_code == 200
    finally:
        for name in ("pin1", "pin2"):
            admin(url, "/v1/unload_lora_adapter", {"lora_name": name})


def test_load_inplace_serves_new_weights_while_running_requests_finish_on_the_old(tiny_server, tiny_model, oracle):
    url, n_long = tiny_server.url, 400
    body = {"lora_name": "upd", "lora_path": str(tiny_model.adapters["a3"])}
    assert admin(url, "/v1/load_lora_adapter", body).status_code == 200
    prompt_ids = complete(url, "upd").json()["choices"][0]["prompt_token_ids"]
    started, done, old_tokens = threading.Event(), threading.Event(), []

    def long_stream_on_version_1():
        req = {"model": "upd", "prompt": "def f(", "max_tokens": n_long, "temperature": 0, "ignore_eos": True}
        req |= {"stream": True, "return_token_ids": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    old_tokens.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                    started.set()
        done.set()

    t = threading.Thread(target=long_stream_on_version_1)
    t.start()
    assert started.wait(60)
    assert admin(url, "/v1/load_lora_adapter", body).status_code == 409  # a re-registration is not an update
    update = admin(
        url, "/v1/load_lora_adapter", body | {"lora_path": str(tiny_model.adapters["a2"]), "load_inplace": True}
    )
    assert update.status_code == 200, update.text
    if not done.is_set():  # the old version stays loaded while a request still runs on it
        assert "unloaded version 1 of adapter upd" not in tiny_server.tail(400)
    choice = complete(url, "upd").json()["choices"][0]
    assert choice["token_ids"] == oracle.greedy("a2", prompt_ids, 6)  # new requests: the new weights
    t.join(120)
    # The running request: the old weights at every step (a greedy path compared step by step, so a
    # near-tie late in 400 tokens cannot fail it), and not the new ones.
    assert len(old_tokens) == n_long
    assert (
        greedy_choice_errors(teacher_forced_logits(oracle._load("a3"), prompt_ids, old_tokens), old_tokens, 1e-2) == []
    )
    assert (
        greedy_choice_errors(teacher_forced_logits(oracle._load("a2"), prompt_ids, old_tokens), old_tokens, 1e-2) != []
    )
    listed = {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", headers=AUTH).json()["data"]}
    assert listed["upd"]["version"] == 2 and listed["upd"]["rank"] == {s.name: s for s in ADAPTER_SPECS}["a2"].rank
    for _ in range(50):  # retired once its last request finished
        if "unloaded version 1 of adapter upd" in tiny_server.tail(400):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("version 1 of upd was never unloaded")
    assert admin(url, "/v1/unload_lora_adapter", {"lora_name": "upd"}).status_code == 200
