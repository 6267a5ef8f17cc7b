"""One LoRA backend's engine on the GPU, against HF + PEFT (run in its own process by `cli`).

Why a process per backend: the backend is chosen when vLLM's LoRA manager is built and dlora's
worker extension is imported once per process; and a fresh process gives the GPU memory back.

Phases, each a batch of (adapter or base) x prompts decoded greedily and compared token for token:
    unmerged  - the `unmerged` policy: every adapter through the LoRA kernels
    switching - the `merged` policy with merged_max_iters=1: a merge or unmerge between most steps
    merged    - an adapter merged out of band, its requests served on the merged weights
    mixed     - (einsum/triton) the `dlora` policy with mixed merged steps: other adapters' and
                base requests run beside a merged adapter, their LoRA compensating its delta
Then: the base model's tokens and logprobs after all of that equal those before (bit-exact
unmerge), and merge/unmerge times measured out of band.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]
ADAPTERS = ("a0", "a1", "a2")
MAX_TOKENS = 16
SWITCH_REPS = 10
# Mixed steps: a0 holds 3 of 8 requests at first, then, as a1 and the base finish, its share passes
# alpha and it is merged while the others still decode (as tests/engine_ext/test_mixed_merged.py).
MIXED_JOBS = [("a0", p, 24) for p in PROMPTS[:3]] + [
    ("a1", PROMPTS[0], 6),
    ("a1", PROMPTS[1], 12),
    ("a1", PROMPTS[3], 22),
    (None, "The quick brown", 10),
    (None, "x = 1\n", 22),
]
MIXING = {"policy": "dlora", "alpha": 0.5, "beta": 0.3, "mixed_merged": True}


def run(backend: str) -> dict:
    """Every phase on `backend`; a dict of results (raises only on a broken setup)."""
    from dlora.gpucheck.oracle import HFOracle
    from dlora.models.tiny import ensure_test_model

    model = ensure_test_model()
    oracle = HFOracle(str(model.base), {k: str(v) for k, v in model.adapters.items()})
    result: dict[str, Any] = {"backend": backend, "phases": {}}
    started = time.perf_counter()
    with _engine(model, backend, {"policy": "unmerged"}) as llm:
        result["engine_start_s"] = round(time.perf_counter() - started, 2)
        before = _base_logprobs(llm)
        result["phases"]["unmerged"] = _compare(llm, model, oracle, _jobs())
        result["phases"]["merged"] = _merged_phase(llm, model, oracle)
        result["switch_ms"] = _switch_times(llm, model)
        result["base_exact_after_unmerge"] = _base_logprobs(llm) == before
    with _engine(model, backend, {"policy": "merged", "merged_max_iters": 1}) as llm:
        before = _base_logprobs(llm)
        phase = _compare(llm, model, oracle, _jobs())
        phase["num_switches"] = _scheduler_state(llm).get("num_switches")
        result["phases"]["switching"] = phase
        result["base_exact_after_switching"] = _base_logprobs(llm) == before
    if backend != "vllm":  # vLLM's own LoRA ops cannot compensate a merged delta
        with _engine(model, backend, MIXING) as llm:
            phase = _compare(llm, model, oracle, MIXED_JOBS)
            phase["num_switches"] = _scheduler_state(llm).get("num_switches")
            phase["ok"] = phase["ok"] and (phase["num_switches"] or 0) > 0  # a0 was merged mid-batch
            result["phases"]["mixed"] = phase
    result["ok"] = (
        all(p["ok"] for p in result["phases"].values())
        and result["base_exact_after_unmerge"]
        and result["base_exact_after_switching"]
        and (result["phases"]["switching"]["num_switches"] or 0) > 0
    )
    return result


def _jobs() -> list[tuple[str | None, str, int]]:
    return [(a, p, MAX_TOKENS) for a in (None, *ADAPTERS) for p in PROMPTS]


class _engine:
    """An in-process `LLM` with a replica's own engine arguments on the tiny model (fp32)."""

    def __init__(self, model, backend: str, scheduling: dict):
        self.model, self.backend, self.scheduling = model, backend, scheduling

    def __enter__(self):
        from dlora import config
        from dlora.engine_ext import lora_backend
        from dlora.replica.engine import engine_kwargs

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["DLORA_LORA_BACKEND"] = self.backend
        lora_backend.install(self.backend)
        from vllm import LLM

        cfg = config.from_dict(
            {
                "model": {"dtype": "float32", "max_model_len": 512, "seed": 0},
                "engine": {
                    "max_loras": 2,
                    "max_lora_rank": 8,
                    "max_cpu_loras": 4,
                    "max_num_seqs": 32,
                    "num_kv_blocks": 512,
                    "lora_backend": self.backend,
                    "enforce_eager": self.backend != "vllm",
                },  # vllm: CUDA graphs, as served
                "scheduling": self.scheduling,
            }
        )
        self.llm = LLM(**engine_kwargs(cfg, str(self.model.base)), gpu_memory_utilization=0.5)
        if self.llm.collective_rpc("dlora_setup") != [True]:
            raise RuntimeError("dlora's worker extension did not install")
        return self.llm

    def __exit__(self, *exc):
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _lora(model, name: str | None):
    from vllm.lora.request import LoRARequest

    if name is None:
        return None
    return LoRARequest(name, ("a0", "a1", "a2", "a3").index(name) + 1, str(model.adapters[name]))


def _compare(llm, model, oracle, jobs) -> dict:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, _, n in jobs]
    outs = llm.generate(
        [p for _, p, _ in jobs], params, lora_request=[_lora(model, a) for a, _, _ in jobs], use_tqdm=False
    )
    mismatches = []
    for (adapter, prompt, n), out in zip(jobs, outs):
        got, want = tuple(out.outputs[0].token_ids), oracle.greedy(adapter, prompt, n)
        if got != want:
            mismatches.append({"adapter": adapter, "prompt": prompt, "engine": got, "hf_peft": want})
    return {"ok": not mismatches, "requests": len(jobs), "mismatches": mismatches}


def _merged_phase(llm, model, oracle) -> dict:
    a2 = _lora(model, "a2")  # targets attention and MLP: fused qkv and gate_up rows
    (report,) = llm.collective_rpc("dlora_apply", args=("merge", "a2", a2.lora_path, a2.lora_int_id))
    if not report.get("ok"):
        return {"ok": False, "requests": 0, "mismatches": [], "error": f"merge failed: {report}"}
    try:
        (state,) = llm.collective_rpc("dlora_state")
        phase = _compare(llm, model, oracle, [("a2", p, MAX_TOKENS) for p in PROMPTS])
        phase["strategy"] = state.get("merge_strategy")  # inplace at TP=1 on CUDA
    finally:
        llm.collective_rpc("dlora_apply", args=("unmerge",))
    return phase


def _switch_times(llm, model) -> dict:
    """Median wall time of an out-of-band merge and unmerge of each adapter (after a warm-up)."""
    times: dict[str, list[float]] = {"merge": [], "unmerge": []}
    for rep in range(SWITCH_REPS + 1):
        for name in ADAPTERS:
            lora = _lora(model, name)
            for op, args in (("merge", (name, lora.lora_path, lora.lora_int_id)), ("unmerge", ())):
                t0 = time.perf_counter()
                (report,) = llm.collective_rpc("dlora_apply", args=(op, *args))
                if rep and report.get("ok", True):
                    times[op].append((time.perf_counter() - t0) * 1e3)
    return {op: round(statistics.median(t), 3) if t else None for op, t in times.items()}


def _base_logprobs(llm):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(["The quick brown", "x = 1\n"], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
        for o in outs
    ]


def _scheduler_state(llm) -> dict:
    try:
        state = llm.llm_engine.engine_core.engine_core.scheduler.dlora_batching_state()
    except AttributeError:  # an engine core in another process: no switch count
        return {}
    return dataclasses.asdict(state)


def main(argv: list[str]) -> int:
    """`python -m dlora.gpucheck.engine_check BACKEND OUT.json` (what `cli` runs per backend)."""
    backend, out = argv
    result = run(backend)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
