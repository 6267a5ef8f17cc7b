"""The merge planner: pricing known work in each weight state, and the dlora policy's slices.

Hand-worked cases for the arithmetic (merge_planner.py), then the policy over the replica simulator
(dlora/sim/batching_sim.py: token-aware step costs, the real policy objects) against the `merged`
and `unmerged` baselines.
"""

from __future__ import annotations

import math
import random

import pytest

from dlora.cost.line import StepLine
from dlora.scheduling import BatchingConfig, Mode, Switch, make_policy
from dlora.scheduling.dlora_policy import DLoRAPolicy
from dlora.scheduling.merge_planner import (
    FinishedLengths,
    LengthTail,
    RemainingWork,
    remaining_output,
    rest_seconds,
    slice_gain,
    stay_pays,
    work_by_adapter,
    work_seconds,
)
from dlora.scheduling.types import IterationStats, RequestView
from dlora.sim.batching_sim import BatchingSim, SimRequest
from dlora.sim.step_costs import StepCosts, preset

UNMERGED = StepLine(0.01, 0.003, 0.004)  # LoRA makes prompt tokens 3x and sequences 4x dearer
MERGED = StepLine(0.01, 0.001, 0.001)


def view(rid: str, adapter: str | None, *, prompt: int, computed: int = 0, out: int = 0, cap: int | None = None):
    return RequestView(rid, adapter, 0.0, prompt, computed, out, computed > 0, cap)


def test_work_seconds_by_hand():
    # 20 decode steps (the longest request) pay the fixed cost; 100 prompt and 40 output tokens
    # pay theirs: 0.01·20 + 0.003·100 + 0.004·40 = 0.2 + 0.3 + 0.16
    assert work_seconds(UNMERGED, RemainingWork(100, 40, 20), max_batch=64) == pytest.approx(0.66)
    # 200 output tokens through 8 sequences a step: at least 25 steps, not 20
    assert work_seconds(UNMERGED, RemainingWork(0, 200, 20), max_batch=8) == pytest.approx(0.01 * 25 + 0.004 * 200)
    assert work_seconds(UNMERGED, RemainingWork(), max_batch=8) == 0.0


def test_remaining_output_is_conditioned_on_what_a_request_has_generated():
    r = view("r", "a", prompt=10, out=5, cap=32)
    assert remaining_output(r, None) == 27  # nothing finished yet: the cap
    tail = LengthTail([30, 3, 10, 20])
    assert remaining_output(r, tail) == 15  # 10, 20, 30 ran past 5 tokens: 5, 15, 25 more, mean 15
    assert remaining_output(view("r", "a", prompt=10, out=15, cap=100), tail) == 10  # 20, 30: 5 and 15 more
    assert remaining_output(view("r", "a", prompt=10, out=25, cap=32), tail) == 5  # 30: 5 more
    # Past every length seen: as long again as it has run (not 1 token: it is no sooner done),
    # within its cap.
    assert remaining_output(view("r", "a", prompt=10, out=40, cap=None), tail) == 40
    assert remaining_output(view("r", "a", prompt=10, out=40, cap=50), tail) == 10
    assert remaining_output(view("r", "a", prompt=10), None) == 128  # nothing known: the default
    assert remaining_output(view("r", "a", prompt=10, out=4, cap=5), tail) == 1  # the floor


def test_work_by_adapter_sums_prompt_and_output_tokens():
    rs = [
        view("a1", "a", prompt=100, cap=10),
        view("a2", "a", prompt=100, computed=100, out=4, cap=10),  # decoding: no prompt left
        view("b1", "b", prompt=50, computed=20, cap=3),  # a prefill chunk done
        view("n1", None, prompt=10, cap=2),
    ]
    w = work_by_adapter(rs, None)
    assert w == {"a": RemainingWork(100, 16, 10), "b": RemainingWork(30, 3, 3), None: RemainingWork(10, 2, 2)}


def test_slice_gain_by_hand():
    # Two adapters, each 1,000 prompt tokens and 10 requests x 10 output tokens (longest 10).
    works = {"a": RemainingWork(1000, 100, 10), "b": RemainingWork(1000, 100, 10)}
    # all unmerged: 0.01·10 + 0.003·2000 + 0.004·200 = 0.1 + 6 + 0.8 = 6.9
    # a merged: 0.01·10 + 0.001·1000 + 0.001·100 = 1.2; b alone unmerged 0.1 + 3 + 0.4 = 3.5,
    # b merged 1.2 + a switch 0.05 = 1.25: R(rest) = 1.25
    plan = slice_gain(works, "a", UNMERGED, MERGED, switch_s=0.05, max_batch=64)
    assert plan.merged_s == pytest.approx(1.2)
    assert plan.gain_s == pytest.approx(6.9 - (2 * 0.05 + 1.2 + 1.25))
    assert plan.pays(margin=0.1)
    assert rest_seconds({"b": works["b"]}, UNMERGED, MERGED, 0.05, 64) == pytest.approx(1.25)
    # the base model's requests are never merged: R prices them unmerged
    assert rest_seconds({None: works["b"]}, UNMERGED, MERGED, 0.05, 64) == pytest.approx(3.5)


def test_slicing_short_decodes_does_not_pay_when_the_fixed_cost_dominates():
    # Decode only, 4 adapters x 2 requests x 32 tokens; a step's fixed cost dominates (0.05 s vs
    # 0.002 per sequence), so running one adapter's 2 requests alone costs almost a full step each.
    unmerged, merged = StepLine(0.05, 0.0, 0.002), StepLine(0.045, 0.0, 0.001)
    works = {a: RemainingWork(0, 64, 32) for a in "abcd"}
    plan = slice_gain(works, "a", unmerged, merged, 0.002, 64)
    assert plan.gain_s < 0 and not plan.pays(0.0)
    assert not stay_pays(works, "a", unmerged, merged, 0.002, 64)


def test_finished_lengths_record_what_left():
    f = FinishedLengths()
    f.update([view("a", "x", prompt=1, out=3), view("b", "x", prompt=1, out=9)])
    assert f.pooled() == ()
    f.update([view("b", "x", prompt=1, out=10)])  # a left after one more token
    assert f.pooled() == (4,) and f.of("x") == (4,)
    f.update([])
    assert f.pooled() == (4, 11) and f.of("y") == ()


# ---- the policy ------------------------------------------------------------------------------

# A CPU-like replica where the LoRA term is dear: prompt tokens cost 1 ms merged, 3 ms unmerged.
DEAR_LORA = StepCosts(
    fixed_s=0.03,
    per_seq_s=0.002,
    per_prefill_token_s=0.001,
    lora_fixed_s=0.01,
    lora_per_seq_s=0.003,
    lora_per_prefill_token_s=0.002,
    merge_cold_s=0.1,
    merge_cached_s=0.002,
    unmerge_s=0.002,
)
# One where it is nearly free: merging a few requests only loses batching.
CHEAP_LORA = StepCosts(
    fixed_s=0.03,
    per_seq_s=0.002,
    per_prefill_token_s=0.001,
    lora_fixed_s=0.003,
    lora_per_seq_s=0.0001,
    lora_per_prefill_token_s=0.00005,
    merge_cold_s=0.1,
    merge_cached_s=0.002,
    unmerge_s=0.002,
)


def burst(prompt: int, per_adapter: dict[str, int], output: int = 16, start: float = 0.0) -> list[SimRequest]:
    out = []
    for adapter, n in per_adapter.items():
        out += [SimRequest(f"{adapter}{start}-{i}", adapter, start, prompt, output) for i in range(n)]
    return out


def throughput(policy: str, costs: StepCosts, requests: list[SimRequest], **config) -> tuple[float, object]:
    """Output tokens/s over the last burst (those before it teach the policy the costs)."""
    p = make_policy(policy, BatchingConfig(max_batch=64, **config))
    sim = BatchingSim(p, costs)
    last = max(r.arrival for r in requests)
    for start in sorted({r.arrival for r in requests} - {last}):
        sim.run([r for r in requests if r.arrival == start])
    later = [r for r in requests if r.arrival == last]
    t0 = last
    result = sim.run(later)
    end = max(r.finished_at for r in result.requests)
    return sum(r.output_tokens for r in result.requests) / (end - t0), result


def two_bursts(prompt: int, per_adapter: dict[str, int]) -> list[SimRequest]:
    return burst(prompt, per_adapter) + burst(prompt, per_adapter, start=1000.0)


def test_planner_slices_long_prompts_at_uniform_popularity():
    # 4 adapters x 8 requests of 512-token prompts: Alg. 1 alone never merges (share 0.25); the
    # planner serves each adapter's prompts merged, as fast as the merged baseline or faster.
    reqs = two_bursts(512, {"a": 8, "b": 8, "c": 8, "d": 8})
    planned, result = throughput("dlora", DEAR_LORA, reqs)
    alg1_only, plain = throughput("dlora", DEAR_LORA, reqs, merge_planner=False)
    merged, _ = throughput("merged", DEAR_LORA, reqs)
    unmerged, _ = throughput("unmerged", DEAR_LORA, reqs)
    assert plain.merged_steps == 0 and alg1_only == pytest.approx(unmerged, rel=0.01)
    assert result.merged_steps > 0
    assert planned >= 0.95 * max(merged, unmerged)
    assert planned > 1.3 * unmerged


def test_planner_stays_unmerged_where_merging_only_loses_batching():
    # The first burst's prefills run before any decode step has priced a step's fixed cost, so the
    # planner tries merging on the second (two steps of one slice); on the third it knows better.
    per_adapter = {"a": 8, "b": 8, "c": 8, "d": 8}
    reqs = two_bursts(64, per_adapter) + burst(64, per_adapter, start=2000.0)
    planned, result = throughput("dlora", CHEAP_LORA, reqs)
    unmerged, _ = throughput("unmerged", CHEAP_LORA, reqs)
    merged, _ = throughput("merged", CHEAP_LORA, reqs)
    assert merged < 0.8 * unmerged  # merging really loses here
    assert planned >= 0.97 * unmerged
    assert result.merged_steps == 0  # what it learned before: no slice pays


def test_first_step_measures_one_request_before_pricing_a_batch():
    p = DLoRAPolicy(BatchingConfig(max_batch=64))
    rs = [view(f"r{i}", "ab"[i % 2], prompt=512, cap=16) for i in range(8)]  # share 0.5: Alg. 1 runs all
    d = p.decide(rs, 0.0)
    assert (d.mode, d.allowed_req_ids) == (Mode.UNMERGED, ("r0",))
    off = DLoRAPolicy(BatchingConfig(max_batch=64, merge_planner=False))
    assert len(off.decide(rs, 0.0).allowed_req_ids) == 8


def test_a_shape_probe_runs_half_the_decodes_once_when_every_step_ran_one_batch_size():
    p = DLoRAPolicy(BatchingConfig(max_batch=64))
    p.observe(IterationStats(Mode.UNMERGED, None, 1, 0.6, prefill_tokens=512))
    decoding = [view(f"r{i:02d}", "ab"[i % 2], prompt=64, computed=64, out=3, cap=64) for i in range(16)]
    for _ in range(3):
        p.observe(IterationStats(Mode.UNMERGED, None, 16, 0.1))
    d = p.decide(decoding, 1.0)
    assert d.mode is Mode.UNMERGED and d.allowed_req_ids == tuple(f"r{i:02d}" for i in range(8))
    p.observe(IterationStats(Mode.UNMERGED, None, 8, 0.07))
    assert p.steps.shape_known()  # 8 and 16 sequences seen: fixed 0.04 + 0.00375 per sequence
    assert p.steps.line(Mode.UNMERGED).seconds(0, 8) == pytest.approx(0.07, rel=0.05)


def test_the_next_slice_starts_straight_from_the_last_one():
    reqs = two_bursts(512, {"a": 4, "b": 4})
    p = make_policy("dlora", BatchingConfig(max_batch=64))
    decisions = []
    orig = p.decide

    def record(requests, now, max_batch=None):
        d = orig(requests, now, max_batch)
        decisions.append(d)
        return d

    p.decide = record  # type: ignore[method-assign]
    sim = BatchingSim(p, DEAR_LORA)
    sim.run(reqs[:8])
    decisions.clear()
    sim.run(reqs[8:])
    merges = [(d.merged_adapter, d.switch) for d in decisions if d.switch is not Switch.NONE]
    assert ("b", Switch.MERGE) in merges or ("a", Switch.MERGE) in merges
    direct = [
        i
        for i in range(1, len(decisions))
        if decisions[i - 1].mode is Mode.MERGED
        and decisions[i].mode is Mode.MERGED
        and decisions[i].merged_adapter != decisions[i - 1].merged_adapter
    ]
    assert direct and all(decisions[i].switch is Switch.MERGE for i in direct)


def chat_batch(n: int, seed: int, cap: int = 256) -> list[SimRequest]:
    """`n` requests at once over 16 adapters (Zipf 1.0), ShareGPT-like prompt and output lengths
    (log-normal), each capped at `cap` tokens and ending at its own length: the policy sees only
    the cap, as with chat requests that stop at their end of sequence."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(16)]
    out = []
    for i in range(n):
        adapter = rng.choices(range(16), weights)[0]
        prompt = int(min(1024, max(4, math.exp(rng.gauss(4.69, 1)))))
        output = int(min(cap, max(1, math.exp(rng.gauss(5.46, 1)))))
        out.append(SimRequest(f"r{i}", f"a{adapter}", 0.0, prompt, output, max_tokens=cap))
    return out


@pytest.mark.parametrize("n, seed", [(75, 0), (40, 1)])
def test_unknown_lengths_do_not_make_the_planner_cycle_one_request_slices(n, seed):
    """Lengths known only by their cap, heavy-tailed: a request that has outrun the recent mean is
    not one token from its end. Priced so, each such request was worth a merged slice of its own,
    again at every step, while the others waited (these two batches: 87 and 33 switches, 13% and
    6% longer than with the planner off)."""
    costs = preset("cpu-einsum")  # rank 8 on q/k/v/o, one CPU core: merging saves little
    results = {}
    for planner in (True, False):
        policy = make_policy("dlora", BatchingConfig(max_batch=64, merge_planner=planner))
        results[planner] = BatchingSim(policy, costs).run(chat_batch(n, seed))
    makespan = {k: max(r.finished_at for r in res.requests) for k, res in results.items()}
    assert makespan[True] <= 1.02 * makespan[False]
    assert results[True].switches <= 10


def test_the_snapshot_reports_the_planner_lines_and_its_last_slice():
    p = make_policy("dlora", BatchingConfig(max_batch=64))
    assert p.snapshot().planner is None  # nothing measured: nothing to price with
    BatchingSim(p, DEAR_LORA).run(two_bursts(512, {"a": 8, "b": 8, "c": 8, "d": 8}))
    planner = p.snapshot().planner
    unmerged, merged = p.steps.line(Mode.UNMERGED), p.steps.line(Mode.MERGED)
    assert planner["unmerged"] == pytest.approx(
        [unmerged.fixed_s, unmerged.per_prefill_token_s, unmerged.per_seq_s], abs=1e-6
    )
    assert planner["merged"] == pytest.approx([merged.fixed_s, merged.per_prefill_token_s, merged.per_seq_s], abs=1e-6)
    adapter, gain_s, merged_s = planner["last_slice"]
    assert adapter in "abcd" and gain_s > 0 and merged_s > 0
