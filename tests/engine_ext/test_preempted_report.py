"""The scheduler reports requests vLLM preempted back to its waiting queue (in-process engine,
tiny model, a KV cache too small for every request at once), so the router stops counting them
as running (tests/cluster/test_router.py covers the router's side)."""

from __future__ import annotations

import pytest

from tests.engine_ext.inprocess import inprocess_engine

pytestmark = pytest.mark.engine  # an in-process vLLM engine


@pytest.fixture(scope="module")
def llm(tiny_model):
    # 5 blocks (one is vLLM's null block) hold one max_model_len request; 6 requests growing to
    # ~300 tokens each cannot all stay.
    with inprocess_engine(tiny_model, {"policy": "unmerged"}, num_gpu_blocks_override=5) as engine:
        yield engine


def test_preempted_requests_are_reported_while_they_wait_and_only_then(llm):
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = SamplingParams(temperature=0, max_tokens=260, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", "x = 1\n" * 6, params)
    ran: set[str] = set()  # engine ids that have run a step
    seen: set[str] = set()
    done: dict[str, int] = {}
    counted = {}  # engine id -> vLLM's Request (kept: a finished one leaves scheduler.requests)
    while engine.has_unfinished_requests():
        counted.update(scheduler.requests)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
        reported = set(scheduler.dlora_batching_state().preempted)
        # each one ran before, holds no running slot now, and vLLM counts its preemption
        assert reported <= ran and not reported & {r.request_id for r in scheduler.running}
        assert all(scheduler.requests[rid].num_preemptions > 0 for rid in reported)
        seen |= reported
        ran |= {r.request_id for r in scheduler.running}
    assert seen, "the KV cache was large enough: nothing was preempted"
    # the cumulative count (/metrics dlora_preemptions_total) is vLLM's own per-request counts summed
    preemptions = sum(r.num_preemptions for r in counted.values())
    assert preemptions >= len(seen) and scheduler.dlora_batching_state().preemptions == preemptions
    assert scheduler.dlora_batching_state().preempted == ()  # all resumed and finished
    assert done == {f"r{i}": 260 for i in range(6)}
