"""`engine.lora_backend`: which batched-LoRA implementation a replica's vLLM engine runs.

Runs inside vLLM's worker process (`install`); `check` also runs in the server process at start.

- `vllm`   (default): vLLM's own punica wrapper (torch ops on CPU with dlora's -1 fix, Triton on
  CUDA); nothing is patched.
- `einsum`: `punica_wrapper.PunicaWrapperEinsum`, dlora's one-hot einsum kernels (the CPU backend;
  also correct on CUDA, where it is just slower than `triton`).
- `triton`: `punica_wrapper.PunicaWrapperTriton`, dlora's SGMV/BGMV Triton kernels. CUDA (or ROCm)
  only. Without a GPU it is refused, at start and again inside the engine: the only way to run
  these kernels on a CPU is Triton's interpreter, 10^3-10^4x slower, which is for the kernel tests
  (tests/kernels, and the wrapper's unit test), never for a server. TRITON_INTERPRET=1 does not
  lift the refusal.

How the choice reaches the engine: the replica's Ray runtime env sets `DLORA_LORA_BACKEND`
(`ray_replica.replica_runtime_env`); dlora's worker extension (`worker.py`, imported by vLLM in
the worker before the model is built) calls `install(env.DLORA_LORA_BACKEND.get())`, which makes
the platform's `get_punica_wrapper()` return our class path. vLLM's `get_punica_wrapper` selector
asks the platform on every call, and `model_manager.py` imported the selector by name, so the
platform classmethod is the one seam that reaches it without editing vLLM.

Both dlora backends need `engine.enforce_eager: true` (the per-step batch metadata is built on the
host, which torch.compile and CUDA graphs would freeze); `check` refuses the combination at start.
"""

from __future__ import annotations

import logging

from dlora.config import ConfigError, DloraConfig
from dlora.env import LORA_BACKENDS as BACKENDS

# Under "vllm." so the line goes through vLLM's log handler inside the engine process (the root
# logger there has none, and dlora INFO lines would be dropped).
log = logging.getLogger(f"vllm.{__name__}")

WRAPPERS = {
    "einsum": "dlora.engine_ext.punica_wrapper.PunicaWrapperEinsum",
    "triton": "dlora.engine_ext.punica_wrapper.PunicaWrapperTriton",
}

_NO_GPU = (
    "engine.lora_backend='triton' needs CUDA GPUs, but {where}. On CPU use 'einsum' (dlora's "
    "kernels) or 'vllm'; Triton's CPU interpreter is 10^3-10^4x slower and only for tests."
)


_MISSING = object()
_HOOK = "get_punica_wrapper"  # the Platform classmethod vLLM asks for the punica wrapper's class path
# (platform class, what its own __dict__ held under get_punica_wrapper, backend) while patched
_saved: tuple[type, object, str] | None = None


class LoRABackendError(ConfigError):
    """The configured LoRA backend cannot run here; the message says why and what to use."""


def check_config(cfg: DloraConfig) -> None:
    """`dlora serve`'s pre-start check (one-line error): `check` with a local Ray cluster's GPUs
    (this machine's); a remote cluster's GPUs are known only once Ray is joined (see launcher)."""
    gpu = True
    if cfg.cluster.ray_address is None and cfg.engine.lora_backend == "triton":
        import torch

        gpu = torch.cuda.is_available() and torch.cuda.device_count() >= cfg.cluster.num_replicas
    check(
        cfg.engine.lora_backend,
        gpu=gpu,
        enforce_eager=cfg.engine.enforce_eager,
        where="this machine (a local Ray cluster) has fewer CUDA GPUs than cluster.num_replicas",
    )


def check(
    name: str, *, gpu: bool, enforce_eager: bool, where: str = "the Ray cluster has fewer GPUs than replicas"
) -> None:
    """Start-time check in the server process, before any replica is created; `gpu` says whether
    every replica gets a GPU (`where` says why not, in the error)."""
    if name not in BACKENDS:
        raise LoRABackendError(f"engine.lora_backend={name!r}: must be one of {', '.join(BACKENDS)}")
    if name == "triton" and not gpu:
        raise LoRABackendError(_NO_GPU.format(where=where))
    if name != "vllm" and not enforce_eager:
        raise LoRABackendError(
            f"engine.lora_backend={name!r} needs engine.enforce_eager: true "
            "(its per-step metadata cannot be captured by torch.compile/CUDA graphs)"
        )


def install(name: str) -> bool:
    """Make vLLM build `name`'s punica wrapper in this process; `vllm` restores vLLM's own.

    Must run before the model (and its LoRA manager) is built. Idempotent; returns True if the
    platform's choice changed now.
    """
    if name not in BACKENDS:
        raise LoRABackendError(f"unknown LoRA backend {name!r}; choose from {', '.join(BACKENDS)}")
    if name == "vllm":
        return uninstall()
    from vllm.platforms import current_platform

    if name == "triton" and not current_platform.is_cuda_alike():
        raise LoRABackendError(_NO_GPU.format(where=f"this engine runs on {type(current_platform).__name__}"))
    if _saved is not None and _saved[2] == name:
        return False
    uninstall()
    _patch(type(current_platform), name)
    log.info("LoRA backend %s: vLLM will use %s", name, WRAPPERS[name])
    return True


def uninstall() -> bool:
    """Give the platform back its own `get_punica_wrapper`; returns True if a patch was removed."""
    global _saved
    if _saved is None:
        return False
    cls, original, _ = _saved
    if original is _MISSING:
        delattr(cls, _HOOK)
    else:
        setattr(cls, _HOOK, original)
    _saved = None
    return True


def installed() -> str:
    """The backend the platform currently selects in this process."""
    return "vllm" if _saved is None else _saved[2]


def _patch(cls: type, name: str) -> None:
    global _saved
    path = WRAPPERS[name]
    _saved = (cls, cls.__dict__.get(_HOOK, _MISSING), name)
    setattr(cls, _HOOK, classmethod(lambda _cls: path))
