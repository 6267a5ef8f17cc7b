"""Registry names and errors; config validation."""

from __future__ import annotations

import dataclasses

import pytest

from dlora.scheduling import (
    BatchingConfig,
    DLoRAPolicy,
    MergedPolicy,
    UnmergedPolicy,
    make_policy,
    policy_names,
)


def test_registry_maps_names_to_policies():
    assert policy_names() == ("unmerged", "merged", "dlora")
    assert isinstance(make_policy("unmerged"), UnmergedPolicy)
    assert isinstance(make_policy("merged"), MergedPolicy)
    cfg = BatchingConfig(max_batch=8)
    p = make_policy("dlora", cfg)
    assert isinstance(p, DLoRAPolicy) and p.config is cfg


@pytest.mark.parametrize("bad", ["credit", "DLORA", "", None])
def test_unknown_policy_lists_supported_names(bad):
    with pytest.raises(ValueError) as e:
        make_policy(bad)
    assert repr(bad) in str(e.value)
    for name in ("unmerged", "merged", "dlora"):
        assert name in str(e.value)


def test_defaults_are_the_documented_ones():
    c = BatchingConfig()
    assert (c.gamma_dec, c.gamma_mul, c.switch_cost_s, c.merged_cost_prior) == (0.05, 1.1, 0.02, 0.6)
    assert c.beta < c.alpha <= 1.0
    assert c.initial_credit < c.t_normal < c.t_starve


@pytest.mark.parametrize("backend, prior", [("vllm", 0.4), ("einsum", 0.85), ("triton", 0.6)])
def test_an_unset_merged_cost_prior_is_the_lora_backends(backend, prior):
    """vLLM's CPU LoRA ops make unmerged steps ~2.5x merged ones, dlora's einsum kernels ~1.2x: the
    prior Alg. 2 uses before it has measured both modes follows the backend the engine runs."""
    assert BatchingConfig().for_lora_backend(backend).merged_cost_ratio == prior
    assert BatchingConfig(merged_cost_ratio=0.7).for_lora_backend(backend).merged_cost_ratio == 0.7
    assert make_policy("dlora", BatchingConfig().for_lora_backend(backend)).cost.merged_cost_ratio == prior
    mixing = BatchingConfig(mixed_merged=True).for_lora_backend(backend)
    assert mixing.mixed_merged == (backend != "vllm")  # vLLM's ops cannot compensate


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_batch": 0}, "max_batch"),
        ({"alpha": 0.5, "beta": 0.6}, "alpha"),
        ({"alpha": 1.2}, "alpha"),
        ({"beta": 0.0}, "alpha"),
        ({"gamma_dec": 0.0}, "gamma_dec"),
        ({"gamma_mul": 1.0}, "gamma_mul"),
        ({"break_period_iters": 0}, "break_period_iters"),
        ({"switch_cost_s": -1.0}, "switch_cost_s"),
        ({"merged_cost_ratio": 0.0}, "merged_cost_ratio"),
        ({"t_normal": 2.0, "t_starve": 2.0}, "t_normal"),
        ({"initial_credit": 3.0}, "initial_credit"),
        ({"initial_credit": 1.5, "t_normal": 1.5}, "initial_credit"),
        ({"min_credit_to_merge": 1.5}, "min_credit_to_merge"),
        ({"credit_relax_per_s": -0.1}, "credit_relax_per_s"),
        ({"merged_max_iters": 0}, "merged_max_iters"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(kwargs, field):
    with pytest.raises(ValueError, match=f"scheduling.{field}="):
        BatchingConfig(**kwargs)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BatchingConfig().alpha = 0.1  # type: ignore[misc]
