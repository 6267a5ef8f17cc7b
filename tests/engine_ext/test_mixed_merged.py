"""Mixed merged steps in the engine integration: while a0 is merged, other adapters' and base
requests run in the same steps (their LoRA layers compensate a0's delta).

An in-process engine (tiny model, fp32, einsum backend) under the `dlora` policy merges a0 in the
middle of a concurrent generation: the greedy outputs equal the `unmerged` policy's (and HF +
PEFT), and the scheduler's per-step record shows a1 and base requests scheduled on the merged
weights. Plus the piece that needs no engine: mixing is off with vLLM's LoRA ops (a merged
adapter keeping its LoRA slot is in test_step_plan.py).
"""

from __future__ import annotations

import pytest

from dlora.engine_ext.scheduler import policy_from
from dlora.replica.engine import BATCHING_CONFIG_KEY
from dlora.scheduling import make_policy
from tests.engine_ext.inprocess import inprocess_engine
from tests.engine_ext.test_switching_engine import PROMPTS, lora, record_steps

# (adapter, prompt, max_tokens), in arrival order. a0 starts with 3 of 8 requests (ratio 0.375, not
# > alpha 0.5); once a1's first two and the first base request finish (6, 10, 12 tokens) its share
# is 3/5 > alpha, and a0 is merged while a1 and the base model still have 10 tokens to go.
JOBS = [("a0", p, 24) for p in PROMPTS[:3]] + [
    ("a1", PROMPTS[0], 6),
    ("a1", PROMPTS[1], 12),
    ("a1", PROMPTS[3], 22),
    (None, "The quick brown", 10),
    (None, "x = 1\n", 22),
]
MIXING = {"policy": "dlora", "alpha": 0.5, "beta": 0.3, "mixed_merged": True}


def test_mixing_is_opt_in_and_off_with_vllms_lora_ops():
    on = {BATCHING_CONFIG_KEY: {"policy": "dlora", "mixed_merged": True}}
    assert policy_from(on, "einsum")[1].mixed_merged
    assert not policy_from(on, "vllm")[1].mixed_merged
    default = {BATCHING_CONFIG_KEY: {"policy": "dlora"}}
    assert not policy_from(default, "einsum")[1].mixed_merged


@pytest.fixture(scope="module")
def llm(tiny_model):
    """One in-process engine on the einsum backend with the `dlora` policy set to merge at 0.5."""
    with inprocess_engine(tiny_model, MIXING, backend="einsum") as engine:
        yield engine


def generate(llm, tiny_model):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for *_, n in JOBS]
    outs = llm.generate(
        [p for _, p, _ in JOBS],
        params,
        lora_request=[lora(tiny_model, a) if a else None for a, *_ in JOBS],
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.engine
def test_others_run_while_merged_and_outputs_equal_unmerged(llm, tiny_model, oracle):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler._dlora_mixing and llm.collective_rpc("dlora_can_mix") == [True]
    dlora_policy, scheduler.batching_policy = scheduler.batching_policy, make_policy("unmerged")
    try:
        unmerged = generate(llm, tiny_model)
    finally:
        scheduler.batching_policy = dlora_policy
    steps, unwrap = record_steps(scheduler)
    try:
        mixed = generate(llm, tiny_model)
    finally:
        unwrap()
    assert mixed == unmerged
    tok = oracle.tokenizer()
    for (adapter, prompt, n), ids in zip(JOBS, mixed):
        assert ids == oracle.greedy(adapter, tok(prompt)["input_ids"], n), adapter
    # The merge came mid-generation, and a1 and base requests kept running on a0's merged weights.
    merge_at = next(i for i, (w, _, cmd) in enumerate(steps) if cmd and w == "a0")
    assert 5 < merge_at < 20, steps
    assert steps[merge_at][1] == {"a0", "a1", None}
    mixed_steps = [ran for w, ran, _ in steps if w == "a0" and ran > {"a0"}]
    assert len(mixed_steps) >= 5 and all(ran == {"a0", "a1", None} for ran in mixed_steps)
    assert all(r.num_preemptions == 0 for r in scheduler.requests.values())
    (state,) = llm.collective_rpc("dlora_state")  # still merged: no step has run since
    assert (state["merged_adapter"], state["mixing"], state["remap"]) == ("a0", True, [])
    assert state["merged_slot"] in (0, 1)


@pytest.mark.engine
def test_out_of_band_merge_mixes_and_a_failed_merge_clears_the_slot(llm, tiny_model, oracle, tmp_path):
    """Worker side alone (the `unmerged` policy never switches): with a0 merged, a0, a1 and base
    requests in one batch equal HF + PEFT; a failed merge leaves no merged slot behind."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    policy, scheduler.batching_policy = scheduler.batching_policy, make_policy("unmerged")
    jobs = [("a0", PROMPTS[0], 8), ("a1", PROMPTS[1], 8), (None, PROMPTS[2], 8)]
    tok = oracle.tokenizer()
    want = [oracle.greedy(a, tok(p)["input_ids"], n) for a, p, n in jobs]

    def run():
        from vllm import SamplingParams

        outs = llm.generate(
            [p for _, p, _ in jobs],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            lora_request=[lora(tiny_model, a) if a else None for a, *_ in jobs],
            use_tqdm=False,
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    try:
        assert run() == want  # also unmerges in-band whatever an earlier test left merged
        a0 = lora(tiny_model, "a0")
        (report,) = llm.collective_rpc("dlora_apply", args=("merge", "a0", a0.lora_path, a0.lora_int_id))
        assert report["ok"]
        assert run() == want
        (state,) = llm.collective_rpc("dlora_state")
        assert state["merged_adapter"] == "a0" and state["merged_slot"] in (0, 1)
        broken = tmp_path / "broken"
        broken.mkdir()
        (report,) = llm.collective_rpc("dlora_apply", args=("merge", "a0", str(broken), a0.lora_int_id))
        assert not report["ok"]
        (state,) = llm.collective_rpc("dlora_state")
        assert (state["merged_adapter"], state["merged_slot"], state["remap"]) == (None, None, [])
        assert run() == want
    finally:
        llm.collective_rpc("dlora_apply", args=("unmerge",))
        scheduler.batching_policy = policy
