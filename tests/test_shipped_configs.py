"""Every config under configs/ loads, and the CPU smoke-test config actually serves.

configs/default.yaml is served by tests/server/test_default_config.py (it needs the converted
SmolLM2 model); the GPU configs load here but can only start on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from dlora import config
from dlora.models.smollm2 import resolve_model_path
from tests import harness

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path):
    cfg = config.load(path)
    assert cfg.model.path  # a model is named
    for spec in cfg.adapters:
        assert Path(spec.path).is_absolute()


def test_auto_tiny_resolves_to_the_test_model(tiny_model):
    assert Path(resolve_model_path("auto:tiny")) == tiny_model.base


@pytest.mark.engine
def test_tiny_yaml_serves_a_completion(tiny_model, tmp_path):
    """configs/tiny.yaml as shipped (its `auto:tiny` model included), on a free port and a
    throw-away state dir."""
    cfg = yaml.safe_load((CONFIGS[0].parent / "tiny.yaml").read_text())
    cfg["server"].update(port=harness.free_port(), state_dir=str(tmp_path / "state"))
    server = harness.launch(tmp_path, cfg)
    try:
        r = httpx.post(
            f"{server.url}/v1/completions",
            timeout=60,
            json={"model": "tiny-base", "prompt": "hello", "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
