"""Hostile adapter files on a real server (einsum LoRA backend, which reads every slot's weights):
each is refused with a 400 naming the problem and harms nobody; a registered adapter is served
from its snapshot, so deleting its source changes nothing, and a damaged snapshot fails only that
adapter's requests. The server is `einsum_server` (tests/conftest.py), shared with the einsum
backend's tests."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.server.test_admin_api import adapters_once, admin, complete

pytestmark = pytest.mark.engine  # a `dlora serve` process


@pytest.fixture
def roots(hostile_adapter_root):
    return hostile_adapter_root


@pytest.fixture
def server(einsum_server):
    return einsum_server


def _config(d, key, literal):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg[key] = "@@"
    (d / "adapter_config.json").write_text(json.dumps(cfg).replace('"@@"', literal))


def _nan_tensor(d):
    f = d / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(f))


def _symlink_escape(d, outside):
    outside.mkdir(exist_ok=True)
    weights = d / "adapter_model.safetensors"
    shutil.move(weights, outside / "w.safetensors")
    os.symlink(outside / "w.safetensors", weights)


BREAKAGES = {
    "nan_tensor": (_nan_tensor, "NaN or infinite values"),
    "nan_alpha": (lambda d: _config(d, "lora_alpha", "NaN"), "lora_alpha=nan must be finite"),
    "inf_alpha": (lambda d: _config(d, "lora_alpha", "Infinity"), "lora_alpha=inf must be finite"),
    "huge_alpha": (lambda d: _config(d, "lora_alpha", "1e30"), "<= 4096"),
    "zero_alpha": (lambda d: _config(d, "lora_alpha", "0"), "> 0"),
    "rank_zero": (lambda d: _config(d, "r", "0"), "rank r=0 must be a positive integer"),
    "pickle_bin": (
        lambda d: (d / "adapter_model.bin").write_bytes(b"\x80\x04K\x01."),
        "adapter_model.bin is a pickle file",
    ),
}


def good_request_matches_hf(url, oracle):
    for model, adapter in (("tiny-base", None), ("a1", "a1")):
        r = complete(url, model)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == oracle.greedy(adapter, choice["prompt_token_ids"], 6), model


def listed(url) -> dict:
    return {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]}


@pytest.mark.parametrize("breakage", [*BREAKAGES, "symlink_escape"])
def test_hostile_adapter_is_400_with_reason_and_harms_nobody(server, tiny_model, oracle, roots, tmp_path, breakage):
    bad = roots / f"bad-{breakage}"
    shutil.copytree(tiny_model.adapters["a3"], bad)
    if breakage == "symlink_escape":
        _symlink_escape(bad, tmp_path / "outside")
        reason = "adapter_model.safetensors resolves outside the adapter roots"
    else:
        mutate, reason = BREAKAGES[breakage]
        mutate(bad)
    r = admin(server.url, "/v1/load_lora_adapter", {"lora_name": breakage, "lora_path": str(bad)}, headers={})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"] == "BadRequestError" and err["param"] == "lora_path"
    assert complete(server.url, breakage).status_code == 404
    assert breakage not in listed(server.url)
    good_request_matches_hf(server.url, oracle)


def test_source_deleted_after_registration_is_served_from_the_snapshot(server, tiny_model, oracle, roots):
    src, filler = roots / "mine-src", roots / "filler-src"
    shutil.copytree(tiny_model.adapters["a3"], src)
    shutil.copytree(tiny_model.adapters["a2"], filler)
    url = server.url
    try:
        assert (
            admin(url, "/v1/load_lora_adapter", {"lora_name": "mine", "lora_path": str(src)}, headers={}).status_code
            == 200
        )
        snap = listed(url)["mine"]["path"]
        assert snap != str(src) and os.path.isdir(snap) and "/state/adapters/mine-" in snap
        assert complete(url, "mine").status_code == 200
        shutil.rmtree(src)
        # Push "mine" out of the engine's host LoRA cache (max_cpu_loras 4: a0 pinned, a1, a2,
        # mine), so its next request makes vLLM read its files again.
        for model in ("a1", "a2"):
            assert complete(url, model).status_code == 200
        assert (
            admin(
                url, "/v1/load_lora_adapter", {"lora_name": "filler", "lora_path": str(filler)}, headers={}
            ).status_code
            == 200
        )
        # Evicted: no longer resident (as the balancer reads it, every monitor interval).
        assert adapters_once(url, lambda found: found["mine"]["state"] == "registered")["mine"]["state"] == "registered"
        r = complete(url, "mine")
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == oracle.greedy("a3", choice["prompt_token_ids"], 6)
        good_request_matches_hf(url, oracle)
    finally:
        for name in ("mine", "filler"):
            admin(url, "/v1/unload_lora_adapter", {"lora_name": name}, headers={})


def test_a_deleted_snapshot_fails_only_its_own_adapter(server, tiny_model, oracle, roots):
    src = roots / "fragile-src"
    shutil.copytree(tiny_model.adapters["a3"], src)
    url = server.url
    try:
        assert (
            admin(url, "/v1/load_lora_adapter", {"lora_name": "fragile", "lora_path": str(src)}, headers={}).status_code
            == 200
        )
        assert complete(url, "fragile").status_code == 200
        shutil.rmtree(listed(url)["fragile"]["path"])
        r = complete(url, "fragile")
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "ServiceUnavailableError" and err["param"] == "model"
        assert "registered again" in err["message"]
        good_request_matches_hf(url, oracle)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    finally:
        assert admin(url, "/v1/unload_lora_adapter", {"lora_name": "fragile"}, headers={}).status_code == 200
