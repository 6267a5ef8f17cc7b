"""The step line is the same line wherever a step is priced: the router's and the simulators'."""

from __future__ import annotations

import pytest

from dlora.cost.line import StepLine
from dlora.cost.params import CostParams, step_seconds
from dlora.sim.step_costs import preset


def test_the_routers_decode_step_is_its_line_at_the_batch_size_up_to_a_full_batch():
    p = CostParams(per_iteration_s=0.01, per_decode_token_s=0.002, per_prefill_token_s=0.0005, max_batch=8)
    assert p.line == StepLine(0.01, 0.0005, 0.002)
    assert step_seconds(p, 5) == pytest.approx(p.line.seconds(0, 5))
    assert step_seconds(p, 50) == pytest.approx(p.line.seconds(0, 8))  # the batch is capped
    assert p.line.seconds(100, 0) == pytest.approx(0.01 + 100 * 0.0005)


def test_a_simulated_step_is_the_base_line_plus_the_lora_line_when_adapter_tokens_run():
    c = preset("cpu-vllm-ops")
    merged = c.step(seqs=6, prefill_tokens=40, lora_seqs=0, lora_prefill_tokens=0, adapters=0)
    assert merged == pytest.approx(c.fixed_s + 6 * c.per_seq_s + 40 * c.per_prefill_token_s)
    unmerged = c.step(seqs=6, prefill_tokens=40, lora_seqs=4, lora_prefill_tokens=30, adapters=2)
    lora = c.lora_fixed_s + 4 * c.lora_per_seq_s + 30 * c.lora_per_prefill_token_s + 2 * c.lora_per_adapter_s
    assert unmerged == pytest.approx(merged + lora)
    assert c.base.seconds(40, 6) == pytest.approx(merged)
