"""Fixtures for the model builders: fresh builds in temporary cache dirs, never in the repo."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """The other core runs other work; one thread also keeps HF numerics stable."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def fresh_tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding a tiny model built by the code under test (seed 0)."""
    from dlora.models.tiny import ensure_test_model

    root = tmp_path_factory.mktemp("tiny-cache")
    ensure_test_model(root, seed=0)
    return root


@pytest.fixture(scope="session")
def fresh_tiny(fresh_tiny_root: Path):
    from dlora.models.tiny import ensure_test_model

    return ensure_test_model(fresh_tiny_root, seed=0)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root in which SmolLM2 was just converted from the GGUF (about 20 s)."""
    from dlora.models.smollm2 import prepare_smollm2

    root = tmp_path_factory.mktemp("smollm2-cache")
    prepare_smollm2(root)
    return root


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_cache: Path) -> Path:
    from dlora.models.smollm2 import smollm2_dir as model_dir

    return model_dir(smollm2_cache)
