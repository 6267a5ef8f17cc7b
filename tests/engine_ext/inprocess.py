"""An in-process vLLM engine (tiny model, fp32) with dlora's scheduler and worker extension."""

from __future__ import annotations

import contextlib

import pytest

from dlora import config
from dlora.engine_ext import lora_backend
from dlora.replica.engine import engine_kwargs
from tests.harness import TINY_KV_BLOCKS


@contextlib.contextmanager
def inprocess_engine(tiny_model, scheduling: dict, backend: str = "vllm", **engine_args):
    """`LLM` with `scheduling` (the config section) and LoRA `backend`, switching enabled;
    `engine_args` override vLLM's engine arguments (e.g. num_gpu_blocks_override)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # as replicas run (ray_replica.replica_runtime_env)
    mp.setenv("DLORA_LORA_BACKEND", backend)  # read by the scheduler, and by the worker extension on first import
    before = lora_backend.installed()
    lora_backend.install(backend)  # the worker extension is imported once per process: an earlier engine's choice
    from vllm import LLM

    cfg = config.from_dict(
        {
            "model": {"dtype": "float32", "max_model_len": 512, "seed": 0},
            "engine": {
                "max_loras": 2,
                "max_lora_rank": 8,
                "max_cpu_loras": 4,
                "max_num_seqs": 32,
                "num_kv_blocks": TINY_KV_BLOCKS,
            },
            "scheduling": scheduling,
        }
    )
    # A replica's own arguments (its scheduler, priority queue, worker extension, ...), on this model.
    engine = LLM(**(engine_kwargs(cfg, str(tiny_model.base)) | engine_args))
    try:
        assert engine.llm_engine.engine_core.engine_core.dlora_setup() == [True]
        yield engine
    finally:
        engine.llm_engine.engine_core.shutdown()
        lora_backend.install(before)
        mp.undo()


class SharedEngine:
    """An `inprocess_engine` that can stop and start again: what a run-wide fixture shares between
    modules (tests/schedule.py stops it after its last user and starts it again for a later one)."""

    def __init__(self, tiny_model, scheduling: dict, **kwargs) -> None:
        self._args = (tiny_model, scheduling)
        self._kwargs = kwargs
        self._context: contextlib.AbstractContextManager | None = None
        self.llm = None

    @property
    def running(self) -> bool:
        return self._context is not None

    def start(self) -> SharedEngine:
        self._context = inprocess_engine(*self._args, **self._kwargs)
        self.llm = self._context.__enter__()
        return self

    def stop(self, wait: bool = True) -> None:
        """Shuts the engine down now (in this process there is nothing to overlap with)."""
        if self._context is not None:
            context, self._context, self.llm = self._context, None, None
            context.__exit__(None, None, None)
