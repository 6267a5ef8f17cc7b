"""Merge math and the all-or-nothing merge/unmerge of `WeightMerger`, against fp64 (no engine).

The engine's reload is replaced by `FakeModel.reload`, which does what vLLM's loader does with a
checkpoint tensor: cast it to the model dtype and store it under its name.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dlora.engine_ext.adapter_factors import MergeError, lora_scale, read_adapter
from dlora.engine_ext.checkpoint_tensors import CheckpointTensors, fused_module
from dlora.engine_ext.merge import WeightMerger, merged_weight
from tests.engine_ext.lora_files import PARENT, write_peft_adapter

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
PROJ = "model.layers.{}.{}.{}.weight"
SHAPES = {
    "q_proj": (16, 16),
    "k_proj": (8, 16),
    "v_proj": (8, 16),
    "o_proj": (16, 16),
    "gate_proj": (24, 16),
    "up_proj": (24, 16),
    "down_proj": (16, 24),
}


def name(layer: int, module: str) -> str:
    return PROJ.format(layer, PARENT[module], module)


@pytest.fixture
def base_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(32, 16, generator=g)}
    for layer in range(2):
        for module, shape in SHAPES.items():
            tensors[name(layer, module)] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    d = tmp_path / "base"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d


def write_adapter(d, modules, rank=4, alpha=8, seed=1, **config):
    return write_peft_adapter(d, modules, SHAPES, name, range(2), rank, alpha, seed, **config)


class FakeModel:
    """Live weights keyed by checkpoint name, in the model dtype; records every reload."""

    def __init__(self, checkpoint: CheckpointTensors, dtype=torch.float32, fail_after: int | None = None):
        self.weights = {n: t.to(dtype) for n, t in checkpoint.get(list(checkpoint.names())).items()}
        self.dtype = dtype
        self.reloads: list[list[str]] = []
        self.fail_after = fail_after  # raise after storing this many tensors of the next reload

    def reload(self, items):
        names = []
        for i, (n, t) in enumerate(items):
            if self.fail_after is not None and i == self.fail_after:
                self.fail_after = None
                raise RuntimeError("simulated reload failure")
            self.weights[n] = t.to(self.dtype)
            names.append(n)
        self.reloads.append(names)


def make(base_dir, dtype=torch.float32, **kw):
    ckpt = CheckpointTensors(base_dir)
    original = {n: t.to(dtype) for n, t in ckpt.get(list(ckpt.names())).items()}
    model = FakeModel(ckpt, dtype, **kw)
    return WeightMerger(ckpt, model.reload, LLAMA_PACKED, dtype), model, original


def fp64_reference(base_dir, adapter_dir):
    """W + (alpha/r)·B@A per touched weight, all in fp64."""
    ckpt = CheckpointTensors(base_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    lora = read_adapter(adapter_dir)
    scale = cfg["lora_alpha"] / cfg["r"]
    out = {}
    for n, (a, b) in lora.factors.items():
        w = ckpt.get([n])[n].double()
        out[n] = w + scale * (b.double() @ a.double())
    return out


def assert_same(live, original, names):
    for n in names:
        assert torch.equal(live[n], original[n]), n


def test_merged_weight_matches_fp64():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=g)
    a, b = torch.randn(8, 48, generator=g), torch.randn(64, 8, generator=g)
    got = merged_weight(w.to(torch.bfloat16), a, b, 2.0)
    assert got.dtype == torch.float32
    ref = w.to(torch.bfloat16).double() + 2.0 * (b.double() @ a.double())
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-5)


def test_scale_follows_peft_and_vllm():
    assert lora_scale({"r": 8, "lora_alpha": 16}) == 2.0
    assert lora_scale({"r": 16, "lora_alpha": 16, "use_rslora": True}) == 16 / math.sqrt(16)
    assert lora_scale({"r": 4}) == 1.0


def test_fused_module_names():
    assert fused_module(name(0, "k_proj"), LLAMA_PACKED) == "model.layers.0.self_attn.qkv_proj"
    assert fused_module(name(1, "up_proj"), LLAMA_PACKED) == "model.layers.1.mlp.gate_up_proj"
    assert fused_module(name(1, "o_proj"), LLAMA_PACKED) == "model.layers.1.self_attn.o_proj"


def test_read_tiny_model_adapter(tiny_model):
    lora = read_adapter(tiny_model.adapters["a0"])
    cfg = json.loads((tiny_model.adapters["a0"] / "adapter_config.json").read_text())
    assert lora.scale == cfg["lora_alpha"] / cfg["r"]
    assert "model.layers.0.self_attn.q_proj.weight" in lora.factors
    a, b = lora.factors["model.layers.0.self_attn.q_proj.weight"]
    assert a.shape[0] == b.shape[1] == cfg["r"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_equals_fp64_reference_and_unmerge_restores_exactly(base_dir, tmp_path, dtype):
    adapter = write_adapter(tmp_path / "ad", ["q_proj", "v_proj", "down_proj"])
    merger, model, original = make(base_dir, dtype)
    merger.merge(str(adapter))
    ref = fp64_reference(base_dir, adapter)
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-6  # one rounding of the fp32 sum to the model dtype
    for n, want in ref.items():
        assert torch.allclose(model.weights[n].double(), want, rtol=rtol, atol=1e-5), n
    # Every shard of a touched fused module is reloaded (k_proj with q/v), the others are untouched.
    reloaded = set(model.reloads[-1])
    assert {name(0, "k_proj"), name(1, "k_proj")} <= reloaded
    assert not reloaded & {name(0, "o_proj"), name(0, "gate_proj"), "model.embed_tokens.weight"}
    assert_same(model.weights, original, [name(0, "k_proj"), name(0, "o_proj")])
    # Shards of one fused module are adjacent (vLLM buffers a layer until it is complete).
    order = [fused_module(n, LLAMA_PACKED) for n in model.reloads[-1]]
    assert order == sorted(order, key=order.index)
    merger.unmerge()
    assert merger.merged is None
    assert_same(model.weights, original, original)


def test_merging_another_adapter_never_accumulates(base_dir, tmp_path):
    a = write_adapter(tmp_path / "a", ["q_proj", "o_proj"], seed=1)
    b = write_adapter(tmp_path / "b", ["q_proj", "gate_proj"], seed=2)
    merger, model, original = make(base_dir)
    for _ in range(3):
        merger.merge(str(a))
        merger.merge(str(b))  # unmerges a first
    ref = fp64_reference(base_dir, b)
    for n, want in ref.items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    assert_same(model.weights, original, [name(0, "o_proj"), name(1, "o_proj")])  # a's o_proj is gone
    merger.unmerge()
    assert_same(model.weights, original, original)


@pytest.mark.parametrize("breakage", ["missing_dir", "no_weights", "bad_json", "unknown_target", "bad_shape"])
def test_bad_adapter_fails_before_touching_the_weights(base_dir, tmp_path, breakage):
    adapter = write_adapter(tmp_path / "ad", ["q_proj"])
    if breakage == "missing_dir":
        shutil.rmtree(adapter)
    elif breakage == "no_weights":
        (adapter / "adapter_model.safetensors").unlink()
    elif breakage == "bad_json":
        (adapter / "adapter_config.json").write_text("{not json")
    elif breakage == "unknown_target":
        key = "base_model.model.model.layers.7.self_attn.q_proj"
        save_file(
            {f"{key}.lora_A.weight": torch.ones(4, 16), f"{key}.lora_B.weight": torch.ones(16, 4)},
            str(adapter / "adapter_model.safetensors"),
        )
    else:
        key = "base_model.model." + name(0, "q_proj").removesuffix(".weight")
        save_file(
            {f"{key}.lora_A.weight": torch.ones(4, 15), f"{key}.lora_B.weight": torch.ones(16, 4)},
            str(adapter / "adapter_model.safetensors"),
        )
    merger, model, original = make(base_dir)
    with pytest.raises(MergeError):
        merger.merge(str(adapter))
    assert merger.merged is None and model.reloads == []
    assert_same(model.weights, original, original)


def test_failure_inside_the_reload_restores_the_base(base_dir, tmp_path):
    adapter = write_adapter(tmp_path / "ad", ["q_proj", "k_proj", "v_proj", "o_proj"])
    merger, model, original = make(base_dir, fail_after=5)  # dies half way through the merge
    with pytest.raises(MergeError, match="base restored"):
        merger.merge(str(adapter))
    assert merger.merged is None
    assert_same(model.weights, original, original)
    merger.merge(str(adapter))  # and the next attempt works
    assert merger.merged == str(adapter)
    merger.unmerge()
    assert_same(model.weights, original, original)


def test_failed_merge_while_another_is_merged_leaves_the_base(base_dir, tmp_path):
    good = write_adapter(tmp_path / "good", ["q_proj"])
    merger, model, original = make(base_dir)
    merger.merge(str(good))
    with pytest.raises(MergeError):
        merger.merge(str(tmp_path / "missing"))
    assert merger.merged is None
    assert_same(model.weights, original, original)


class FakeKernels:
    """`KernelStates` over FakeModel: a module's state is the tensor objects it computes with."""

    def __init__(self, model: FakeModel, usable: bool = True):
        self.model, self.usable, self.applied = model, usable, 0

    def capture(self, modules):
        if not self.usable:
            return None
        return {m: {n: t for n, t in self.model.weights.items() if fused_module(n, LLAMA_PACKED) == m} for m in modules}

    def apply(self, states):
        for tensors in states.values():
            self.model.weights.update(tensors)
        self.applied += 1


def make_with_kernels(base_dir, cache_bytes=1 << 30, usable=True):
    ckpt = CheckpointTensors(base_dir)
    model = FakeModel(ckpt)
    original = dict(model.weights)
    kernels = FakeKernels(model, usable)
    return WeightMerger(ckpt, model.reload, LLAMA_PACKED, torch.float32, kernels, cache_bytes), model, original


def test_kernel_swaps_unmerge_exactly_and_remerge_without_reloading(base_dir, tmp_path):
    a = write_adapter(tmp_path / "a", ["q_proj", "o_proj"], seed=1)
    b = write_adapter(tmp_path / "b", ["v_proj"], seed=2)
    merger, model, original = make_with_kernels(base_dir)
    merger.merge(str(a))
    merged_a = dict(model.weights)
    assert merger.reloads == 1
    merger.unmerge()
    assert merger.reloads == 1  # swapped back, no reload
    assert all(model.weights[n] is original[n] for n in original)  # the very same objects
    merger.merge(str(a))
    assert merger.reloads == 1 and all(torch.equal(model.weights[n], merged_a[n]) for n in merged_a)
    merger.merge(str(b))  # a out by swap, b in by reload; both stay cached
    assert merger.reloads == 2 and merger.cached_adapters == [str(a), str(b)]
    for n, want in fp64_reference(base_dir, b).items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    merger.merge(str(a))  # b out, a in: both by swap
    assert merger.reloads == 2 and merger.cached_adapters == [str(b), str(a)]
    assert all(torch.equal(model.weights[n], merged_a[n]) for n in merged_a)
    merger.merge(str(b))
    assert merger.reloads == 2
    for n, want in fp64_reference(base_dir, b).items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    merger.unmerge()
    assert all(torch.equal(model.weights[n], original[n]) for n in original)


def merged_bytes(base_dir, adapter) -> int:
    """What the merger counts for one cached adapter: every shard of the fused modules it touches."""
    merger, model, _ = make_with_kernels(base_dir)
    merger.merge(str(adapter))
    return merger._cached[next(iter(merger._cached))][2]


def test_cache_keeps_the_most_recently_merged_adapters_within_its_budget(base_dir, tmp_path):
    a, b, c = (write_adapter(tmp_path / n, ["q_proj"], seed=i) for i, n in enumerate("abc"))
    one = merged_bytes(base_dir, a)
    merger, model, original = make_with_kernels(base_dir, cache_bytes=2 * one)  # room for two
    for adapter in (a, b, a, c):  # a is used again, so b is the least recently merged
        merger.merge(str(adapter))
    assert merger.cached_adapters == [str(a), str(c)] and merger.reloads == 3
    merger.merge(str(b))  # evicted: a reload, which evicts a
    assert merger.reloads == 4 and merger.cached_adapters == [str(c), str(b)]
    for n, want in fp64_reference(base_dir, b).items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    merger.unmerge()
    assert all(torch.equal(model.weights[n], original[n]) for n in original)


def test_prepare_caches_the_merge_and_leaves_the_base_in_place(base_dir, tmp_path):
    a, b, c = (write_adapter(tmp_path / n, ["q_proj", "v_proj"], seed=i) for i, n in enumerate("abc"))
    one = merged_bytes(base_dir, a)
    merger, model, original = make_with_kernels(base_dir, cache_bytes=2 * one)
    assert merger.prepare(str(a)) and merger.merged is None
    assert all(model.weights[n] is original[n] for n in original)  # the very base objects
    reloads = merger.reloads
    merger.merge(str(a))  # a swap now
    assert merger.reloads == reloads
    for n, want in fp64_reference(base_dir, a).items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    assert not merger.prepare(str(b))  # something is merged: the weights must stay
    merger.unmerge()
    assert merger.prepare(str(a)) and merger.prepare(str(b))  # a: already cached
    assert not merger.prepare(str(c))  # no room left: a prepare never evicts
    assert merger.cached_adapters == [str(a), str(b)]
    with pytest.raises(MergeError):
        merger.prepare(str(tmp_path / "missing"))
    assert merger.merged is None and all(torch.equal(model.weights[n], original[n]) for n in original)
    assert not make_with_kernels(base_dir, usable=False)[0].prepare(str(a))  # nothing to cache


def test_rewritten_adapter_or_no_budget_means_a_fresh_merge(base_dir, tmp_path):
    a = write_adapter(tmp_path / "a", ["q_proj"], seed=1)
    merger, model, _ = make_with_kernels(base_dir)
    merger.merge(str(a))
    merger.unmerge()
    shutil.rmtree(a)
    write_adapter(a, ["q_proj"], seed=7)  # same path, new weights
    merger.merge(str(a))
    assert merger.reloads == 2
    for n, want in fp64_reference(base_dir, a).items():
        assert torch.allclose(model.weights[n].double(), want, atol=1e-5), n
    shutil.rmtree(a)  # files gone: a cached state must not hide it
    merger.unmerge()
    with pytest.raises(MergeError):
        merger.merge(str(a))
    small, _, _ = make_with_kernels(base_dir, cache_bytes=0)
    b = write_adapter(tmp_path / "b", ["q_proj"], seed=1)
    small.merge(str(b))
    small.unmerge()
    small.merge(str(b))
    assert small.reloads == 2


def test_without_capturable_kernels_every_switch_reloads(base_dir, tmp_path):
    a = write_adapter(tmp_path / "a", ["q_proj"], seed=1)
    merger, model, original = make_with_kernels(base_dir, usable=False)
    merger.merge(str(a))
    merger.unmerge()
    merger.merge(str(a))
    assert merger.reloads == 3
    merger.unmerge()
    assert all(torch.equal(model.weights[n], original[n]) for n in original)


def test_failed_reload_is_repaired_by_a_full_reload_even_with_kernels(base_dir, tmp_path):
    a = write_adapter(tmp_path / "a", ["q_proj", "k_proj"], seed=1)
    ckpt = CheckpointTensors(base_dir)
    model = FakeModel(ckpt, fail_after=2)
    original = dict(model.weights)
    merger = WeightMerger(ckpt, model.reload, LLAMA_PACKED, torch.float32, FakeKernels(model), 1 << 30)
    with pytest.raises(MergeError, match="base restored"):
        merger.merge(str(a))
    assert merger.merged is None and len(model.reloads) == 1  # the repair reload
    assert all(torch.equal(model.weights[n], original[n]) for n in original)


def test_the_heap_a_reload_freed_is_given_back_and_a_swap_does_not_trim(base_dir, tmp_path, monkeypatch):
    from dlora.engine_ext import freed_heap, merge

    assert freed_heap.release_freed_heap()  # glibc: malloc_trim is there
    trims: list[int] = []
    monkeypatch.setattr(merge, "release_freed_heap", lambda: trims.append(1) or True)
    a = write_adapter(tmp_path / "a", ["q_proj"], seed=1)
    merger, _, _ = make_with_kernels(base_dir)
    merger.merge(str(a))  # a reload
    assert merger.reloads == 1 and trims == [1]
    merger.unmerge()
    merger.merge(str(a))  # a cached swap: nothing freed, no trim
    assert merger.reloads == 1 and trims == [1]
