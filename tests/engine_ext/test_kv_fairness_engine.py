"""MuxServe's fairness gap measured inside a real engine (in-process, tiny model, fp32, einsum
backend), with `scheduling.kv_quotas` off: the engine reports it in its state at every step, and
it follows the blocks each adapter holds against its request rate."""

from __future__ import annotations

import time

import pytest

from tests.engine_ext.inprocess import inprocess_engine
from tests.engine_ext.test_switching_engine import lora

pytestmark = pytest.mark.engine  # an in-process vLLM engine


def test_the_fairness_gap_is_measured_with_quotas_off(tiny_model):
    from vllm import SamplingParams

    # The first step after the period has passed measures both adapters' rates (3 requests each).
    scheduling = {"policy": "unmerged", "kv_quotas": False, "kv_quota_period_s": 0.5}
    with inprocess_engine(tiny_model, scheduling, backend="einsum") as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert not scheduler._dlora_kv_enforce
        gaps: list[tuple[float, dict]] = []
        schedule = scheduler.schedule

        def recording(*args, **kwargs):
            out = schedule(*args, **kwargs)
            gaps.append((scheduler.dlora_batching_state().kv_fairness_gap, dict(scheduler._dlora_kv_quotas.used)))
            return out

        scheduler.schedule = recording
        # a0's prompts take several KV blocks each, a1's one; both arrive in one step at equal rates.
        jobs = [("a0", "hello " * 120, 16)] * 3 + [("a1", "x", 16)] * 3
        time.sleep(0.6)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for *_, n in jobs]
        llm.generate(
            [p for _, p, _ in jobs], params, lora_request=[lora(tiny_model, a) for a, *_ in jobs], use_tqdm=False
        )
        scheduler.schedule = schedule
    assert all(isinstance(g, float) for g, _ in gaps)
    loaded = [(g, used) for g, used in gaps if used.get("a0") and used.get("a1")]
    assert loaded, gaps  # some step saw both adapters hold blocks
    assert any(g > 0 and used["a0"] > used["a1"] for g, used in loaded), loaded  # a0 holds more per unit rate
