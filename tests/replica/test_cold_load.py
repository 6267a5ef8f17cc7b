"""A cold adapter load on a real replica engine (SmolLM2-135M, `EngineHost`) beside a running stream.

vLLM's own `add_lora` reads the adapter between two engine steps, so every running stream stalls
for the read; with `engine.prefetch_adapters` the read runs in a background thread
of the engine (engine_ext/lora_prefetch.py). The adapter is rank 64 on every projection (about
80 MB in fp32). Here: the stream goes on through the load and the cold answer equals the warm one;
how long the stream's steps take meanwhile is a figure of the machine, measured side by side with
the in-step load in bench/cold_load, not bounded here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from dlora import config
from dlora.models.smollm2 import resolve_model_path
from dlora.replica.engine import EngineHost
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import replica_runtime_env
from tests.engine_ext.lora_files import write_peft_adapter

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 64
STEADY_TOKENS = 24
HOT_PROMPT = tuple(range(1000, 1064))
COLD_PROMPT = tuple(range(2000, 2032))
ENGINE_CORE = 1  # the engine runs pinned to one core, as a replica's does (ReplicaActor.start)


def _shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    c = json.loads((model_dir / "config.json").read_text())
    h, i, kv = c["hidden_size"], c["intermediate_size"], c["num_key_value_heads"] * c["head_dim"]
    return {
        "q_proj": (h, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, h),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def big_adapter(d: Path, model_dir: Path) -> Path:
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    # alpha 2 on rank 64 (scale 1/32): the adapter changes the output without garbling it
    return write_peft_adapter(
        d,
        MODULES,
        _shapes(model_dir),
        lambda layer, m: f"model.layers.{layer}.{'self_attn' if m in MODULES[:4] else 'mlp'}.{m}.weight",
        range(layers),
        rank=RANK,
        alpha=2,
    )


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return Path(resolve_model_path(config.ModelConfig().path))


@pytest.fixture(scope="module")
def host(smollm2):
    """An EngineHost for SmolLM2 with the environment a replica process gets, on its own loop."""
    cfg = config.from_dict(
        {
            "model": {"path": str(smollm2), "dtype": "float32", "max_model_len": 1024},
            # einsum: configs/default.yaml's LoRA kernels (vLLM's own CPU ops take ~0.7 s for a
            # LoRA prefill on this model, which would hide the load in the stream's gaps)
            "engine": {
                "max_loras": 2,
                "max_lora_rank": RANK,
                "max_cpu_loras": 4,
                "max_num_seqs": 8,
                "lora_backend": "einsum",
            },
            "scheduling": {"policy": "unmerged"},
        }
    )
    mp = pytest.MonkeyPatch()
    for key, value in replica_runtime_env(cfg)["env_vars"].items():
        mp.setenv(key, value)
    loop = asyncio.new_event_loop()
    h = EngineHost(cfg, str(smollm2))
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ENGINE_CORE % (os.cpu_count() or 1)})  # inherited by the engine-core process
    try:
        loop.run_until_complete(h.start())
    finally:
        os.sched_setaffinity(0, previous)
    try:
        yield h, loop
    finally:
        h.shutdown()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
        mp.undo()


@contextlib.contextmanager
def prefetching(h: EngineHost, on: bool):
    """`engine.prefetch_adapters` for the loads in the block (the host reads it per load)."""
    before = h.cfg
    h.cfg = dataclasses.replace(before, engine=dataclasses.replace(before.engine, prefetch_adapters=on))
    try:
        yield
    finally:
        h.cfg = before


def greedy(request_id: str, prompt: tuple[int, ...], max_tokens: int, adapter: AdapterRef | None = None):
    sampling = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id, prompt, sampling, adapter)


async def tokens_of(h: EngineHost, req: GenerateRequest) -> list[int]:
    return [t async for d in h.generate(req) for t in d.token_ids]


async def cold_load_beside_a_stream(h: EngineHost, ref: AdapterRef) -> dict:
    """A long base-model stream; after its first tokens, a request for the cold adapter `ref`
    (loaded as the router does: add_adapter, then generate), then the same request warm."""
    arrivals: list[float] = []

    async def hot() -> None:
        async for d in h.generate(greedy("hot", HOT_PROMPT, 400)):
            if d.token_ids:
                arrivals.append(time.perf_counter())

    task = asyncio.ensure_future(hot())
    while len(arrivals) < STEADY_TOKENS:
        await asyncio.sleep(0.002)
    t0 = time.perf_counter()
    await h.add_adapter(ref)
    t1 = time.perf_counter()
    cold = await tokens_of(h, greedy("cold", COLD_PROMPT, 12, ref))
    warm = await tokens_of(h, greedy("warm", COLD_PROMPT, 12, ref))
    await h.abort("hot")
    await task
    await h.remove_adapter(ref.int_id)
    # every gap overlapping the load: a step the load held up ends after it
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t0 and a < t1]
    return {"during": during, "cold": cold, "warm": warm}


@pytest.mark.engine
def test_a_cold_load_does_not_stall_the_running_stream_and_answers_as_warm(host, smollm2, tmp_path):
    h, loop = host
    path = big_adapter(tmp_path / "r64-all", smollm2)
    with prefetching(h, True):
        r = loop.run_until_complete(cold_load_beside_a_stream(h, AdapterRef("big", 7, str(path))))
    assert r["during"], "no hot token arrived during or right after the load"
    assert r["cold"] == r["warm"] and len(r["cold"]) == 12
    base = loop.run_until_complete(tokens_of(h, greedy("base", COLD_PROMPT, 12)))
    assert r["cold"] != base  # the adapter did apply


def _write_corrupt_adapter(d: Path, smollm2: Path) -> Path:
    """A valid adapter_config.json next to a truncated safetensors file (its header claims more
    bytes than the file has): only the engine's read of the weights finds it."""
    big_adapter(d, smollm2)
    f = d / "adapter_model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return d


@pytest.mark.engine
def test_a_corrupt_adapter_is_refused_as_vllms_own_load_refuses_it(host, smollm2, tmp_path):
    h, loop = host
    path = str(_write_corrupt_adapter(tmp_path / "corrupt", smollm2))
    errors = {}
    for on in (False, True):
        with prefetching(h, on), pytest.raises(Exception) as e:
            loop.run_until_complete(h.add_adapter(AdapterRef("corrupt", 11, path)))
        errors[on] = str(e.value)
    assert errors[True] == errors[False]
    assert errors[True].startswith("Call to add_lora method failed")
    assert 11 not in loop.run_until_complete(h.resident_adapter_ids())
    # the engine is unharmed: the same id loads once its files are whole
    good = big_adapter(tmp_path / "good", smollm2)
    loop.run_until_complete(h.add_adapter(AdapterRef("corrupt", 11, str(good))))
    assert 11 in loop.run_until_complete(h.resident_adapter_ids())
    loop.run_until_complete(h.remove_adapter(11))
