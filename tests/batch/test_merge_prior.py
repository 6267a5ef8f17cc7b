"""The batch planner's prior for merged steps with the einsum kernels: it follows the adapters' size
until the replicas have measured merged steps."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from dlora.adapters.registry import AdapterNotFoundError
from dlora.adapters.validate import BaseModelShapes
from dlora.batch.execute import ServerPlanner, merge_prior
from dlora.batch.lines import BatchLine
from dlora.batch.predict import Work
from dlora.cluster.estimators.cost_model import CostParams
from dlora.config import BatchConfig
from dlora.scheduling.config import MERGED_COST_PRIORS, BatchingConfig, einsum_merged_cost

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
    works = [[Work("big", 10, 5)], [Work(None, 10, 5), Work("gone", 10, 5)]]
    # "big", the base model and an adapter no longer registered (its line fails on its own): 0
    assert merge_prior(state(), works) == pytest.approx(einsum_merged_cost(big / 3))
    assert merge_prior(state(), [[Work("big", 1, 1)]]) == pytest.approx(einsum_merged_cost(big))


@pytest.mark.parametrize(
    "s, works",
    [
        (state(backend="vllm"), [[Work("big", 1, 1)]]),  # another backend keeps its own prior
        (state(ratio=0.7), [[Work("big", 1, 1)]]),  # so does one the operator set
        (state(), [[Work(None, 1, 1)]]),  # nothing to merge
    ],
)
def test_no_prior_where_the_backends_own_stands(s, works):
    assert merge_prior(s, works) is None


class Model:
    def __init__(self, params, merged_measured):
        self.params, self.measured, self.merged_measured = params, False, merged_measured


def router(merged_measured: bool):
    models = {0: Model(CostParams(merged_ratio=0.85), merged_measured), 1: Model(CostParams(merged_ratio=0.85), False)}
    return SimpleNamespace(
        cost_params=lambda: {rid: m.params for rid, m in models.items()},
        healthy_ids=lambda: [0, 1],
        cost_models=models,
        views=lambda: [SimpleNamespace(replica_id=rid, requests=()) for rid in models],
        output_lengths=SimpleNamespace(lengths_for=lambda a: ()),
    ), models


class Recording(ServerPlanner):
    def _plan(self, lines, works, params, held, finished):
        self.params = params
        return super()._plan(lines, works, params, held, finished)


@pytest.mark.parametrize("measured_on_both", [False, True])
def test_the_planner_prices_merged_steps_by_the_prior_until_every_replica_measured_them(measured_on_both):
    r, models = router(measured_on_both)
    if measured_on_both:
        models[1].merged_measured = True
        for m in models.values():
            m.params = dataclasses.replace(m.params, merged_ratio=0.5)
    lines = [BatchLine(n, f"c{n}", "/v1/completions", {"model": "big", "prompt": "x"}) for n in (1, 2)]
    planner = Recording(state(router=r), known_works={1: [Work("big", 1, 4)], 2: [Work("big", 1, 4)]})
    asyncio.run(planner.plan(lines))
    want = 0.5 if measured_on_both else einsum_merged_cost(SMOLLM2.lora_fraction(64, ALL))
    assert [p.merged_ratio for p in planner.params.values()] == pytest.approx([want, want])
