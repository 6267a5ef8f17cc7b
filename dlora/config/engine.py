"""`engine:` = each replica's vLLM engine: adapter slots and caches, KV cache, batch limits, LoRA
backend and structured outputs."""

from __future__ import annotations

from dataclasses import dataclass

from dlora.config.checks import check, check_kinds

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class EngineConfig:
    max_loras: int = 4  # adapters in one batch (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int = 16  # adapters kept in host memory, LRU beyond that
    # MiB of adapter weights each replica's host cache may hold (the router unloads the least
    # recently used unpinned adapter without requests in flight); None: max_cpu_loras alone
    max_cpu_lora_mib: float | None = None
    kv_cache_space_gib: int = 1  # vLLM CPU reads whole GiB (VLLM_CPU_KVCACHE_SPACE)
    # KV blocks per replica (vLLM's num_gpu_blocks_override): a finer cap than whole GiB, e.g. to
    # give each replica a fixed token budget; None = all of kv_cache_space_gib
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    lora_backend: str = "vllm"
    enforce_eager: bool = True
    # Read a cold adapter's files in a background thread of the engine, so running requests keep
    # stepping while it loads. Off by default: on a 2-core CPU the read holds a step up by about one
    # step, while the thread's extra engine round trips make the cold request's first token ~1.2x
    # later (bench/cold_load); it pays where a read takes many steps (large adapters, cold disks, GPUs).
    prefetch_adapters: bool = False
    # MiB of merged weights each replica keeps for adapters merged before (LRU), so merging one of
    # them again is a swap (~1-2 ms on one core) instead of a reload (0.1-1 s with SmolLM2-135M).
    # One adapter on all seven projections of SmolLM2-135M in bf16 is 212 MB: 1024 keeps four.
    merged_cache_mib: float = 1024
    # Where a replica keeps the adapters it got from the API server's machine when it runs on
    # another node (content-addressed, shared by a node's replicas); must be node-local. None: the
    # per-user directory dlora-node-cache-<uid> under the system temp dir of each node
    node_cache_dir: str | None = None
    node_cache_mib: float = 4096  # MiB of adapters that directory keeps (least recently used go)
    # vLLM's structured-output engine (--structured-outputs-config.backend): auto, xgrammar,
    # guidance, outlines or lm-format-enforcer
    structured_outputs_backend: str = "auto"
    # JSON outputs with no whitespace between tokens (--structured-outputs-config.disable_any_whitespace):
    # a model that was not trained for JSON may otherwise emit whitespace until max_tokens
    structured_outputs_disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        check_kinds(self, "engine")
        check(
            self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
            "engine.structured_outputs_backend",
            self.structured_outputs_backend,
            f"must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}",
        )
        check(
            not self.structured_outputs_disable_any_whitespace
            or self.structured_outputs_backend in ("xgrammar", "guidance"),
            "engine.structured_outputs_disable_any_whitespace",
            self.structured_outputs_disable_any_whitespace,
            "needs engine.structured_outputs_backend xgrammar or guidance (vLLM's rule)",
        )
        check(self.merged_cache_mib >= 0, "engine.merged_cache_mib", self.merged_cache_mib, "must be >= 0")
        check(self.node_cache_mib > 0, "engine.node_cache_mib", self.node_cache_mib, "must be > 0")
        check(
            self.node_cache_dir is None or bool(self.node_cache_dir.strip()),
            "engine.node_cache_dir",
            self.node_cache_dir,
            "must be a directory path, or null (a per-user directory under the system temp dir)",
        )
        check(self.max_loras >= 1, "engine.max_loras", self.max_loras, "must be >= 1")
        check(
            self.max_cpu_lora_mib is None or self.max_cpu_lora_mib > 0,
            "engine.max_cpu_lora_mib",
            self.max_cpu_lora_mib,
            "must be a number of MiB > 0, or null (count adapters only: engine.max_cpu_loras)",
        )
        check(
            self.max_lora_rank in (1, 8, 16, 32, 64, 128, 256, 320, 512),
            "engine.max_lora_rank",
            self.max_lora_rank,
            "vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320 or 512",
        )
        check(
            self.max_cpu_loras >= self.max_loras,
            "engine.max_cpu_loras",
            self.max_cpu_loras,
            f"must be >= engine.max_loras ({self.max_loras})",
        )
        check(
            self.kv_cache_space_gib > 0,
            "engine.kv_cache_space_gib",
            self.kv_cache_space_gib,
            "must be a whole number of GiB > 0",
        )
        check(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            "engine.num_kv_blocks",
            self.num_kv_blocks,
            "must be >= 2 (vLLM keeps one block empty)",
        )
        check(self.max_num_seqs >= 1, "engine.max_num_seqs", self.max_num_seqs, "must be >= 1")
        check(
            self.lora_backend in ("vllm", "triton", "einsum"),
            "engine.lora_backend",
            self.lora_backend,
            "must be one of vllm, triton, einsum",
        )
        # dlora's punica wrappers rebuild their batch metadata in Python every step (host syncs,
        # per-call allocations); CUDA graphs would replay the first step's metadata for every batch.
        check(
            self.lora_backend == "vllm" or self.enforce_eager,
            "engine.lora_backend",
            self.lora_backend,
            "needs engine.enforce_eager: true (its per-step batch metadata cannot be captured in "
            "CUDA graphs or torch.compile); use lora_backend: vllm for CUDA graphs",
        )
