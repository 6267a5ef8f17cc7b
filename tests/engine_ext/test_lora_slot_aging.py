"""Batch-slot aging inside a real vLLM engine (in-process, tiny model, max_loras 2).

a0 and a1 keep arriving, so both always have a request running and hold both LoRA batch slots;
one a2 request waits. Under vLLM's rule it is admitted only once the others stop arriving; with
`lora_slot_starve_s` it is admitted while they still arrive, after it has waited that long.
"""

from __future__ import annotations

import time

import pytest

from tests.engine_ext.inprocess import inprocess_engine

pytestmark = pytest.mark.engine  # an in-process vLLM engine

STARVE_S = 0.4
FEED_S = 3.0  # a0/a1 keep arriving this long


@pytest.fixture(scope="module")
def llm(tiny_model):
    with inprocess_engine(tiny_model, {"policy": "unmerged", "lora_slot_starve_s": STARVE_S}) as engine:
        yield engine


def lora(tiny_model, name):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int(name[1:]) + 1, str(tiny_model.adapters[name]))


def a2_wait(llm, tiny_model) -> tuple[float, bool]:
    """Seconds from a2's arrival to its first token, and whether a0/a1 were still arriving then."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    n = 0

    def feed():
        nonlocal n
        for name in ("a0", "a1"):
            engine.add_request(f"{name}-{n}", "x = 1\n", short, lora_request=lora(tiny_model, name))
        n += 1

    for _ in range(3):  # both slots taken before a2 comes
        feed()
        engine.step()
    arrived = time.monotonic()
    engine.add_request(
        "a2",
        "def f(",
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        lora_request=lora(tiny_model, "a2"),
    )
    first = None
    while engine.has_unfinished_requests():
        feeding = time.monotonic() - arrived < FEED_S
        if feeding:
            feed()
        for out in engine.step():
            if out.request_id == "a2" and out.outputs[0].token_ids and first is None:
                first = (time.monotonic() - arrived, feeding)
    assert first is not None
    return first


def test_a_starved_adapter_gets_a_slot_while_the_hot_ones_keep_arriving(llm, tiny_model):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    aging, drains = scheduler._dlora_slot_aging, scheduler.dlora_batching_state().lora_slot_drains
    waited, while_feeding = a2_wait(llm, tiny_model)
    assert while_feeding and STARVE_S <= waited < FEED_S / 2, waited
    assert scheduler.dlora_batching_state().lora_slot_drains == drains + 1
    assert aging.draining is None  # the drain ended once a2 ran

    scheduler._dlora_slot_aging = None  # vLLM's rule
    try:
        waited, while_feeding = a2_wait(llm, tiny_model)
    finally:
        scheduler._dlora_slot_aging = aging
    assert not while_feeding and waited >= FEED_S, waited
