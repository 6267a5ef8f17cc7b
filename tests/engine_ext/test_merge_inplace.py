"""The in-place merge strategy of `WeightMerger` (`LiveWeights` + `merge_lora_inplace`), no engine.

A small module tree mimics vLLM's layout at tensor parallel size 1: q/k/v fused into `qkv_proj`
(GQA: k and v have fewer rows than q, and v differs from k here so a k/v mix-up cannot pass),
gate/up fused into `gate_up_proj`, attention layers wrapped like vLLM's LoRA layers
(`base_layer`). Merges are checked against fp64 W + s·B@A; every unmerge, after any sequence of
merges and failed merges, must give back the original bits. The last tests run the same on
vLLM's own linear layers, including the CPU prepacking that makes a merge take the reload path.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from dlora.engine_ext import merge as merge_mod
from dlora.engine_ext.adapter_factors import MergeError, read_adapter
from dlora.engine_ext.checkpoint_tensors import CheckpointTensors
from dlora.engine_ext.live_weights import ParameterViews
from dlora.engine_ext.merge import WeightMerger
from tests.engine_ext.lora_files import PARENT, write_peft_adapter

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
HIDDEN = 32
SHAPES = {
    "q_proj": (32, HIDDEN),
    "k_proj": (8, HIDDEN),
    "v_proj": (12, HIDDEN),
    "o_proj": (HIDDEN, 32),
    "gate_proj": (40, HIDDEN),
    "up_proj": (40, HIDDEN),
    "down_proj": (HIDDEN, 40),
}
# Fused parameter -> its shards in row order (how QKVParallelLinear / MergedColumnParallelLinear stack them).
FUSED = {
    "self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "self_attn.o_proj": ["o_proj"],
    "mlp.gate_up_proj": ["gate_proj", "up_proj"],
    "mlp.down_proj": ["down_proj"],
}
LAYERS = 2
ALL = list(SHAPES)


def name(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{PARENT[module]}.{module}.weight"


@pytest.fixture
def base_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(64, HIDDEN, generator=g)}
    for layer in range(LAYERS):
        for module, shape in SHAPES.items():
            tensors[name(layer, module)] = torch.randn(*shape, generator=g)
    d = tmp_path / "base"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    return d


def write_adapter(d, modules, rank=4, alpha=8, seed=1, layers=range(LAYERS)):
    return write_peft_adapter(d, modules, SHAPES, name, layers, rank, alpha, seed)


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, output_sizes: list[int] | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        if output_sizes is not None:
            self.output_sizes = output_sizes
        self.tp_size = 1


class LoRAWrapper(nn.Module):
    """Like vLLM's BaseLayerWithLoRA: the real layer is `base_layer`."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base_layer = base


class FakeVllmModel(nn.Module):
    """`model.layers.{i}.self_attn.{qkv_proj,o_proj}` and `.mlp.{gate_up_proj,down_proj}`, loaded from the
    checkpoint in `dtype`; the attention layers wrapped for LoRA. `reload` writes checkpoint tensors into
    the fused rows (what vLLM's loader does) and records them; a prepacked layer has an empty weight."""

    def __init__(self, checkpoint: CheckpointTensors, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        self.reloads: list[list[str]] = []
        for layer in range(LAYERS):
            block = nn.Module()
            block.self_attn, block.mlp = nn.Module(), nn.Module()
            for path, parts in FUSED.items():
                shards = [checkpoint.get([name(layer, p)])[name(layer, p)] for p in parts]
                sizes = [t.shape[0] for t in shards] if len(parts) > 1 else None
                lin = Linear(torch.cat(shards).to(dtype), sizes)
                parent, leaf = path.split(".")
                setattr(getattr(block, parent), leaf, LoRAWrapper(lin) if parent == "self_attn" else lin)
            self.model.layers.append(block)

    def linear(self, layer: int, path: str) -> Linear:
        m = self.get_submodule(f"model.layers.{layer}.{path}")
        return getattr(m, "base_layer", m)

    def rows(self, ckpt_name: str) -> torch.Tensor:
        """The live rows of one checkpoint weight, located independently of `ParameterViews`
        (in the packed copy for a prepacked layer)."""
        _, _, layer, parent, module, _ = ckpt_name.split(".")
        path, parts = next((p, parts) for p, parts in FUSED.items() if p.startswith(parent + ".") and module in parts)
        lin = self.linear(int(layer), path)
        w = lin.weight.data if lin.weight.numel() else lin.cpu_linear
        start = sum(SHAPES[p][0] for p in parts[: parts.index(module)])
        return w[start : start + SHAPES[module][0]]

    def reload(self, items):
        names = []
        for n, t in items:
            self.rows(n).copy_(t.to(self.dtype))
            names.append(n)
        self.reloads.append(names)

    def prepack(self, layer: int, path: str) -> None:
        """What vLLM's CPU GEMM dispatch does: the weight goes into a kernel closure, `weight` is emptied."""
        lin = self.linear(layer, path)
        lin.cpu_linear = lin.weight.data.clone()
        lin.weight = nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bits_equal(model: nn.Module, original: dict[str, torch.Tensor]) -> None:
    live = dict(model.named_parameters())
    assert live.keys() == original.keys()
    for n, want in original.items():
        got = live[n].detach()
        assert got.dtype == want.dtype and got.shape == want.shape, n
        ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
        assert torch.equal(got.contiguous().view(ints), want.contiguous().view(ints)), n


def make(base_dir, dtype=torch.float32, usable=lambda layer: True):
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, dtype)
    merger = WeightMerger(ckpt, model.reload, LLAMA_PACKED, dtype, live=ParameterViews(model, LLAMA_PACKED, usable))
    return merger, model, snapshot(model)


def reference(original_rows: dict[str, torch.Tensor], adapter_dir) -> dict[str, torch.Tensor]:
    """fp64 W + (alpha/r)·B@A, W = the live base weight before the merge."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    return {
        n: original_rows[n].double() + scale * (b.double() @ a.double())
        for n, (a, b) in read_adapter(adapter_dir).factors.items()
    }


def all_rows(model: FakeVllmModel) -> dict[str, torch.Tensor]:
    return {name(layer, m): model.rows(name(layer, m)).clone() for layer in range(LAYERS) for m in SHAPES}


# ---- layout ------------------------------------------------------------------------------------------


def test_views_are_the_fused_rows_of_each_shard(base_dir):
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, torch.float32)
    names = [name(layer, m) for layer in range(LAYERS) for m in SHAPES]
    views = ParameterViews(model, LLAMA_PACKED).views(names)
    for n in names:
        assert torch.equal(views[n], ckpt.get([n])[n]), n
        assert views[n].shape == ckpt.shape(n)
        assert views[n].data_ptr() == model.rows(n).data_ptr()  # the same storage, not a copy
    qkv = model.linear(0, "self_attn.qkv_proj").weight
    views[name(0, "v_proj")].fill_(7.0)
    assert (qkv[-SHAPES["v_proj"][0] :] == 7.0).all() and not (qkv[: -SHAPES["v_proj"][0]] == 7.0).any()


def test_views_refuse_what_is_not_a_plain_tensor(base_dir):
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, torch.float32)
    views = ParameterViews(model, LLAMA_PACKED)
    assert views.views([name(0, "q_proj"), name(1, "up_proj")]) is not None
    assert views.views(["model.layers.9.self_attn.q_proj.weight"]) is None  # no such module
    assert ParameterViews(model, LLAMA_PACKED, usable=lambda layer: False).views([name(0, "o_proj")]) is None
    model.linear(1, "mlp.gate_up_proj").output_sizes = [40]  # a layout it does not understand
    assert views.views([name(1, "up_proj")]) is None
    model.linear(0, "mlp.down_proj").tp_size = 2
    assert views.views([name(0, "down_proj")]) is None
    model.prepack(0, "self_attn.qkv_proj")
    assert views.views([name(0, "k_proj")]) is None
    assert views.views([name(1, "k_proj")]) is not None


# ---- merge math and exact unmerge ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("modules", [ALL, ["k_proj", "up_proj", "o_proj"]], ids=["all", "some"])
def test_inplace_merge_equals_fp64_and_unmerge_restores_bits(base_dir, tmp_path, dtype, modules):
    adapter = write_adapter(tmp_path / "ad", modules)
    merger, model, original = make(base_dir, dtype)
    before = all_rows(model)
    merger.merge(str(adapter))
    assert merger.strategy == "inplace" and merger.inplace_merges == 1
    assert model.reloads == [] and merger.reloads == 0
    ref = reference(before, adapter)
    # One rounding of the fp32 sum to the model dtype (bf16: half an ulp = 2^-9 relative).
    rtol, atol = (2**-8, 1e-6) if dtype == torch.bfloat16 else (1e-6, 1e-5)
    after = all_rows(model)
    for n, got in after.items():
        if n in ref:
            assert got.dtype == dtype
            assert torch.allclose(got.double(), ref[n], rtol=rtol, atol=atol), n
        else:  # untouched shards of touched fused layers and untouched layers keep their bits
            assert torch.equal(got, before[n]), n
    merger.unmerge()
    assert merger.merged is None and merger.strategy is None
    assert_bits_equal(model, original)
    assert model.reloads == []


def test_merge_x_then_y_then_unmerge_never_accumulates(base_dir, tmp_path):
    x = write_adapter(tmp_path / "x", ["q_proj", "v_proj", "gate_proj"], seed=1)
    y = write_adapter(tmp_path / "y", ["k_proj", "v_proj", "down_proj"], seed=2, rank=8, alpha=4)
    merger, model, original = make(base_dir, torch.bfloat16)
    before = all_rows(model)
    for _ in range(3):
        merger.merge(str(x))
        merger.merge(str(y))  # unmerges x first
    ref = reference(before, y)
    for n, got in all_rows(model).items():
        if n in ref:
            assert torch.allclose(got.double(), ref[n], rtol=2**-8, atol=1e-6), n
        else:  # x's q_proj and gate_proj are gone exactly
            assert torch.equal(got, before[n]), n
    merger.unmerge()
    assert_bits_equal(model, original)
    merger.unmerge()  # no-op
    assert_bits_equal(model, original)
    for adapter in (x, x, y, x, y, y):  # repeated merges of one adapter, and switches
        merger.merge(str(adapter))
    merger.unmerge()
    assert_bits_equal(model, original)
    assert merger.inplace_merges == 12 and model.reloads == []


def test_bf16_cycles_do_not_drift(base_dir, tmp_path):
    """What a subtract-to-unmerge would get wrong in bf16: 50 merge/unmerge cycles, still the same bits."""
    x = write_adapter(tmp_path / "x", ALL, seed=3)
    merger, model, original = make(base_dir, torch.bfloat16)
    for _ in range(50):
        merger.merge(str(x))
        merger.unmerge()
    assert_bits_equal(model, original)


# ---- failures ----------------------------------------------------------------------------------------


def failing_on_call(monkeypatch, fail_at: int):
    """Replace the kernel: call number `fail_at` scribbles over half of W, then raises."""
    real = merge_mod.merge_lora_inplace
    calls = {"n": 0}

    def kernel(w, a, b, scale, sign=1, **kw):
        calls["n"] += 1
        if calls["n"] == fail_at:
            w[: w.shape[0] // 2] = float("nan")
            raise RuntimeError("simulated kernel failure")
        real(w, a, b, scale, sign, **kw)

    monkeypatch.setattr(merge_mod, "merge_lora_inplace", kernel)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_failure_on_the_second_module_leaves_the_base(base_dir, tmp_path, monkeypatch, dtype):
    adapter = write_adapter(tmp_path / "ad", ["q_proj", "k_proj", "v_proj", "o_proj"])
    merger, model, original = make(base_dir, dtype)
    calls = failing_on_call(monkeypatch, fail_at=2)
    with pytest.raises(MergeError, match="base restored"):
        merger.merge(str(adapter))
    assert calls["n"] == 2  # it did fail midway, after one module was merged
    assert merger.merged is None and merger.strategy is None
    assert_bits_equal(model, original)
    merger.merge(str(adapter))  # the next attempt works
    assert merger.merged == str(adapter) and merger.inplace_merges == 1
    merger.unmerge()
    assert_bits_equal(model, original)
    assert model.reloads == []


def test_failure_while_another_adapter_is_merged_leaves_the_base(base_dir, tmp_path, monkeypatch):
    x = write_adapter(tmp_path / "x", ["q_proj", "o_proj"], seed=1)
    y = write_adapter(tmp_path / "y", ["v_proj", "gate_proj", "up_proj"], seed=2)
    merger, model, original = make(base_dir, torch.bfloat16)
    merger.merge(str(x))
    calls = failing_on_call(monkeypatch, fail_at=3)  # y's third module (x is unmerged by copies)
    with pytest.raises(MergeError, match="base restored"):
        merger.merge(str(y))
    assert calls["n"] == 3 and merger.merged is None
    assert_bits_equal(model, original)


def test_bad_adapter_fails_before_touching_the_weights(base_dir, tmp_path, monkeypatch):
    adapter = write_adapter(tmp_path / "ad", ["q_proj"])
    key = "base_model.model." + name(0, "k_proj").removesuffix(".weight")
    save_file(
        {f"{key}.lora_A.weight": torch.ones(4, HIDDEN), f"{key}.lora_B.weight": torch.ones(7, 4)},
        str(adapter / "adapter_model.safetensors"),
    )  # B has 7 rows, k_proj 8
    merger, model, original = make(base_dir)
    calls = failing_on_call(monkeypatch, fail_at=0)
    with pytest.raises(MergeError, match="k_proj"):
        merger.merge(str(adapter))
    assert calls["n"] == 0 and merger.merged is None
    assert_bits_equal(model, original)


# ---- choosing the strategy -----------------------------------------------------------------------------


def test_a_prepacked_target_sends_the_merge_through_the_reload(base_dir, tmp_path):
    """As on vLLM CPU: a merge touching a prepacked layer goes through the engine's reload (today's
    path); a merge touching only plain layers of the same engine goes in place."""
    attn = write_adapter(tmp_path / "attn", ["q_proj", "o_proj"], seed=1)
    mlp = write_adapter(tmp_path / "mlp", ["gate_proj", "down_proj"], seed=2)
    merger, model, _ = make(base_dir)
    model.prepack(1, "self_attn.qkv_proj")
    merger.merge(str(attn))
    assert merger.strategy == "reload" and merger.reloads == 1 and merger.inplace_merges == 0
    # Whole fused modules, as before: k/v go with q.
    assert name(0, "k_proj") in model.reloads[-1] and name(1, "k_proj") in model.reloads[-1]
    merger.merge(str(mlp))  # attn out by reload, mlp in place
    assert merger.strategy == "inplace" and merger.reloads == 2 and merger.inplace_merges == 1
    merger.unmerge()
    assert merger.reloads == 2


def test_reload_fallback_then_inplace_restores_bits(base_dir, tmp_path):
    """The two strategies in one engine: a layer the engine says it cannot edit in place
    (`usable`) sends the merge through reload, the others go in place; unmerges are exact."""
    x = write_adapter(tmp_path / "x", ["v_proj", "down_proj"], seed=1)
    y = write_adapter(tmp_path / "y", ["up_proj"], seed=2)
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, torch.float32)
    original = snapshot(model)
    no_attn = ParameterViews(model, LLAMA_PACKED, usable=lambda layer: layer.weight.shape[0] != 52)
    merger = WeightMerger(ckpt, model.reload, LLAMA_PACKED, torch.float32, live=no_attn)
    before = all_rows(model)
    merger.merge(str(x))
    assert merger.strategy == "reload"
    for n, want in reference(before, x).items():
        assert torch.allclose(model.rows(n).double(), want, rtol=1e-6, atol=1e-5), n
    merger.merge(str(y))
    assert merger.strategy == "inplace"
    merger.merge(str(x))
    merger.unmerge()
    assert_bits_equal(model, original)


def test_without_live_weights_nothing_changes(base_dir, tmp_path):
    x = write_adapter(tmp_path / "x", ["q_proj"], seed=1)
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, torch.float32)
    merger = WeightMerger(ckpt, model.reload, LLAMA_PACKED, torch.float32)
    merger.merge(str(x))
    assert merger.strategy == "reload" and merger.reloads == 1 and merger.inplace_merges == 0


# ---- vLLM's own layers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_tp1():
    """vLLM's linear layers need its (single-rank) tensor-parallel group."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        owned = not ps.model_parallel_is_initialized()
        if owned:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            ps.init_distributed_environment(
                world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
            )
            ps.initialize_model_parallel(1, 1)
        yield
        if owned:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


def vllm_model(ckpt: CheckpointTensors, plain: bool):
    """Layer 0 of the checkpoint in vLLM's QKVParallelLinear (GQA, v_head_size != head_size),
    MergedColumnParallelLinear and RowParallelLinear, loaded through their weight loaders, then
    post-processed as on CPU: prepacked (vLLM's default), or kept plain (`plain`)."""
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    dt = torch.float32
    layers = {
        "self_attn.qkv_proj": QKVParallelLinear(HIDDEN, 4, 8, 2, bias=False, params_dtype=dt, v_head_size=6),
        "self_attn.o_proj": RowParallelLinear(32, HIDDEN, bias=False, params_dtype=dt),
        "mlp.gate_up_proj": MergedColumnParallelLinear(HIDDEN, [40, 40], bias=False, params_dtype=dt),
        "mlp.down_proj": RowParallelLinear(40, HIDDEN, bias=False, params_dtype=dt),
    }
    shard_ids = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1}
    root = nn.Module()
    root.model = nn.Module()
    root.model.layers = nn.ModuleList([nn.Module()])
    block = root.model.layers[0]
    block.self_attn, block.mlp = nn.Module(), nn.Module()
    for path, layer in layers.items():
        for part in FUSED[path]:
            t = ckpt.get([name(0, part)])[name(0, part)]
            if part in shard_ids:
                layer.weight.weight_loader(layer.weight, t, shard_ids[part])
            else:
                layer.weight.weight_loader(layer.weight, t)
        layer._cpu_skip_gemm_dispatch = plain  # vLLM's own switch for "F.linear on layer.weight"
        layer.quant_method.process_weights_after_loading(layer)
        parent, leaf = path.split(".")
        setattr(getattr(block, parent), leaf, layer)
    return root, layers


def test_vllm_layers_plain_merge_in_place_and_compute_with_it(base_dir, tmp_path, vllm_tp1):
    from dlora.engine_ext.worker import plain_linear

    ckpt = CheckpointTensors(base_dir)
    root, layers = vllm_model(ckpt, plain=True)
    qkv = layers["self_attn.qkv_proj"]
    assert qkv.output_sizes == [32, 8, 12]
    views = ParameterViews(root, LLAMA_PACKED, plain_linear)
    names = [name(0, m) for m in SHAPES]
    got = views.views(names)
    assert got is not None
    for n in names:  # vLLM put each shard where ParameterViews looks for it
        assert torch.equal(got[n], ckpt.get([n])[n]), n

    adapter = write_adapter(tmp_path / "ad", ALL, layers=[0])
    factors = read_adapter(adapter).factors

    def no_reload(items):
        raise AssertionError("plain layers must merge in place")

    merger = WeightMerger(ckpt, no_reload, LLAMA_PACKED, torch.float32, live=views)
    original = snapshot(root)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    y_base = qkv.quant_method.apply(qkv, x)
    merger.merge(str(adapter))
    assert merger.strategy == "inplace"
    scale = 8 / 4
    w_ref = torch.cat(
        [
            ckpt.get([name(0, p)])[name(0, p)].double()
            + scale * factors[name(0, p)][1].double() @ factors[name(0, p)][0].double()
            for p in ("q_proj", "k_proj", "v_proj")
        ]
    )
    y = qkv.quant_method.apply(qkv, x)  # vLLM's own forward of the layer sees the merged weight
    assert torch.allclose(y.double(), x.double() @ w_ref.T, rtol=1e-5, atol=1e-4)
    merger.unmerge()
    assert_bits_equal(root, original)
    assert torch.equal(qkv.quant_method.apply(qkv, x), y_base)


def test_vllm_layers_prepacked_on_cpu_take_the_reload_path(base_dir, vllm_tp1):
    from dlora.engine_ext.worker import plain_linear

    ckpt = CheckpointTensors(base_dir)
    root, layers = vllm_model(ckpt, plain=False)
    views = ParameterViews(root, LLAMA_PACKED, plain_linear)
    for path, layer in layers.items():
        n = name(0, FUSED[path][0])
        if layer.weight.numel() == 0:  # prepacked into `cpu_linear` (oneDNN / AMX kernels)
            assert views.views([n]) is None, path
        else:  # vLLM fell back to F.linear on layer.weight: in place is right there
            assert views.views([n]) is not None, path
