"""The batch planner's prior for merged steps with the einsum kernels: it follows the adapters' size
until a replica has measured its merged/unmerged ratio."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from dlora.adapters.registry import AdapterNotFoundError
from dlora.adapters.validate import BaseModelShapes
from dlora.app.batch_cmd import PlanEta
from dlora.batch.execute import ServerPlanner, merge_prior
from dlora.batch.lines import BatchLine
from dlora.batch.predict import RequestWork
from dlora.cluster.estimators.output_lengths import OutputLengthEstimator
from dlora.cluster.estimators.replica_cost import CostParams, ReplicaCostModel
from dlora.cluster.policy_views import IterationSample
from dlora.config import BatchConfig
from dlora.cost.params import MERGED_COST_PRIORS
from dlora.scheduling.config import BatchingConfig, einsum_merged_cost

# SmolLM2-135M's projections (hidden 576, 9 heads and 3 KV heads of 64, intermediate 1536)
SMOLLM2 = BaseModelShapes(
    num_layers=30,
    shapes={
        "q_proj": (576, 576),
        "k_proj": (576, 192),
        "v_proj": (576, 192),
        "o_proj": (576, 576),
        "gate_proj": (576, 1536),
        "up_proj": (576, 1536),
        "down_proj": (1536, 576),
    },
)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = (*QKVO, "gate_proj", "up_proj", "down_proj")


def test_the_einsum_prior_meets_its_two_anchors_and_falls_with_adapter_size():
    small, large = SMOLLM2.lora_fraction(8, QKVO), SMOLLM2.lora_fraction(64, ALL)
    assert small == pytest.approx(0.0087, abs=1e-4) and large == pytest.approx(0.184, abs=1e-3)
    assert einsum_merged_cost(small) == pytest.approx(MERGED_COST_PRIORS["einsum"], abs=0.01)
    assert einsum_merged_cost(large) == pytest.approx(189.3 / 366.0, abs=0.01)  # base / unplanned
    sizes = [0.0, small, 0.05, large, 1.0]
    costs = [einsum_merged_cost(f) for f in sizes]
    assert costs == sorted(costs, reverse=True) and costs[0] < 1


class Registry:
    def __init__(self, records):
        self.records = records

    def get(self, name):
        if name not in self.records:
            raise AdapterNotFoundError(name)
        return self.records[name]


def state(backend="einsum", ratio=None, router=None):
    records = {
        "big": SimpleNamespace(rank=64, target_modules=ALL),
        "small": SimpleNamespace(rank=8, target_modules=QKVO),
    }
    cfg = SimpleNamespace(
        engine=SimpleNamespace(lora_backend=backend, max_num_seqs=4),
        scheduling=BatchingConfig(merged_cost_ratio=ratio),
        batch=BatchConfig(),
    )
    adapters = SimpleNamespace(registry=Registry(records), base=SMOLLM2)
    return SimpleNamespace(cfg=cfg, adapters=adapters, router=router, tokenizer=None, base_model_name="base")


def test_the_prior_is_the_mean_fraction_of_the_batchs_requests():
    big = SMOLLM2.lora_fraction(64, ALL)
    works = [[RequestWork("big", 10, 5)], [RequestWork(None, 10, 5), RequestWork("gone", 10, 5)]]
    # "big", the base model and an adapter no longer registered (its line fails on its own): 0
    assert merge_prior(state(), works) == pytest.approx(einsum_merged_cost(big / 3))
    assert merge_prior(state(), [[RequestWork("big", 1, 1)]]) == pytest.approx(einsum_merged_cost(big))


@pytest.mark.parametrize(
    "s, works",
    [
        (state(backend="vllm"), [[RequestWork("big", 1, 1)]]),  # another backend keeps its own prior
        (state(ratio=0.7), [[RequestWork("big", 1, 1)]]),  # so does one the operator set
        (state(), [[RequestWork(None, 1, 1)]]),  # nothing to merge
    ],
)
def test_no_prior_where_the_backends_own_stands(s, works):
    assert merge_prior(s, works) is None


def steps(merged: bool, scale: float = 1.0) -> list[IterationSample]:
    """Decode steps of 4..19 sequences costing `scale` x (4 ms + 1 ms a sequence)."""
    return [IterationSample(n, 0, n, scale * (0.004 + 0.001 * n), merged) for n in range(4, 20)]


def router(*models: ReplicaCostModel):
    by_id = dict(enumerate(models))
    return SimpleNamespace(
        cost_models=by_id,
        serving_ids=lambda: list(by_id),
        recount=lambda: None,
        views=lambda: [SimpleNamespace(replica_id=rid, requests=()) for rid in by_id],
        output_lengths=OutputLengthEstimator(),
    )


class Recording(ServerPlanner):
    def _plan(self, lines, works, params, held, history):
        self.params = params
        return super()._plan(lines, works, params, held, history)


def planned_params(*models: ReplicaCostModel) -> CostParams:
    """The step costs the planner prices a batch of two rank-64 lines with (one set for all replicas)."""
    lines = [BatchLine(n, f"c{n}", "/v1/completions", {"model": "big", "prompt": "x"}) for n in (1, 2)]
    planner = Recording(
        state(router=router(*models)), known_works={1: [RequestWork("big", 1, 4)], 2: [RequestWork("big", 1, 4)]}
    )
    asyncio.run(planner.plan(lines))
    shared = set(planner.params.values())
    assert len(shared) == 1
    return shared.pop()


PRIOR = CostParams(merged_ratio=0.85)  # the router's prior: the einsum backend's flat ratio


def test_the_planner_prices_merged_steps_by_the_size_aware_prior_before_any_step():
    assert planned_params(ReplicaCostModel(PRIOR), ReplicaCostModel(PRIOR)) == dataclasses.replace(
        PRIOR, merged_ratio=einsum_merged_cost(SMOLLM2.lora_fraction(64, ALL))
    )


def test_a_ratio_a_replica_measured_replaces_the_prior_for_that_replica_only():
    measured = ReplicaCostModel(PRIOR)
    measured.observe(*steps(merged=False), *steps(merged=True, scale=0.5))
    assert measured.merged_measured
    p = planned_params(measured, ReplicaCostModel(PRIOR))
    prior = einsum_merged_cost(SMOLLM2.lora_fraction(64, ALL))
    assert p.merged_ratio == pytest.approx((0.5 + prior) / 2, rel=0.02)


def test_replicas_that_ran_merged_only_keep_the_prior_ratio_and_their_measured_merged_cost():
    # A stage plan starts both replicas merged: their merged steps say what a merged step costs,
    # not what an unmerged one would (the router keeps its flat prior ratio, 0.85, for that).
    models = [ReplicaCostModel(PRIOR), ReplicaCostModel(PRIOR)]
    for m in models:
        m.observe(*steps(merged=True, scale=0.4))
    assert all(m.measured and not m.merged_measured for m in models)
    p = planned_params(*models)
    prior = einsum_merged_cost(SMOLLM2.lora_fraction(64, ALL))
    assert p.merged_ratio == pytest.approx(prior)
    merged_step = p.merged_ratio * (p.per_iteration_s + 10 * p.per_decode_token_s)
    assert merged_step == pytest.approx(0.4 * 0.014, rel=0.02)  # as measured


def test_the_progress_eta_prices_merged_steps_as_the_planner_does():
    # The same lines on fresh replicas: with rank-64 adapters on all seven projections a merged
    # step is priced at 0.52 of an unmerged one, with rank 8 on q/k/v/o at 0.85, so the ETA of
    # the first is shorter (the router's own prior is 0.85 for both).
    def eta(adapter: str) -> float:
        models = (ReplicaCostModel(PRIOR), ReplicaCostModel(PRIOR))
        tracker = PlanEta.__new__(PlanEta)  # its works given, not counted by a tokenizer
        tracker.state = state(router=router(*models))
        tracker.lines = [BatchLine(n, f"c{n}", "/v1/completions", {"model": adapter, "prompt": "x"}) for n in range(8)]
        tracker.works = [[RequestWork(adapter, 100, 50, exact=True)] for _ in tracker.lines]
        return tracker.eta_s({})

    big, small = eta("big"), eta("small")
    assert big == pytest.approx(small * einsum_merged_cost(SMOLLM2.lora_fraction(64, ALL)) / 0.85, rel=0.05)
    assert eta("big") == big  # a read: asking again changes nothing
