"""A replica's host memory from its config: one term per thing that holds memory, in bytes.

What a CPU replica holds (docs/operating.md, "Memory of a replica", has the measured figure beside
each term; bench/memory_footprint measures them):

- `weights`: the base model, parameters x dtype bytes. vLLM's CPU GEMMs repack each linear weight
  into oneDNN's layout and free the original, so this is one copy, not two.
- `kv_cache`: `engine.kv_cache_space_gib` whole GiB (vLLM's CPU cache is allocated and zeroed up
  front, so all of it is resident), or `engine.num_kv_blocks` blocks of 128 tokens where set.
- `lora_slots`: vLLM's stacked LoRA tensors, allocated up front for `max_loras` adapters of
  `max_lora_rank` on every projection of every layer, and on the embeddings and the LM head
  (which vLLM wraps whether or not an adapter targets them).
- `adapter_host_cache`: adapters read into host memory, at most `max_cpu_loras` of them (or
  `max_cpu_lora_mib`), each counted at `max_lora_rank` on all projections: an upper bound.
- `merged_weights`: with a policy that merges, the merged-weights cache keeps as many whole merged
  models' linear weights as fit `merged_cache_mib`, and at least one while an adapter is merged
  (the base weights are kept aside to swap back).
- `pristine_checkpoint`: the base checkpoint's linear weights, read once at the first merge and
  kept to repair a failed one (in the checkpoint's dtype).
- `pristine_rows`: the in-place merge's saved rows; zero on CPU, where prepacked weights always take
  the reload path.
- `engine_runtime`, `replica_actor`: what the engine process holds beyond the terms above (Python,
  torch and vLLM state, step buffers, libraries) and the replica's Ray actor process (vLLM's
  frontend, tokenizer): measured constants.

`tree_terms` adds the API server and Ray's own processes for a whole `dlora serve`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dlora.config import DloraConfig

MIB = 1 << 20
GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CPU_BLOCK_TOKENS = 128  # vLLM's KV block size on CPU
# Measured by bench/memory_footprint (PSS, SmolLM2-135M, vLLM 0.32 CPU, 2026-12-06): what each
# process holds beyond the terms computed from the config.
# The engine's: an engine on the `unmerged` policy (2,714-2,775 MiB) less the terms above.
ENGINE_RUNTIME_BYTES = 1000 * MIB
REPLICA_ACTOR_BYTES = 645 * MIB  # with vLLM's resource tracker process beside it
SERVER_BYTES = 710 * MIB
RAY_BYTES = 440 * MIB  # GCS, raylet, dashboard and its agent, runtime-env agent, log monitor, monitor


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only (Llama-like) model depends on, from its HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    checkpoint_dtype: str

    @classmethod
    def from_hf_config(cls, c: dict) -> ModelShape:
        heads = c["num_attention_heads"]
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            tied_embeddings=bool(c.get("tie_word_embeddings", False)),
            checkpoint_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        return cls.from_hf_config(json.loads((Path(path) / "config.json").read_text()))

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA-able projection of one layer."""
        h, q, kv, i = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def linear_params(self) -> int:
        """Parameters of every layer's projections: what a merge rewrites."""
        return self.num_layers * sum(n * m for n, m in self.projections().values())

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + embeddings + norms

    @property
    def lora_features(self) -> int:
        """in + out features over every projection of every layer: a rank-1 adapter's parameters."""
        return self.num_layers * sum(n + m for n, m in self.projections().values())

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def dtype_bytes(cfg: DloraConfig, shape: ModelShape) -> int:
    """Bytes per element of the served model: `model.dtype`, or the checkpoint's for "auto"."""
    name = shape.checkpoint_dtype if cfg.model.dtype == "auto" else cfg.model.dtype
    return DTYPE_BYTES.get(name, 4)


def kv_cache_bytes(cfg: DloraConfig, shape: ModelShape) -> int:
    if cfg.engine.num_kv_blocks is not None:
        return cfg.engine.num_kv_blocks * CPU_BLOCK_TOKENS * shape.kv_bytes_per_token(dtype_bytes(cfg, shape))
    return cfg.engine.kv_cache_space_gib * GIB


def adapter_bytes(cfg: DloraConfig, shape: ModelShape) -> int:
    """The largest adapter the engine accepts: `max_lora_rank` on every projection, in the model dtype."""
    return cfg.engine.max_lora_rank * shape.lora_features * dtype_bytes(cfg, shape)


def vocab_lora_bytes(cfg: DloraConfig, shape: ModelShape) -> int:
    """One slot's LoRA stacks on the embeddings and the LM head: A and B of each span the vocabulary
    on one side and the rank on the other (vocab x rank + hidden x rank, twice)."""
    return 2 * cfg.engine.max_lora_rank * (shape.vocab_size + shape.hidden_size) * dtype_bytes(cfg, shape)


def merged_weights_bytes(cfg: DloraConfig, shape: ModelShape) -> int:
    if cfg.scheduling.policy == "unmerged":
        return 0
    whole = shape.linear_params * dtype_bytes(cfg, shape)
    return max(1, int(cfg.engine.merged_cache_mib * MIB) // whole) * whole


def replica_terms(cfg: DloraConfig, shape: ModelShape) -> dict[str, int]:
    """One CPU replica's memory by term (bytes): its engine process and its actor process."""
    width = dtype_bytes(cfg, shape)
    e = cfg.engine
    host_cache = e.max_cpu_loras * adapter_bytes(cfg, shape)
    if e.max_cpu_lora_mib is not None:
        host_cache = min(host_cache, int(e.max_cpu_lora_mib * MIB))
    merging = cfg.scheduling.policy != "unmerged"
    return {
        "weights": shape.params * width,
        "kv_cache": kv_cache_bytes(cfg, shape),
        "lora_slots": e.max_loras * (adapter_bytes(cfg, shape) + vocab_lora_bytes(cfg, shape)),
        "adapter_host_cache": host_cache,
        "merged_weights": merged_weights_bytes(cfg, shape),
        "pristine_checkpoint": shape.linear_params * DTYPE_BYTES.get(shape.checkpoint_dtype, 4) if merging else 0,
        "pristine_rows": 0,
        "engine_runtime": ENGINE_RUNTIME_BYTES,
        "replica_actor": REPLICA_ACTOR_BYTES,
    }


def tree_terms(cfg: DloraConfig, shape: ModelShape) -> dict[str, int]:
    """A whole `dlora serve` on one machine (bytes): every replica, the API server and Ray."""
    return {
        "replicas": cfg.cluster.num_replicas * sum(replica_terms(cfg, shape).values()),
        "server": SERVER_BYTES,
        "ray": RAY_BYTES,
    }
