"""The sample-then-simulate prediction: hand-worked schedules, and the event-jumping simulation
against a plain step-by-step simulation of the same continuous batching."""

from __future__ import annotations

import random

import pytest

from dlora.batch.predict import Prediction, RequestWork, predict, sample_lengths, simulate_replica, works_of
from dlora.cluster.estimators.replica_cost import CostParams


def params(it=0.0, dec=0.0, pre=0.0, batch=1, merged=1.0) -> CostParams:
    return CostParams(
        per_iteration_s=it, per_decode_token_s=dec, per_prefill_token_s=pre, max_batch=batch, merged_ratio=merged
    )


@pytest.mark.parametrize(
    ("prompts", "outputs", "p", "finish"),
    [
        ([0, 0], [2, 3], params(it=1), [2, 5]),  # one at a time: 2 steps, then 3
        ([0, 0], [2, 3], params(dec=1, batch=2), [4, 5]),  # two steps of 2 sequences, one of 1
        ([4, 2], [1, 1], params(it=1, pre=0.5, batch=1), [3, 5]),  # each step prefills its prompt
        ([0, 0, 0], [1, 3, 1], params(it=1, batch=2), [1, 3, 2]),  # the third joins when the first ends
    ],
)
def test_hand_worked_schedules(prompts, outputs, p, finish):
    assert simulate_replica(prompts, outputs, p) == pytest.approx(finish)


def test_steps_of_one_adapter_run_merged():
    p = params(it=1, batch=2, merged=0.5)
    # a and b together for 2 steps (unmerged), then b alone for 1 merged step
    assert simulate_replica([0, 0], [2, 3], p, ["a", "b"]) == pytest.approx([2, 2.5])
    # one adapter throughout: every step merged
    assert simulate_replica([0, 0], [2, 3], p, ["a", "a"]) == pytest.approx([1, 1.5])
    # the base model alone also runs without a LoRA term
    assert simulate_replica([0, 0], [2, 3], p, [None, None]) == pytest.approx([1, 1.5])
    assert simulate_replica([0, 0], [2, 3], p) == pytest.approx([2, 3])  # no adapters given: unmerged


def step_by_step(prompts, outputs, p: CostParams, adapters=None) -> list[float]:
    """The oracle: one loop iteration per engine step."""
    finish = [0.0] * len(prompts)
    waiting, running, t = list(range(len(prompts))), {}, 0.0
    while waiting or running:
        prefill = 0
        while waiting and len(running) < p.max_batch:
            i = waiting.pop(0)
            running[i] = outputs[i]
            prefill += prompts[i]
        step = p.per_iteration_s + p.per_decode_token_s * len(running) + p.per_prefill_token_s * prefill
        merged = adapters is not None and len({adapters[i] for i in running}) == 1
        t += step * (p.merged_ratio if merged else 1.0)
        for i in list(running):
            running[i] -= 1
            if running[i] == 0:
                finish[i] = t
                del running[i]
    return finish


@pytest.mark.parametrize("seed", range(20))
def test_the_event_jumps_equal_a_step_by_step_simulation(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    prompts = [rng.randint(1, 300) for _ in range(n)]
    outputs = [rng.randint(1, 60) for _ in range(n)]
    p = params(
        it=rng.uniform(0, 0.01),
        dec=rng.uniform(0, 0.002),
        pre=rng.uniform(0, 0.001),
        batch=rng.randint(1, 8),
        merged=rng.uniform(0.3, 1),
    )
    adapters = [rng.choice(["a", "b", None]) for _ in range(n)] if seed % 2 else None
    assert simulate_replica(prompts, outputs, p, adapters) == pytest.approx(step_by_step(prompts, outputs, p, adapters))


def test_lengths_are_drawn_from_the_adapters_history_and_capped():
    works = [RequestWork("a", 10, 3), RequestWork("a", 10, 100), RequestWork("b", 10, 7)]
    seen = {"a": [5], "b": []}
    assert sample_lengths(works, lambda a: seen[a], random.Random(0)) == [3, 5, 7]
    exact = [RequestWork("a", 10, 3, exact=True), RequestWork("a", 10, 100, exact=True)]
    assert sample_lengths(exact, lambda a: seen[a], random.Random(0)) == [3, 100]  # runs to max_tokens


def test_requests_spread_over_replicas_as_dispatch_would_and_the_makespan_is_the_slowest():
    p = params(it=1, batch=1)
    works = [RequestWork(None, 0, 4) for _ in range(4)]
    one = predict(works[:2], [p], lambda a: [])
    two = predict(works, [p, p], lambda a: [])
    assert one.makespan_s == 8 and two.makespan_s == 8
    assert sorted(two.replica_of) == [0, 0, 1, 1]
    slow = params(it=3, batch=1)
    skewed = predict(works, [p, slow], lambda a: [])
    assert skewed.replica_of.count(0) == 3  # the faster replica is sent more
    assert skewed.makespan_s == 12


def test_the_eta_counts_down_on_plan():
    plan = Prediction(3.0, (1.0, 3.0, 3.0), (0, 0, 0))
    assert [plan.eta_s(k) for k in (0, 1, 2, 3)] == [3.0, 2.0, 0.0, 0.0]


def test_a_line_becomes_its_engine_requests_with_their_prompt_sizes_and_caps():
    def count(text: str) -> int:
        return len(text.split())

    one = works_of("/v1/completions", {"model": "base", "prompt": "a b c", "max_tokens": 5}, count, "base", 100)
    assert one == [RequestWork(None, 3, 5)]
    fanned = works_of("/v1/completions", {"model": "x", "prompt": ["a", "a b"], "n": 2}, count, "base", 10)
    assert fanned == [RequestWork("x", 1, 9), RequestWork("x", 1, 9), RequestWork("x", 2, 8), RequestWork("x", 2, 8)]
    ids = works_of("/v1/completions", {"model": "x", "prompt": [1, 2, 3, 4], "max_tokens": 50}, count, "base", 20)
    assert ids == [RequestWork("x", 4, 16)]  # the context caps max_tokens
    messages = [{"role": "user", "content": "a b"}, {"role": "user", "content": [{"text": "c"}]}]
    chat = {"model": "x", "messages": messages}
    assert works_of("/v1/chat/completions", chat | {"max_completion_tokens": 7}, count, "base", 100) == [
        RequestWork("x", 4 + 2 + 4 + 1, 7)
    ]
    to_the_end = {"model": "x", "prompt": "a", "max_tokens": 6, "ignore_eos": True}
    assert works_of("/v1/completions", to_the_end, count, "base", 100) == [RequestWork("x", 1, 6, exact=True)]
    stops = to_the_end | {"stop": ["."]}  # a stop string can still end it early: its length is drawn
    assert works_of("/v1/completions", stops, count, "base", 100) == [RequestWork("x", 1, 6)]
