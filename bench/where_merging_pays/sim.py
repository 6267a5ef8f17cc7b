"""The grid of bench/where_merging_pays through the replica simulator (dlora/sim/batching_sim.py).

Each cell's workload (grid.py) runs through `BatchingSim` with the real policy objects and
configs/default.yaml's scheduling parameters, under two step-cost presets, `gpu-like` and
`cpu-einsum`, each rescaled to the cell's rank, projections and prompt length by
`dlora.sim.step_costs.regime_costs` (LoRA FLOPs per token, LoRA layer calls, attention context,
merged-weight bytes). Per cell: the median over `--seeds` workload orders, each with seeded
per-step noise, of each policy's output throughput, and dlora's ratios. Both projection sets
(q/k/v/o and all seven) run. When the result file already holds the real grid, its traced step
fits are set beside the cost model's prediction (`check`).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.where_merging_pays import grid
from bench.where_merging_pays.grid import MODULE_SETS, POLICIES, Cell
from dlora.bench.cost_presets import BACKEND_OF
from dlora.bench.shipped import shipped_batching_parameters
from dlora.scheduling import BatchingConfig
from dlora.sim.batching_sim import SimRequest
from dlora.sim.skew import simulate
from dlora.sim.step_costs import PRESETS, SMOLLM2_135M, LoraShape, Regime, StepCosts, regime_costs

SIM_PRESETS = ("gpu-like", "cpu-einsum")
# Each run first serves one untimed burst of the cell's shape (another seed), as the real servers
# are warmed up and stay up across a rank's cells: a policy that learns starts from what it learned.
WARM_UP_SEED = 1000


def sim_requests(cell: Cell, args, seed: int) -> list[SimRequest]:
    reqs = grid.cell_requests(cell, args.num_prompts, args.output_len, 4096, seed, with_prompts=False)
    return [SimRequest(r.request_id, r.adapter, r.arrival_time, r.prompt_len, r.output_len) for r in reqs]


def cell_costs(preset: str, cell: Cell, output_len: int, calibration: dict | None = None) -> StepCosts:
    """The preset rescaled to the cell; `calibration` holds regime_costs' flop_share and attention_weight."""
    lora = LoraShape(cell.rank, MODULE_SETS[cell.modules])
    return regime_costs(PRESETS[preset], Regime(lora, cell.prompt_len, output_len), **(calibration or {}))


def parse_variant(text: str) -> dict:
    """`alpha=0.9,merged_cost_ratio=0.6` -> scheduling keys over configs/default.yaml's."""
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        out[key.strip()] = float(value)
    return out


def dlora_variant(text: str) -> str:
    return f"dlora {text}"


def run_cell(preset: str, cell: Cell, args, calibration: dict | None = None) -> dict:
    """Each policy, and dlora with each of `args.variants`, over `args.seeds` workload orders."""
    costs = cell_costs(preset, cell, args.output_len, calibration)
    backend = BACKEND_OF[preset]
    configs = {p: BatchingConfig(**(shipped_batching_parameters() if p == "dlora" else {})) for p in POLICIES}
    for v in getattr(args, "variants", []):
        configs[dlora_variant(v)] = BatchingConfig(**(shipped_batching_parameters() | parse_variant(v)))
    tput: dict[str, list[float]] = {p: [] for p in configs}
    switches: dict[str, list[int]] = {p: [] for p in configs}
    for seed in range(args.seeds):
        requests = sim_requests(cell, args, seed)
        warm = sim_requests(cell, args, seed + WARM_UP_SEED)
        for name, config in configs.items():
            policy = name if name in POLICIES else "dlora"
            config = config.for_lora_backend(backend)
            r = simulate(policy, config, costs, requests, noise_sd=args.noise, seed=seed, warm_up=warm)
            end = max(x.finished_at for x in r.requests)
            tput[name].append(sum(x.output_tokens for x in r.requests) / end)
            switches[name].append(r.switches)
    throughput = {p: statistics.median(v) for p, v in tput.items()}
    per_seed = [grid.cell_ratios({p: tput[p][i] for p in POLICIES}) for i in range(args.seeds)]
    variants = {
        name: grid.cell_ratios({**throughput, "dlora": throughput[name]}) for name in configs if name not in POLICIES
    }
    return {
        **cell.key(),
        "preset": preset,
        "throughput": throughput,
        "switches": {p: statistics.median(v) for p, v in switches.items()},
        "ratios": grid.cell_ratios(throughput),
        "min_over_seeds": {k: min(r[k] for r in per_seed) for k in per_seed[0]},
        "variant_ratios": variants,
    }


def variant_summaries(cells: list[dict], variants: list[str]) -> dict:
    """The grid's summary as it would be with each variant of dlora's scheduling parameters."""
    out = {}
    for v in variants:
        name = dlora_variant(v)
        out[name] = grid.summarize([{**c, "ratios": c["variant_ratios"][name]} for c in cells], "sim")
    return out


def predicted_lora_cost(costs: StepCosts, seqs: int) -> dict:
    """What the LoRA term adds, by the cost model: per decode step of `seqs` sequences, per prompt token."""
    return {
        "decode_step_s": costs.lora_fixed_s + costs.lora_per_seq_s * seqs,
        "per_prefill_token_s": costs.lora_per_prefill_token_s,
        "base_decode_step_s": costs.fixed_s + costs.per_seq_s * seqs,
        "base_per_prefill_token_s": costs.per_prefill_token_s,
    }


def measured_lora_cost(fits: dict, prompt_len: int, seqs: int) -> dict | None:
    """The same from the real grid's step fits: the unmerged server's fit minus the merged one's."""
    u, m = fits.get("unmerged", {}).get(str(prompt_len)), fits.get("merged", {}).get(str(prompt_len))
    if not u or not m:
        return None

    def decode(f: dict) -> float:
        return f["fixed_s"] + f["per_seq_s"] * seqs

    out = {"decode_step_s": decode(u) - decode(m), "base_decode_step_s": decode(m)}
    if u["per_prefill_token_s"] is not None and m["per_prefill_token_s"] is not None:
        out["per_prefill_token_s"] = u["per_prefill_token_s"] - m["per_prefill_token_s"]
        out["base_per_prefill_token_s"] = m["per_prefill_token_s"]
    return out


def check_against_real(real: dict | None, args, calibration: dict) -> list[dict]:
    """The cpu-einsum cost model's LoRA cost beside the one measured in the real grid's traces."""
    if not real:
        return []
    out = []
    seqs = real["workload"]["num_prompts"]
    for rank, fits in real.get("step_fits", {}).items():
        for prompt_len in real["workload"]["prompt_lens"]:
            cell = Cell(int(rank), "all", prompt_len, 1.0)
            out.append(
                {
                    "rank": int(rank),
                    "modules": "all",
                    "prompt_len": prompt_len,
                    "decode_batch": seqs,
                    "model": predicted_lora_cost(cell_costs("cpu-einsum", cell, args.output_len, calibration), seqs),
                    "measured": measured_lora_cost(fits, prompt_len, seqs),
                }
            )
    return out


def flop_share_from_fits(real: dict | None) -> dict | None:
    """The part of the LoRA per-token cost that grows with rank, from the real grid's step fits at
    two ranks on the same projections: measured(r2) / measured(r1) = 1 + share x (r2 / r1 - 1).
    From the prompt tokens' cost at the longest prompt (the cleanest per-token sample), else from
    a decode step's (its fixed part taken as rank-independent too). None without two ranks."""
    if not real or len(real.get("step_fits", {})) < 2:
        return None
    fits = real["step_fits"]
    r1, r2 = sorted(int(r) for r in fits)[:: len(fits) - 1]
    prompt_len, seqs = max(real["workload"]["prompt_lens"]), real["workload"]["num_prompts"]
    lo, hi = measured_lora_cost(fits[str(r1)], prompt_len, seqs), measured_lora_cost(fits[str(r2)], prompt_len, seqs)
    if not lo or not hi:
        return None
    key = "per_prefill_token_s" if "per_prefill_token_s" in lo and "per_prefill_token_s" in hi else "decode_step_s"
    if lo[key] <= 0:
        return None
    share = (hi[key] / lo[key] - 1) / (r2 / r1 - 1)
    return {"flop_share": min(1.0, max(0.0, share)), "from": key, "ranks": [r1, r2], "prompt_len": prompt_len}


def attention_weight_from_fits(real: dict | None, output_len: int) -> dict | None:
    """What an attention multiply-add costs relative to a linear one, from the merged server's
    decode steps (no LoRA term) at the shortest and the longest prompt: with F the preset's fixed
    step cost and a(P) the attention multiply-adds per token over the base's, the step's
    per-sequence part grows by R = (1 + w a(P2)) / (1 + w a(P1)); the median over ranks."""
    if not real:
        return None
    p1, p2 = min(real["workload"]["prompt_lens"]), max(real["workload"]["prompt_lens"])
    n, fixed = real["workload"]["num_prompts"], PRESETS["cpu-einsum"].fixed_s
    base = SMOLLM2_135M.base_macs_per_token()
    a1, a2 = (SMOLLM2_135M.attention_macs(p + output_len / 2) / base for p in (p1, p2))
    weights = []
    for fits in real.get("step_fits", {}).values():
        f1, f2 = fits.get("merged", {}).get(str(p1)), fits.get("merged", {}).get(str(p2))
        if p1 == p2 or not f1 or not f2:
            continue
        m1, m2 = (f["fixed_s"] + f["per_seq_s"] * n - fixed for f in (f1, f2))
        if m1 > 0 and m2 > 0:
            r = m2 / m1
            weights.append(max(0.0, (r - 1) / (a2 - r * a1)))
    if not weights:
        return None
    return {"attention_weight": statistics.median(weights), "per_rank": weights, "prompt_lens": [p1, p2]}


def run_sim(args) -> dict:
    from dlora.bench.provenance import provenance

    t0 = time.monotonic()
    out_path = Path(args.out)
    real = json.loads(out_path.read_text()).get("real") if out_path.is_file() else None
    flops, attention = flop_share_from_fits(real), attention_weight_from_fits(real, args.output_len)
    # gpu-like has no measurement behind it: FLOPs price its LoRA and attention terms
    calibration = {
        "gpu-like": {"flop_share": 1.0, "attention_weight": 1.0},
        "cpu-einsum": {
            "flop_share": flops["flop_share"] if flops else 1.0,
            "attention_weight": attention["attention_weight"] if attention else 1.0,
        },
    }
    cells = [Cell(r, m, p, s) for m in MODULE_SETS for r in args.ranks for p in args.prompt_lens for s in args.skews]
    by_preset: dict[str, list[dict]] = {}
    for preset in SIM_PRESETS:
        for cell in cells:
            c = run_cell(preset, cell, args, calibration[preset])
            by_preset.setdefault(preset, []).append(c)
            t = c["throughput"]
            print(
                f"[{time.monotonic() - t0:4.0f}s] {preset:10s} rank {cell.rank:2d} {cell.modules:4s} "
                f"prompt {cell.prompt_len:4d} share {cell.top_share:.2f}: "
                + "  ".join(f"{p} {t[p]:7.1f}" for p in POLICIES)
                + f"  dlora/better {c['ratios']['dlora_vs_better_baseline']:.3f}"
                f"  dlora/unmerged {c['ratios']['dlora_vs_unmerged']:.3f}",
                flush=True,
            )
    every = [c for cs in by_preset.values() for c in cs]
    return {
        **provenance("bench.where_merging_pays.run"),
        "workload": {
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "prompt_lens": args.prompt_lens,
            "top_shares": args.skews,
            "ranks": args.ranks,
            "modules": {k: list(v) for k, v in MODULE_SETS.items()},
            "seeds": args.seeds,
            "noise_sd": args.noise,
            "dlora_variants_also_run": args.variants,
            "arrivals": "all at once",
        },
        "dlora_scheduling": shipped_batching_parameters(),
        "presets": {p: vars(PRESETS[p]) for p in SIM_PRESETS},
        "cells_by_preset": by_preset,
        "calibration": {
            "per_preset": calibration,
            "fitted_from_real_traces": {"flop_share": flops, "attention_weight": attention},
        },
        "check": check_against_real(real, args, calibration["cpu-einsum"]),
        "summary": grid.summarize(every, "sim"),
        "per_preset_summary": {p: grid.summarize(cs, "sim") for p, cs in by_preset.items()},
        "dlora_variants": {
            "what": "dlora with these scheduling keys changed, the rest as configs/default.yaml ships it",
            "per_preset": {p: variant_summaries(cs, args.variants) for p, cs in by_preset.items()},
        },
        "wall_seconds": time.monotonic() - t0,
    }
