"""configs/tiny.yaml as shipped (its `auto:tiny` model included) serves, stops cleanly on Ctrl-C,
and the adapters registered through the admin API survive the restart."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests import harness

pytestmark = pytest.mark.engine  # `dlora serve` processes

TINY_YAML = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def stop_cleanly(server: harness.ServerProcess) -> None:
    server.stop()
    assert server.proc.returncode == 0, server.tail()
    log = server.log_path.read_text(errors="replace")
    assert "Application shutdown complete" in log and "Traceback" not in log


def test_tiny_yaml_serves_stops_cleanly_and_a_restart_keeps_registered_adapters(tiny_model, tmp_path):
    cfg = yaml.safe_load(TINY_YAML.read_text())
    cfg["server"].update(port=harness.free_port(), state_dir=str(tmp_path / "state"))
    body = {"prompt": "def f(", "max_tokens": 8, "temperature": 0, "return_token_ids": True}

    server = harness.launch(tmp_path / "first", cfg)
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "tiny-base"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        r = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "late", "lora_path": str(tiny_model.adapters["a3"]), "pinned": True},
        )
        assert r.status_code == 200, r.text
        before = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "late"}, timeout=60).json()
    finally:
        stop_cleanly(server)

    server = harness.launch(tmp_path / "second", cfg)
    try:
        ids = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert ids == {"tiny-base", "late"}
        adapters = {a["name"]: a for a in httpx.get(f"{server.url}/v1/adapters").json()["data"]}
        assert adapters["late"]["pinned"] is True and adapters["late"]["source"] == "api"
        after = httpx.post(f"{server.url}/v1/completions", json=body | {"model": "late"}, timeout=60).json()
        assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    finally:
        stop_cleanly(server)
