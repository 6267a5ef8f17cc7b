"""Merged/unmerged switching inside a real vLLM engine (in-process, tiny model, fp32).

Checks what outputs alone could miss: while an adapter is merged no other request is ever
scheduled, hidden requests are never preempted, the base weights come back bit-exactly
(identical logprobs) after any sequence of merges, unmerges and failed merges, and cached KV blocks
are reused only in the weight state they were computed in.
"""

from __future__ import annotations

import json
import shutil

import pytest

from dlora.engine_ext.adapter_factors import read_adapter
from dlora.engine_ext.inband import CMDS_ATTR
from dlora.engine_ext.step_trace import StepTrace
from tests.harness import TINY_KV_BLOCKS

pytestmark = pytest.mark.engine  # an in-process vLLM engine

ADAPTERS = ("a0", "a1", "a2")
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]
MAX_TOKENS = 16


@pytest.fixture
def llm(merged_switching_engine):
    return merged_switching_engine.llm


def lora(tiny_model, name):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, ADAPTERS.index(name) + 1, str(tiny_model.adapters[name]))


def params(logprobs=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def base_logprobs(llm):
    out = llm.generate(["The quick brown", "x = 1\n"], params(logprobs=3), use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
        for o in out
    ]


def record_steps(scheduler):
    """Wrap the scheduler instance: per step, (weights merged during it, adapters it scheduled)."""
    steps = []
    orig = scheduler.update_from_output

    def update_from_output(scheduler_output, model_runner_output):
        ran = {
            scheduler.requests[i].lora_request.lora_name if scheduler.requests[i].lora_request else None
            for i in scheduler_output.num_scheduled_tokens
        }
        steps.append((scheduler._dlora_worker.weights, ran, bool(getattr(scheduler_output, CMDS_ATTR, None))))
        return orig(scheduler_output, model_runner_output)

    scheduler.update_from_output = update_from_output
    return steps, lambda: setattr(scheduler, "update_from_output", orig)


def scheduler_trace(directory):
    (path,) = directory.glob("steps-*.jsonl")
    return path.read_text().splitlines()


def test_mixed_workload_switching_every_step(llm, tiny_model, oracle, tmp_path):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    before = base_logprobs(llm)
    jobs = [(a, p) for a in (None, *ADAPTERS) for p in PROMPTS]
    steps, unwrap = record_steps(scheduler)
    scheduler._dlora_trace = StepTrace(tmp_path)  # what DLORA_STEP_TRACE=<dir> opens at start
    try:
        outs = llm.generate(
            [p for _, p in jobs],
            params(),
            lora_request=[lora(tiny_model, a) if a else None for a, _ in jobs],
            use_tqdm=False,
        )
    finally:
        unwrap()
        scheduler._dlora_trace.close()
        scheduler._dlora_trace = None
    # The step trace tells the same story, one line per step.
    lines = [json.loads(line) for line in scheduler_trace(tmp_path)]
    assert [(t["weights"], set(t["scheduled"])) for t in lines] == [
        (w, {"" if a is None else a for a in ran}) for w, ran, _ in steps
    ]
    assert sum(sum(t["scheduled"].values()) for t in lines) <= sum(t["allowed"] for t in lines)
    assert all(sum(t["unfinished"].values()) >= t["allowed"] > 0 and t["step_s"] >= t["switch_s"] >= 0 for t in lines)
    assert sum(1 for t in lines if t["switch_s"] > 0) == sum(1 for *_, cmd in steps if cmd)
    assert sum(t["tokens"] for t in lines) >= len(jobs) * MAX_TOKENS
    # Only the merged adapter's requests ran on merged weights.
    merged_steps = [(w, ran) for w, ran, _ in steps if w is not None]
    assert merged_steps and all(ran <= {w} for w, ran in merged_steps)
    assert sum(1 for *_, cmd in steps if cmd) >= 10
    assert scheduler.dlora_batching_state().num_switches >= 10
    assert all(r.num_preemptions == 0 for r in scheduler.requests.values())
    tok = oracle.tokenizer()
    for (adapter, prompt), o in zip(jobs, outs):
        assert list(o.outputs[0].token_ids) == oracle.greedy(adapter, tok(prompt)["input_ids"], MAX_TOKENS), adapter
    assert base_logprobs(llm) == before


def test_out_of_band_merges_and_failures_restore_the_base_exactly(llm, tiny_model, tmp_path):
    before = base_logprobs(llm)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model.adapters["a1"], broken)
    (broken / "adapter_model.safetensors").unlink()
    sequence = [
        ("merge", "a0"),
        ("merge", "a2"),
        ("unmerge", None),
        ("merge", "a1"),
        ("merge", "broken"),
        ("merge", "a2"),
        ("unmerge", None),
        ("unmerge", None),
    ]
    for op, name in sequence:
        path = str(broken if name == "broken" else tiny_model.adapters[name]) if name else None
        (report,) = llm.collective_rpc("dlora_apply", args=(op, name, path, 1))
        assert report["ok"] == (name != "broken"), report
    (state,) = llm.collective_rpc("dlora_state")
    assert state["merged_adapter"] is None and state["remap"] == []
    assert base_logprobs(llm) == before


def test_prepared_merge_is_a_swap_and_leaves_the_base_exact(llm, tiny_model, tmp_path):
    before = base_logprobs(llm)
    path = str(tmp_path / "a2-copy")  # files no earlier test merged (the cache knows a2 itself)
    shutil.copytree(tiny_model.adapters["a2"], path)
    (ok,) = llm.collective_rpc("dlora_prepare_merge", args=(path,))
    (state,) = llm.collective_rpc("dlora_state")
    assert ok and path in state["cached_merges"] and state["merged_adapter"] is None
    assert base_logprobs(llm) == before  # prepared, not merged
    reloads = state["reloads"]
    (report,) = llm.collective_rpc("dlora_apply", args=("merge", "a2", path, 3))
    (state,) = llm.collective_rpc("dlora_state")
    assert report["ok"] and state["reloads"] == reloads  # the merge was a swap
    (ok,) = llm.collective_rpc("dlora_prepare_merge", args=(str(tiny_model.adapters["a0"]),))
    assert not ok  # a2 is merged: a prepare must not touch the weights
    llm.collective_rpc("dlora_apply", args=("unmerge",))
    assert base_logprobs(llm) == before


def test_merged_weights_serve_the_adapter_without_lora(llm, tiny_model, oracle):
    """Merged + remapped, an adapter's requests equal HF + PEFT (its delta counted exactly once)."""
    a2 = lora(tiny_model, "a2")
    assert read_adapter(a2.lora_path).factors  # a2 also targets gate/up/down
    (report,) = llm.collective_rpc("dlora_apply", args=("merge", "a2", a2.lora_path, a2.lora_int_id))
    assert report["ok"]
    try:
        outs = llm.generate(PROMPTS, params(), lora_request=[a2] * len(PROMPTS), use_tqdm=False)
    finally:
        llm.collective_rpc("dlora_apply", args=("unmerge",))
    tok = oracle.tokenizer()
    for prompt, o in zip(PROMPTS, outs):
        assert list(o.outputs[0].token_ids) == oracle.greedy("a2", tok(prompt)["input_ids"], MAX_TOKENS)


def test_pinned_adapter_does_not_take_a_device_slot(llm, tiny_model, oracle):
    """dlora pins in the host cache only: with max_loras=2 and a0 pinned, a batch of a1 + a2 runs.

    (vLLM's own pin_lora also pins a device slot that its scheduler does not count; the same
    batch then dies with a KeyError inside the engine.)"""
    from dlora.scheduling import make_policy

    a0 = lora(tiny_model, "a0")
    llm.llm_engine.add_lora(a0)
    assert llm.collective_rpc("dlora_pin_lora", args=(a0.lora_int_id,)) == [True]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    policy, scheduler.batching_policy = scheduler.batching_policy, make_policy("unmerged")
    try:
        llm.generate([PROMPTS[0]], params(), lora_request=[a0], use_tqdm=False)  # a0 in a slot
        jobs = [(a, p) for p in PROMPTS for a in ("a1", "a2")]
        outs = llm.generate(
            [p for _, p in jobs], params(), lora_request=[lora(tiny_model, a) for a, _ in jobs], use_tqdm=False
        )
    finally:
        scheduler.batching_policy = policy
    tok = oracle.tokenizer()
    for (adapter, prompt), o in zip(jobs, outs):
        assert list(o.outputs[0].token_ids) == oracle.greedy(adapter, tok(prompt)["input_ids"], MAX_TOKENS), adapter


def test_prefix_cache_is_not_shared_across_weight_states(llm, tiny_model):
    """A request reuses only cached blocks computed in the weight state it runs in."""
    from dlora.scheduling import make_policy

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.kv_cache_manager.enable_caching
    prompt = "".join(
        f"weight_state_{i} = check({i}, {i * 7})\n" for i in range(20)
    )  # ~340 tokens, cached by no other test
    a0 = lora(tiny_model, "a0")
    prompt_tokens = []

    def run(policy_name):
        """(cached prompt tokens, weights merged during the steps) of one a0 request."""
        scheduler.batching_policy = make_policy(policy_name)
        steps, unwrap = record_steps(scheduler)
        try:
            (out,) = llm.generate([prompt], params(), lora_request=[a0], use_tqdm=False)
        finally:
            unwrap()
        prompt_tokens.append(len(out.prompt_token_ids))
        return out.num_cached_tokens, {w for w, *_ in steps}

    policy = scheduler.batching_policy
    try:
        assert run("unmerged") == (0, {None})
        block = scheduler.block_size
        assert prompt_tokens[0] > 2 * block
        reusable = (prompt_tokens[0] - 1) // block * block  # vLLM recomputes at least the last token
        assert run("unmerged") == (reusable, {None})  # the cache is on
        assert run("merged") == (0, {"a0"})  # a0 merged: its blocks computed unmerged are not reused
        # vLLM's lookup finds the older, unmerged copy of each block; the merged copy is taken instead.
        assert run("merged") == (reusable, {"a0"})
        assert run("unmerged") == (reusable, {None})
    finally:
        scheduler.batching_policy = policy


def test_state_reports_the_kv_capacity_the_engine_allocated(llm):
    """The balancer prices KV room with this (migration ILP, queued moves): the blocks the engine
    allocated (tests/harness.TINY_KV_BLOCKS, well under the 1 GiB of VLLM_CPU_KVCACHE_SPACE) times
    the block size, in tokens."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    capacity = scheduler.dlora_batching_state().kv_capacity_tokens
    assert capacity == TINY_KV_BLOCKS * scheduler.block_size
    # The engine's own block pool (one block is vLLM's null block, never handed out).
    assert scheduler.kv_cache_manager.block_pool.num_gpu_blocks == TINY_KV_BLOCKS
