"""SeaLLM's service order inside a real engine (in-process, tiny model, fp32, einsum backend).

With `scheduling.order: seallm` and only 3 sequences at a time, the engine admits requests in the
policy's order instead of arrival order (it rewrites each request's vLLM priority, which its
priority queues and its preemption follow); the greedy outputs are those of HF + PEFT whatever the
order.
"""

from __future__ import annotations

import pytest

from tests.engine_ext.inprocess import inprocess_engine
from tests.engine_ext.test_switching_engine import PROMPTS, lora

pytestmark = pytest.mark.engine  # an in-process vLLM engine

# Long a0 requests first, then short a1 ones: FCFS would run the long ones first.
JOBS = [("a0", p, 24) for p in PROMPTS[:3]] + [("a1", p, 4) for p in PROMPTS] + [(None, "x = 1\n", 6)]


def test_seallm_order_changes_who_goes_first_not_what_they_say(tiny_model, oracle):
    from vllm import SamplingParams

    # alpha 1.0: never merge (the share of a batch is at most 1), so only the order decides who runs.
    order = {"policy": "dlora", "order": "seallm", "merge_planner": False, "alpha": 1.0, "beta": 0.95}
    with inprocess_engine(tiny_model, order, backend="einsum", max_num_seqs=3) as llm:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler._dlora_service_order
        admitted: list[str] = []
        schedule = scheduler.schedule

        def recording(*args, **kwargs):
            out = schedule(*args, **kwargs)
            admitted.extend(r.req_id for r in out.scheduled_new_reqs)
            return out

        scheduler.schedule = recording
        # Teach the policy the adapters' lengths (a0 writes long outputs, a1 short ones).
        warm = [("a0", PROMPTS[0], 24)] * 8 + [("a1", PROMPTS[1], 4)] * 8
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for *_, n in warm]
        llm.generate(
            [p for _, p, _ in warm], params, lora_request=[lora(tiny_model, a) for a, *_ in warm], use_tqdm=False
        )
        admitted.clear()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for *_, n in JOBS]
        outs = llm.generate(
            [p for _, p, _ in JOBS],
            params,
            lora_request=[lora(tiny_model, a) if a else None for a, *_ in JOBS],
            use_tqdm=False,
        )
        scheduler.schedule = schedule
        assert not scheduler._dlora_client_priority  # forgotten when each request finished
    tok = oracle.tokenizer()
    for (adapter, prompt, n), o in zip(JOBS, outs):
        assert list(o.outputs[0].token_ids) == oracle.greedy(adapter, tok(prompt)["input_ids"], n), adapter
    ids = [o.request_id for o in outs]
    first_three = {i.split("-")[0] for i in admitted[:3]}  # the engine's id is the client's + "-" + a suffix
    assert first_three != set(ids[:3]), admitted  # not arrival order: short a1 requests came in first
    assert any(i in first_three for i in ids[3:7]), admitted
