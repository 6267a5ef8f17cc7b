"""Registrations made through the admin API survive a server restart."""

from __future__ import annotations

import httpx
import pytest

from tests import harness

pytestmark = pytest.mark.engine  # `dlora serve` processes


def test_restart_keeps_registered_adapters(tiny_model, tmp_path):
    cfg = harness.tiny_config(tiny_model, tmp_path / "state", harness.free_port())
    body = {"prompt": "def f(", "max_tokens": 8, "temperature": 0, "return_token_ids": True}

    server = harness.launch(tmp_path / "first", cfg)
    try:
        r = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "late", "lora_path": str(tiny_model.adapters["a3"]), "pinned": True},
        )
        assert r.status_code == 200, r.text
        before = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "late"}, timeout=60).json()
    finally:
        server.stop()

    server = harness.launch(tmp_path / "second", cfg)
    try:
        ids = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert {"late", "a0", "a1", "a2"} <= ids
        adapters = {a["name"]: a for a in httpx.get(f"{server.url}/v1/adapters").json()["data"]}
        assert adapters["late"]["pinned"] is True and adapters["late"]["source"] == "api"
        after = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "late"}, timeout=60).json()
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    finally:
        server.stop()
