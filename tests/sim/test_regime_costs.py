"""The step-cost model's rescaling to another rank, projection set and prompt length
(dlora.sim.step_costs.regime_costs), on a toy model small enough to work out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from dlora.sim.step_costs import (
    ALL_PROJECTIONS,
    PRESET_REGIME,
    PRESETS,
    QKVO,
    SMOLLM2_135M,
    LoraShape,
    ModelShape,
    Regime,
    StepCosts,
    lora_flop_ratio,
    regime_costs,
)

# 2 layers, hidden 4, MLP 8, 2 heads of 2 (one KV head): q/o 4x4, k/v 4x2, gate/up 4x8, down 8x4.
TOY = ModelShape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, vocab=10)
COSTS = StepCosts(
    fixed_s=1.0,
    per_seq_s=1.0,
    per_prefill_token_s=1.0,
    lora_fixed_s=1.0,
    lora_per_seq_s=1.0,
    lora_per_prefill_token_s=1.0,
    lora_per_adapter_s=1.0,
    merge_cold_s=1.0,
)


def test_toy_model_multiply_adds_by_hand():
    # linear layers 2 x (16 + 8 + 8 + 16 + 32 + 32 + 32) = 288, LM head 4 x 10 = 40
    assert TOY.base_macs_per_token() == 328
    # rank 2 on q/k/v/o: 2 layers x 2 x ((4+4) + (4+2) + (4+2) + (4+4)) = 112; all seven adds 3 x 12
    assert LoraShape(2, QKVO).macs_per_token(TOY) == 112
    assert LoraShape(2, ALL_PROJECTIONS).macs_per_token(TOY) == 256
    assert lora_flop_ratio(LoraShape(2, QKVO), TOY) == pytest.approx(112 / 328)
    # attention: 2 layers x 2 (QK^T, AV) x 2 heads x head_dim 2 = 16 per context token
    assert TOY.attention_macs(3) == 48
    assert TOY.weight_params(QKVO) == 96 and TOY.weight_params(ALL_PROJECTIONS) == 288


def test_lora_layer_calls_count_fused_qkv_and_gate_up_once():
    assert LoraShape(8, QKVO).lora_layer_calls() == 2
    assert LoraShape(8, ALL_PROJECTIONS).lora_layer_calls() == 4
    assert LoraShape(8, ("q_proj", "v_proj")).lora_layer_calls() == 1
    with pytest.raises(ValueError):
        LoraShape(8, ("lm_head",))


def test_rescaling_by_hand():
    fitted = Regime(LoraShape(2, QKVO), prompt_len=4, output_len=4)
    to = Regime(LoraShape(4, ALL_PROJECTIONS), prompt_len=8, output_len=4)
    c = regime_costs(dataclasses.replace(COSTS, merged_cache_entries=7), to, fitted, TOY)
    flops = (2 * 4 * 64) / 112  # rank 4 on all seven vs rank 2 on q/k/v/o
    assert c.lora_per_seq_s == pytest.approx(flops) and c.lora_per_prefill_token_s == pytest.approx(flops)
    assert c.lora_fixed_s == 2.0 and c.lora_per_adapter_s == 2.0  # 4 LoRA layer calls instead of 2
    # decode attends over 8 + 4/2 = 10 tokens instead of 4 + 4/2 = 6; a prompt token over 4 vs 2
    assert c.per_seq_s == pytest.approx((328 + 160) / (328 + 96))
    assert c.per_prefill_token_s == pytest.approx((328 + 64) / (328 + 32))
    assert c.fixed_s == 1.0
    assert c.merge_cold_s == 3.0  # 288 weights to reload instead of 96
    assert c.merged_cache_entries == 2  # the cache's bytes hold 7 / 3 as many


def test_flop_share_splits_the_per_token_cost_between_flops_and_calls():
    fitted = Regime(LoraShape(2, QKVO), 4, 4)
    to = Regime(LoraShape(4, ALL_PROJECTIONS), 4, 4)
    half = regime_costs(COSTS, to, fitted, TOY, flop_share=0.5)
    assert half.lora_per_seq_s == pytest.approx(0.5 * (512 / 112) + 0.5 * 2)
    none = regime_costs(COSTS, to, fitted, TOY, flop_share=0.0)
    assert none.lora_per_prefill_token_s == pytest.approx(2.0)
    with pytest.raises(ValueError):
        regime_costs(COSTS, to, fitted, TOY, flop_share=1.5)


def test_attention_weight_prices_an_attention_multiply_add():
    fitted = Regime(LoraShape(2, QKVO), 4, 4)
    to = Regime(LoraShape(2, QKVO), 8, 4)
    c = regime_costs(COSTS, to, fitted, TOY, attention_weight=3.0)
    # decode context 10 vs 6 tokens at 16 multiply-adds each, tripled
    assert c.per_seq_s == pytest.approx((328 + 3 * 160) / (328 + 3 * 96))
    assert c.lora_per_seq_s == pytest.approx(1.0)  # same LoRA shape: unchanged


def test_the_fitted_regime_maps_to_the_preset_itself():
    p = PRESETS["cpu-einsum"]
    same = regime_costs(p, PRESET_REGIME)
    for f in ("fixed_s", "per_seq_s", "per_prefill_token_s", "lora_fixed_s", "lora_per_seq_s", "merge_cold_s"):
        assert getattr(same, f) == pytest.approx(getattr(p, f))
    # SmolLM2-135M: the cache that holds 8 adapters' merged q/k/v/o holds 2 of all seven
    assert same.merged_cache_entries == 8
    assert regime_costs(p, Regime(LoraShape(8, ALL_PROJECTIONS), 64, 64)).merged_cache_entries == 2
    # rank 64 on all seven projections: 14.5% of the base model's multiply-adds
    assert lora_flop_ratio(LoraShape(64, ALL_PROJECTIONS), SMOLLM2_135M) == pytest.approx(0.1453, abs=1e-4)
