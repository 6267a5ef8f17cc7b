"""Every config under configs/ loads. configs/tiny.yaml is served by tests/server/test_restart.py,
configs/default.yaml by tests/server/test_default_config.py; the GPU configs load here but can only
start on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dlora import config
from dlora.models.smollm2 import resolve_model_path

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads(path):
    cfg = config.load(path)
    assert cfg.model.path  # a model is named
    for spec in cfg.adapters:
        assert Path(spec.path).is_absolute()


def test_auto_tiny_resolves_to_the_test_model(tiny_model):
    assert Path(resolve_model_path("auto:tiny")) == tiny_model.base
