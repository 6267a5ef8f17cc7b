"""The memory estimate of a replica follows its config: each setting moves its own term, by the
amount the formula in docs/operating.md ("Memory of a replica") says, and no other term."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlora import config
from dlora.replica.memory_estimate import (
    CPU_BLOCK_TOKENS,
    GIB,
    MIB,
    ModelShape,
    replica_terms,
    tree_terms,
)

# SmolLM2-135M-Instruct's config.json (the fields the estimate reads)
SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
SHAPE = ModelShape.from_hf_config(SMOLLM2)


def cfg(**sections) -> config.DloraConfig:
    base = {"model": {"dtype": "float32"}, "engine": {"lora_backend": "einsum"}, "scheduling": {"policy": "dlora"}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return config.from_dict(base)


def changed(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a if b[k] != a[k]}


def test_smollm2_shape():
    assert SHAPE.params == 134_515_008  # the published parameter count, 134.5M
    assert SHAPE.linear_params == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    # K and V of 30 layers x 3 heads x 64 dims
    assert SHAPE.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert SHAPE.lora_features == 30 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)


def test_default_config_terms():
    t = replica_terms(cfg(engine={"max_loras": 8, "kv_cache_space_gib": 1}), SHAPE)
    assert t["weights"] == 134_515_008 * 4
    assert t["kv_cache"] == GIB
    # max_loras x max_lora_rank on every projection, the embeddings and the LM head, fp32
    assert t["lora_slots"] == 8 * 16 * (SHAPE.lora_features + 2 * (49152 + 576)) * 4
    assert t["adapter_host_cache"] == 16 * 16 * SHAPE.lora_features * 4  # max_cpu_loras at max rank
    whole = SHAPE.linear_params * 4
    assert t["merged_weights"] == (1024 * MIB // whole) * whole == 2 * whole  # two fp32 merged models
    assert t["pristine_checkpoint"] == SHAPE.linear_params * 2  # kept as the bf16 checkpoint holds it
    assert t["pristine_rows"] == 0  # CPU: prepacked weights always take the reload path


@pytest.mark.parametrize("gib", [1, 2, 5])
def test_kv_cache_space_moves_only_the_kv_term(gib):
    one, other = (
        replica_terms(cfg(engine={"kv_cache_space_gib": 1}), SHAPE),
        replica_terms(cfg(engine={"kv_cache_space_gib": gib}), SHAPE),
    )
    assert changed(one, other) == ({"kv_cache": (gib - 1) * GIB} if gib != 1 else {})


def test_num_kv_blocks_sizes_the_kv_cache_in_blocks_of_tokens():
    t = replica_terms(cfg(engine={"kv_cache_space_gib": 1, "num_kv_blocks": 100}), SHAPE)
    assert t["kv_cache"] == 100 * CPU_BLOCK_TOKENS * 46_080


def test_dtype_halves_every_term_held_in_the_model_dtype():
    fp32, bf16 = replica_terms(cfg(), SHAPE), replica_terms(cfg(model={"dtype": "bfloat16"}), SHAPE)
    for term in ("weights", "lora_slots", "adapter_host_cache"):
        assert bf16[term] * 2 == fp32[term], term
    # half the bytes per merged model: the same 1024 MiB budget keeps 5 of them instead of 2
    assert bf16["merged_weights"] == 5 * SHAPE.linear_params * 2
    assert fp32["merged_weights"] == 2 * SHAPE.linear_params * 4
    assert set(changed(fp32, bf16)) == {"weights", "lora_slots", "adapter_host_cache", "merged_weights"}
    # "auto" serves the checkpoint's dtype (bf16 here)
    assert replica_terms(cfg(model={"dtype": "auto"}), SHAPE) == bf16


def test_max_cpu_loras_moves_the_host_cache_by_one_largest_adapter_each():
    a, b = (
        replica_terms(cfg(engine={"max_cpu_loras": 16}), SHAPE),
        replica_terms(cfg(engine={"max_cpu_loras": 20}), SHAPE),
    )
    assert changed(a, b) == {"adapter_host_cache": 4 * 16 * SHAPE.lora_features * 4}


def test_max_cpu_lora_mib_caps_the_host_cache():
    t = replica_terms(cfg(engine={"max_cpu_lora_mib": 64}), SHAPE)
    assert t["adapter_host_cache"] == 64 * MIB


def test_merged_weights_follow_the_cache_budget_and_the_policy():
    whole = SHAPE.linear_params * 4
    assert replica_terms(cfg(engine={"merged_cache_mib": 0}), SHAPE)["merged_weights"] == whole  # while merged
    assert replica_terms(cfg(engine={"merged_cache_mib": 2048}), SHAPE)["merged_weights"] == 5 * whole
    unmerged = replica_terms(cfg(scheduling={"policy": "unmerged"}), SHAPE)
    assert unmerged["merged_weights"] == unmerged["pristine_checkpoint"] == 0


def test_tree_scales_with_the_replica_count():
    one, two = cfg(cluster={"num_replicas": 1}), cfg(cluster={"num_replicas": 2})
    replica = sum(replica_terms(one, SHAPE).values())
    assert tree_terms(two, SHAPE)["replicas"] == 2 * tree_terms(one, SHAPE)["replicas"] == 2 * replica
    assert changed(tree_terms(one, SHAPE), tree_terms(two, SHAPE)) == {"replicas": replica}


def test_max_loras_moves_only_the_lora_slots():
    a, b = replica_terms(cfg(engine={"max_loras": 4}), SHAPE), replica_terms(cfg(engine={"max_loras": 8}), SHAPE)
    assert changed(a, b) == {"lora_slots": 4 * 16 * (SHAPE.lora_features + 2 * (49152 + 576)) * 4}


def test_shipped_config_reads_its_own_settings():
    shipped = config.load(Path(__file__).resolve().parents[2] / "configs" / "default.yaml")
    t = replica_terms(shipped, SHAPE)
    width = {"float32": 4, "bfloat16": 2}[shipped.model.dtype]
    assert t["kv_cache"] == shipped.engine.kv_cache_space_gib * GIB
    assert t["weights"] == SHAPE.params * width
    assert (
        t["adapter_host_cache"]
        == shipped.engine.max_cpu_loras * shipped.engine.max_lora_rank * SHAPE.lora_features * width
    )
    assert sum(tree_terms(shipped, SHAPE).values()) == shipped.cluster.num_replicas * sum(t.values()) + sum(
        v for k, v in tree_terms(shipped, SHAPE).items() if k != "replicas"
    )
