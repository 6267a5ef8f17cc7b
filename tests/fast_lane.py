"""`pytest --fast` (make test-fast): the tests that start no vLLM engine, `dlora serve` process or Ray
cluster, in a few minutes on two cores.

Selection is by the `engine` marker: `--fast` deselects every test marked `engine`. A marker alone
drifts (a new test that starts a server but forgets the mark would slow the lane down unnoticed), so
the lane also replaces the four ways a test starts one with a function that fails the test and says
to mark it: `tests.harness.ServerProcess.start` (a `dlora serve` process), `ray.init` (a Ray cluster,
which replica actors need), and vLLM's `LLMEngine` and `AsyncLLM` constructors (in-process engines).
"""

from __future__ import annotations

from typing import Any

import pytest

MARKER = "engine"


class EngineStartedInFastLane(RuntimeError):
    pass


def select(items: list[pytest.Item], config: pytest.Config) -> None:
    """Drop the `engine`-marked items (reported as deselected, like `-m "not engine"`)."""
    slow = [item for item in items if item.get_closest_marker(MARKER) is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker(MARKER) is None]


def refuse_engine_starts(mp: pytest.MonkeyPatch) -> None:
    """Make every way of starting an engine, server or Ray cluster fail the test that tries."""
    import ray
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    from tests.harness import ServerProcess

    mp.setattr(ServerProcess, "start", _refuse("a `dlora serve` process"))
    mp.setattr(ray, "init", _refuse("a Ray cluster"))
    mp.setattr(LLMEngine, "__init__", _refuse("an in-process vLLM engine"))
    mp.setattr(AsyncLLM, "__init__", _refuse("a vLLM AsyncLLM engine"))


def _refuse(what: str):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise EngineStartedInFastLane(
            f"this test starts {what}, which the fast lane (pytest --fast) does not run: "
            f"mark it @pytest.mark.{MARKER} (or its module with pytestmark = pytest.mark.{MARKER})"
        )

    return refuse
