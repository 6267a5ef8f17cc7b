"""What an engine does, timings excluded: steps, scheduled and generated tokens and weight switches
of one fixed greedy workload on an in-process engine with dlora's scheduler, per policy whose
decisions do not depend on measured times (`unmerged`, `merged`, `merged` switching every step),
with digests of every step's (weights, adapters scheduled) and of the outputs.

Run it at two commits to show that a change leaves the engine's behaviour as it was:

    .venv/bin/python -m bench.engine_counts.run --out /tmp/after.json
    git worktree add /tmp/old <commit> && (cd /tmp/old && PYTHONPATH=/tmp/old \
        /work/main/.venv/bin/python -m bench.engine_counts.run --out /tmp/before.json)

(`dlora`'s own policy is left out: its switches follow measured step times, which vary run to run.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from dlora import config
from dlora.bench.provenance import provenance

HERE = Path(__file__).parent
ADAPTERS = ("a0", "a1", "a2")
PROMPTS = ["def main(", "import os\nimport sys\n", "class Foo:\n    def", "for i in range("]
POLICIES = {
    "unmerged": {"policy": "unmerged"},
    "merged-every-step": {"policy": "merged", "merged_max_iters": 1},
    "merged": {"policy": "merged"},
}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def engine(tiny, scheduling: dict):
    """vLLM's `LLM` in this process with a replica's own engine arguments on the tiny model."""
    from vllm import LLM

    from dlora.replica.engine import engine_kwargs

    cfg = config.from_dict(
        {
            "model": {"dtype": "float32", "max_model_len": 512, "seed": 0},
            "engine": {"max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4, "max_num_seqs": 32, "num_kv_blocks": 64},
            "scheduling": scheduling,
        }
    )
    llm = LLM(**engine_kwargs(cfg, str(tiny.base)))
    assert llm.llm_engine.engine_core.engine_core.dlora_setup() == [True]
    return llm


def counts(tiny, scheduling: dict, rounds: int, max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    llm = engine(tiny, scheduling)
    try:
        s = llm.llm_engine.engine_core.engine_core.scheduler
        steps: list = []
        orig = s.update_from_output

        def update(so, mro):
            ran = sorted(
                (s.requests[i].lora_request.lora_name if s.requests[i].lora_request else "", n)
                for i, n in so.num_scheduled_tokens.items()
            )
            steps.append((s._dlora_worker.weights, ran))
            return orig(so, mro)

        s.update_from_output = update
        jobs = [(a, p) for _ in range(rounds) for a in (None, *ADAPTERS) for p in PROMPTS]
        outs = llm.generate(
            [p for _, p in jobs],
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            lora_request=[LoRARequest(a, ADAPTERS.index(a) + 1, str(tiny.adapters[a])) if a else None for a, _ in jobs],
            use_tqdm=False,
        )
        return {
            "steps": len(steps),
            "scheduled_tokens": sum(n for _, ran in steps for _, n in ran),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "switches": s.dlora_batching_state().num_switches,
            "step_digest": digest(steps),
            "outputs_digest": digest([list(o.outputs[0].token_ids) for o in outs]),
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="times each (adapter, prompt) pair is sent")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args()
    # One process runs engine core and worker, as a replica does; the tiny model fits any machine.
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_USE_V2_MODEL_RUNNER="0",
        DLORA_LORA_BACKEND="einsum",
    )
    from dlora.engine_ext import lora_backend
    from dlora.models.tiny import ensure_test_model

    lora_backend.install("einsum")
    tiny = ensure_test_model()
    policies = {}
    for name, scheduling in POLICIES.items():
        print(f"engine_counts: {name} ...", flush=True)
        policies[name] = counts(tiny, scheduling, args.rounds, args.max_tokens)
        print(f"engine_counts: {name} {policies[name]}", flush=True)
    result = {**provenance("bench.engine_counts.run"), "policies": policies}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"engine_counts: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
