"""The in-process engine shared by the modules that test switching on vLLM's LoRA ops."""

from __future__ import annotations

import pytest

from tests import schedule
from tests.engine_ext.inprocess import SharedEngine


@pytest.fixture(scope="session")
def merged_switching_engine(tiny_model):
    """One in-process engine with dlora's scheduler and worker extension, vLLM's LoRA ops, and the
    `merged` policy changing models every step (a merge or unmerge in the middle of most
    generations): shared by test_switching_engine.py and test_merge_guard.py."""
    engine = SharedEngine(tiny_model, {"policy": "merged", "merged_max_iters": 1}).start()
    yield schedule.SHARED.register("merged_switching_engine", engine)
    engine.stop()
