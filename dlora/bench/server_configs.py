"""The servers a benchmark compares, built one way for every script: vLLM's own OpenAI server
command, a one-replica dlora config with the same engine sizes, and the shipped default config on a
throw-away port and state dir."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from dlora.bench.shipped import REPO_ROOT


@dataclass(frozen=True)
class EngineSettings:
    """Engine sizes every server of one comparison gets (vLLM's flags, dlora's model/engine sections)."""

    max_model_len: int
    max_loras: int
    max_lora_rank: int
    max_num_seqs: int
    kv_cache_space_gib: float
    enforce_eager: bool = True
    dtype: str = "bfloat16"


def adapter_entries(adapters: list[Path]) -> list[dict]:
    """dlora's `adapters:` section: adapter i is served as `a{i}`."""
    return [{"name": f"a{i}", "path": str(p)} for i, p in enumerate(adapters)]


def vllm_server_command(base: Path, adapters: list[Path], port: int, s: EngineSettings) -> list[str]:
    """vLLM's OpenAI server on the base model with adapter i served as `a{i}` (no adapters: LoRA off)."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(base),
        "--served-model-name",
        "base",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        s.dtype,
        "--max-model-len",
        str(s.max_model_len),
        "--max-num-seqs",
        str(s.max_num_seqs),
        "--disable-log-stats",
    ]
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(s.max_loras), "--max-lora-rank", str(s.max_lora_rank)]
        cmd += ["--lora-modules", *[f"a{i}={p}" for i, p in enumerate(adapters)]]
    return cmd + (["--enforce-eager"] if s.enforce_eager else [])


def single_replica_config(
    base: Path, adapters: list[Path], port: int, state: Path, s: EngineSettings, *, lora_backend: str, scheduling: dict
) -> dict:
    """A dlora config with one replica on core 0 and the engine sizes of `s`."""
    return {
        "model": {"path": str(base), "served_name": "base", "dtype": s.dtype, "max_model_len": s.max_model_len},
        "engine": {
            "max_loras": s.max_loras,
            "max_lora_rank": s.max_lora_rank,
            "max_cpu_loras": s.max_loras,
            "kv_cache_space_gib": s.kv_cache_space_gib,
            "max_num_seqs": s.max_num_seqs,
            "enforce_eager": s.enforce_eager,
            "lora_backend": lora_backend,
        },
        "server": {"port": port, "state_dir": str(state)},
        "cluster": {"num_replicas": 1, "cpu_cores": [0]},
        "scheduling": scheduling,
        "adapters": adapter_entries(adapters),
    }


def shipped_server_config(port: int, state_dir: str, root: Path = REPO_ROOT) -> dict:
    """configs/default.yaml as shipped (in the checkout at `root`: another commit's, for a
    comparison of commits), on another port and a throw-away state dir."""
    cfg = yaml.safe_load((root / "configs" / "default.yaml").read_text())
    cfg["server"]["port"] = port
    cfg["server"]["state_dir"] = state_dir
    cfg["server"]["adapter_roots"] = [str(root / "adapters")]
    cfg["adapters"] = [{**a, "path": str((root / "configs" / a["path"]).resolve())} for a in cfg["adapters"]]
    return cfg


def shipped_engine_settings() -> EngineSettings:
    """configs/default.yaml's model and engine sizes, as vLLM flags take them."""
    cfg = shipped_server_config(0, "")
    model, engine = cfg["model"], cfg["engine"]
    return EngineSettings(
        max_model_len=model["max_model_len"],
        max_loras=engine["max_loras"],
        max_lora_rank=engine["max_lora_rank"],
        max_num_seqs=engine["max_num_seqs"],
        kv_cache_space_gib=engine["kv_cache_space_gib"],
        enforce_eager=engine["enforce_eager"],
        dtype=model["dtype"],
    )
