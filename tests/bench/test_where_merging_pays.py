"""bench/where_merging_pays's pure logic: the cells' workloads, the ratios and summary over the
grid, the step fits of traced engine steps, and the simulator's grid on a small cell. No servers."""

from __future__ import annotations

import json
from argparse import Namespace
from collections import Counter

import pytest

from bench.where_merging_pays import grid
from bench.where_merging_pays.grid import Cell
from bench.where_merging_pays.sim import attention_weight_from_fits, flop_share_from_fits, measured_lora_cost, run_cell
from bench.where_merging_pays.step_fit import fit_steps, fit_traces


def test_top_share_adapters_gives_the_top_adapter_its_share_and_the_rest_in_turn():
    names = grid.top_share_adapters(32, 0.95, ("a0", "a1", "a2", "a3"), seed=1)
    assert Counter(names) == {"a0": 30, "a1": 1, "a2": 1}
    assert Counter(grid.top_share_adapters(32, 0.25, ("a0", "a1", "a2", "a3"), 0)) == dict.fromkeys(
        ("a0", "a1", "a2", "a3"), 8
    )
    # round(0.6 x 32) = round(19.2) = 19 for a0; the other 32 - 19 = 13 go to the only other, a1.
    names = grid.top_share_adapters(32, 0.6, ("a0", "a1"), 3)
    assert Counter(names) == {"a0": 19, "a1": 13}
    assert names != ["a0"] * 19 + ["a1"] * 13  # shuffled, not a0's block first
    # round(0.5 x 10) = 5 for a0; the other 5 to a1, a2, a3 in turn: a1 a2 a3 a1 a2.
    names = grid.top_share_adapters(10, 0.5, ("a0", "a1", "a2", "a3"), 0)
    assert Counter(names) == {"a0": 5, "a1": 2, "a2": 2, "a3": 1}
    # One adapter: it is also "the rest", so all 5 names are a0 whatever the share.
    assert grid.top_share_adapters(5, 0.2, ("a0",), 0) == ["a0"] * 5
    with pytest.raises(ValueError):
        grid.top_share_adapters(8, 0.0, ("a0",), 0)


def test_cell_requests_fix_lengths_and_arrive_at_once():
    reqs = grid.cell_requests(Cell(8, "all", 1024, 0.6), 20, 32, 2048, seed=0, with_prompts=False)
    assert len(reqs) == 20 and {r.prompt_len for r in reqs} == {1024} and {r.output_len for r in reqs} == {32}
    assert {r.arrival_time for r in reqs} == {0.0}
    assert Counter(r.adapter for r in reqs)["a0"] == 12


def cell(rank, share, unmerged, merged, dlora, prompt_len=64):
    ratios = grid.cell_ratios({"unmerged": unmerged, "merged": merged, "dlora": dlora})
    return {**Cell(rank, "all", prompt_len, share).key(), "ratios": ratios}


def test_ratios_and_summary_pick_the_best_gain_and_the_worst_cell():
    r = grid.cell_ratios({"unmerged": 100.0, "merged": 120.0, "dlora": 110.0, "vllm": 40.0})
    assert r == pytest.approx(
        {
            "dlora_vs_unmerged": 1.1,
            "dlora_vs_better_baseline": 110 / 120,
            "merged_vs_unmerged": 1.2,
            "dlora_vs_vllm_server": 2.75,
        }
    )
    cells = [cell(8, 0.25, 100, 60, 99), cell(64, 0.95, 100, 130, 126), cell(64, 0.6, 100, 110, 100)]
    s = grid.summarize(cells, "real")
    assert s["dlora_vs_unmerged_best"]["value"] == pytest.approx(1.26)
    assert s["dlora_vs_unmerged_best"]["regime"] == {
        "rank": 64,
        "modules": "all",
        "prompt_len": 64,
        "top_share": 0.95,
        "source": "real",
    }
    assert s["dlora_vs_better_baseline_min"]["value"] == pytest.approx(100 / 110)
    assert s["dlora_vs_better_baseline_min"]["regime"]["top_share"] == 0.6
    assert not s["dlora_vs_better_baseline_min"]["met"]
    assert [c["top_share"] for c in s["cells_below_target"]] == [0.6]


def step(seqs, prompt_tokens, seconds, t=1.0, switch=0.0):
    return {"t": t, "step_s": seconds, "switch_s": switch, "scheduled": {"a0": seqs}, "tokens": seqs + prompt_tokens}


def test_fit_steps_recovers_a_linear_step_time_and_skips_switch_steps():
    # 20 ms + 2 ms per sequence + 1 ms per prompt token, exactly
    steps = [step(n, p, 0.020 + 0.002 * n + 0.001 * p) for n in (1, 4, 16, 32) for p in (0, 0, 64, 512)]
    steps.append(step(8, 0, 5.0, switch=4.9))  # a merge's step: not a compute sample
    f = fit_steps(steps)
    assert f["fixed_s"] == pytest.approx(0.020) and f["per_seq_s"] == pytest.approx(0.002)
    assert f["per_prefill_token_s"] == pytest.approx(0.001) and f["steps"] == 16
    decode_only = fit_steps([step(n, 0, 0.01 + 0.001 * n) for n in range(1, 10)])
    assert decode_only["per_prefill_token_s"] is None and decode_only["per_seq_s"] == pytest.approx(0.001)
    assert fit_steps(steps[:3]) is None


def test_fit_traces_takes_the_steps_inside_each_servers_runs(tmp_path):
    for server, per_seq in (("unmerged", 0.003), ("merged", 0.002)):
        (tmp_path / server).mkdir()
        lines = [step(n, 0, 0.02 + per_seq * n, t=10 + n) for n in range(1, 11)]
        lines += [step(n, 0, 9.0, t=100 + n) for n in range(1, 11)]  # another cell's steps
        (tmp_path / server / "steps-1.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    points = [{"system": s, "prompt_len": 64, "wall": [10, 21]} for s in ("unmerged", "merged")]
    fits = fit_traces(tmp_path, points, ("unmerged", "merged"))
    assert fits["unmerged"]["64"]["per_seq_s"] == pytest.approx(0.003)
    lora = measured_lora_cost(fits, 64, seqs=10)
    assert lora["decode_step_s"] == pytest.approx(0.01) and lora["base_decode_step_s"] == pytest.approx(0.04)


def test_simulated_cell_reports_every_policy_and_its_ratios():
    args = Namespace(num_prompts=16, output_len=8, seeds=2, noise=0.0)
    c = run_cell("gpu-like", Cell(64, "all", 64, 0.95), args)
    assert set(c["throughput"]) == {"unmerged", "merged", "dlora"}
    # rank 64 on all seven projections with one adapter at 95%: merging is far cheaper on this preset
    assert c["ratios"]["merged_vs_unmerged"] > 1.5
    assert c["switches"]["merged"] >= 1 and c["switches"]["unmerged"] == 0


def fit(fixed, per_seq, per_prompt):
    return {"fixed_s": fixed, "per_seq_s": per_seq, "per_prefill_token_s": per_prompt, "steps": 100}


def test_flop_share_from_two_ranks_prompt_token_cost():
    # LoRA adds 0.5 ms per prompt token at rank 8 and 1.375 ms at rank 64: 1 + share x 7 = 2.75
    real = {
        "workload": {"prompt_lens": [64, 1024], "num_prompts": 32},
        "step_fits": {
            rank: {
                "unmerged": {"1024": fit(0.05, 0.003, 0.0013 + lora)},
                "merged": {"1024": fit(0.04, 0.002, 0.0013)},
            }
            for rank, lora in (("8", 0.0005), ("64", 0.001375))
        },
    }
    got = flop_share_from_fits(real)
    assert got["flop_share"] == pytest.approx(0.25) and got["ranks"] == [8, 64]
    assert got["from"] == "per_prefill_token_s"
    assert flop_share_from_fits({**real, "step_fits": {"8": real["step_fits"]["8"]}}) is None


def test_attention_weight_from_the_merged_servers_decode_steps():
    from dlora.sim.step_costs import PRESETS, SMOLLM2_135M

    base, fixed = SMOLLM2_135M.base_macs_per_token(), PRESETS["cpu-einsum"].fixed_s
    a1, a2 = (SMOLLM2_135M.attention_macs(p + 32 / 2) / base for p in (64, 1024))
    w, per_seq = 4.0, 0.002  # per-sequence cost at no context
    merged = {str(p): fit(fixed, per_seq * (1 + w * a), None) for p, a in ((64, a1), (1024, a2))}
    real = {"workload": {"prompt_lens": [64, 1024], "num_prompts": 32}, "step_fits": {"8": {"merged": merged}}}
    assert attention_weight_from_fits(real, output_len=32)["attention_weight"] == pytest.approx(4.0)
    assert attention_weight_from_fits(None, 32) is None
