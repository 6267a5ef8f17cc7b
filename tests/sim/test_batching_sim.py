"""The replica simulator: step times, batching limits, switch costs and the merged-weights cache,
checked on hand-worked cases with the real policies."""

from __future__ import annotations

import pytest

from dlora.scheduling import BatchingConfig, make_policy
from dlora.sim.batching_sim import BatchingSim, SimRequest
from dlora.sim.skew import SkewWorkload, simulate
from dlora.sim.step_costs import StepCosts, preset

# Round numbers: a step costs 10 ms + 1 ms per sequence + 0.1 ms per prompt token; the LoRA term
# adds 5 ms per step with adapter tokens + 2 ms per adapter sequence + 0.1 ms per adapter prompt token.
COSTS = StepCosts(
    fixed_s=0.010,
    per_seq_s=0.001,
    per_prefill_token_s=0.0001,
    lora_fixed_s=0.005,
    lora_per_seq_s=0.002,
    lora_per_prefill_token_s=0.0001,
    merge_cold_s=0.1,
    merge_cached_s=0.001,
    unmerge_s=0.002,
    merged_cache_entries=1,
)


def sim(policy="unmerged", costs=COSTS, config=None, **engine):
    return BatchingSim(make_policy(policy, config or BatchingConfig()), costs, **engine)


def test_one_request_is_a_prefill_step_then_one_decode_step_per_token():
    r = sim().run([SimRequest("r", "a", 0.0, prompt_tokens=100, output_tokens=4)])
    (req,) = r.requests
    prefill = 0.010 + 0.001 + 0.0001 * 100 + 0.005 + 0.002 + 0.0001 * 100  # 38 ms, yields token 1
    decode = 0.010 + 0.001 + 0.005 + 0.002  # 18 ms per further token
    assert req.first_token_at == pytest.approx(prefill)
    assert req.finished_at == pytest.approx(prefill + 3 * decode)
    assert r.steps == 4 and r.switches == 0 and r.held_back_request_seconds == 0
    assert r.avg_latency_per_output_token == pytest.approx((prefill + 3 * decode) / 4)


def test_base_model_requests_pay_no_lora_term():
    r = sim().run([SimRequest("r", None, 0.0, prompt_tokens=100, output_tokens=2)])
    assert r.requests[0].finished_at == pytest.approx((0.010 + 0.001 + 0.01) + (0.010 + 0.001))


def test_arrivals_join_at_the_next_step_and_idle_time_passes():
    r = sim().run([SimRequest("a", None, 0.0, 10, 3), SimRequest("b", None, 5.0, 10, 1)])
    late = next(x for x in r.requests if x.req_id == "b")
    assert late.first_token_at == pytest.approx(5.0 + 0.010 + 0.001 + 0.001)
    assert r.busy_seconds < 0.1


def test_merged_policy_pays_cold_and_cached_merges_and_holds_the_other_adapter_back():
    reqs = [SimRequest("a1", "a", 0.0, 10, 3), SimRequest("b1", "b", 0.0, 10, 3), SimRequest("a2", "a", 1.0, 10, 2)]
    r = sim("merged").run(reqs)
    # a merged (cold), then unmerge + b merged (cold; the 1-entry cache drops a), later back to a (cold)
    assert r.cold_merges == 3 and r.switches == 5
    assert r.merged_steps == r.steps  # it changes the merged adapter straight, never running unmerged
    assert r.held_back_request_seconds > 0
    roomy = sim("merged", costs=StepCosts(**{**COSTS.__dict__, "merged_cache_entries": 2})).run(reqs)
    assert roomy.cold_merges == 2  # a stays cached
    assert roomy.switch_seconds == pytest.approx(r.switch_seconds - 0.1 + 0.001)


def test_max_num_seqs_makes_a_request_wait_for_a_free_slot():
    reqs = [SimRequest(f"r{i}", None, 0.0, 10, 5 if i < 2 else 1) for i in range(3)]
    r = sim(max_num_seqs=2).run(reqs)
    by = {x.req_id: x for x in r.requests}
    assert by["r2"].first_token_at > max(by["r0"].finished_at, by["r1"].finished_at) - 1e-9


def test_max_loras_limits_distinct_adapters_per_step():
    reqs = [SimRequest("a", "a", 0.0, 10, 4), SimRequest("b", "b", 0.0, 10, 4), SimRequest("c", "c", 0.0, 10, 4)]
    r = sim(max_loras=2).run(reqs)
    by = {x.req_id: x for x in r.requests}
    assert by["c"].first_token_at > by["a"].finished_at - 1e-9


def test_noise_is_seeded():
    reqs = SkewWorkload(alpha=4.0, num_prompts=12, seed=1).requests()
    cfg = BatchingConfig()
    one = simulate("dlora", cfg, COSTS, reqs, noise_sd=0.2, seed=3).avg_latency_per_output_token
    assert one == simulate("dlora", cfg, COSTS, reqs, noise_sd=0.2, seed=3).avg_latency_per_output_token
    assert one != simulate("dlora", cfg, COSTS, reqs, noise_sd=0.2, seed=4).avg_latency_per_output_token
    assert one != simulate("dlora", cfg, COSTS, reqs).avg_latency_per_output_token


def test_skew_workload_matches_the_benchmark_shares_and_lengths():
    w = SkewWorkload(alpha=10.0, num_prompts=400, seed=0)
    reqs = w.requests()
    assert len(reqs) == 400 and {(r.prompt_tokens, r.output_tokens) for r in reqs} == {(64, 64)}
    top = sum(r.adapter == "a0" for r in reqs) / len(reqs)
    assert w.top_share == pytest.approx(0.9, abs=0.001) and abs(top - w.top_share) < 0.05
    assert 300 < reqs[-1].arrival < 500  # ~1 request per second


def test_step_costs_validation_and_presets():
    with pytest.raises(ValueError, match="fixed_s"):
        StepCosts(
            fixed_s=-1, per_seq_s=0, per_prefill_token_s=0, lora_fixed_s=0, lora_per_seq_s=0, lora_per_prefill_token_s=0
        )
    with pytest.raises(ValueError, match="cpu-einsum"):
        preset("nope")
    einsum = preset("cpu-einsum")
    # the fitted unmerged decode step at 4 sequences (one adapter) is ~51 ms, merged ~45 ms
    assert einsum.step(4, 0, 4, 0, 1) == pytest.approx(0.0508, abs=0.001)
    assert einsum.step(4, 0, 0, 0, 0) == pytest.approx(0.045, abs=0.001)
