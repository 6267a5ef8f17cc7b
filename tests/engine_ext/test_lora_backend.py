"""The dlora LoRA backends behind vLLM's punica-wrapper seam, without an engine.

`PunicaWrapperEinsum.add_lora_linear` must equal vLLM's `PunicaWrapperCPU` (with dlora's -1 fix)
and an fp64 loop on vLLM's padded stacked layout, for prefill (segmented) and decode (per-token)
metadata, mixed slots and -1 tokens; with a merged slot (mixed merged steps) it must turn the
merged weights' output into the unmerged one for every other token and leave the merged adapter's
tokens alone; `lora_backend.install` must switch the class vLLM's selector builds and give the
platform back its own method afterwards.
"""

from __future__ import annotations

import pytest
import torch

from dlora import env
from dlora.config import DloraConfig, EngineConfig
from dlora.engine_ext import cpu_lora_fix, lora_backend, punica_wrapper
from dlora.engine_ext.onednn_gemm import OneDnnGemm
from dlora.engine_ext.punica_wrapper import DloraLinearMixin, PunicaWrapperEinsum

SLOTS, R, H_IN = 3, 8, 16
SLICES = (12, 4, 4)  # a QKV-like layer: three stacked (A, B) pairs, one output row
IDS = [11, 12, 13]  # lora id in each slot
RANKS = [8, 4, 8]  # real ranks, zero-padded to R like vLLM's set_lora does
PREFILL = (11, 11, 11, 0, 0, 13, 13, 12, 0, 11)  # vLLM lora ids per token, 0 = base model
DECODE = (13, 0, 11, 12, 0, 13)
CASES = [pytest.param(PREFILL, True, id="prefill"), pytest.param(DECODE, False, id="decode")]


def stacks(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = tuple(torch.zeros(SLOTS, 1, R, H_IN, dtype=dtype) for _ in SLICES)
    b = tuple(torch.zeros(SLOTS, 1, s, R, dtype=dtype) for s in SLICES)
    for i, size in enumerate(SLICES):
        for n, r in enumerate(RANKS):
            a[i][n, 0, :r] = torch.randn(r, H_IN, generator=g, dtype=dtype)
            b[i][n, 0, :, :r] = torch.randn(size, r, generator=g, dtype=dtype)
    return a, b


def slot_of(mapping) -> list[int]:
    return [IDS.index(m) if m > 0 else -1 for m in mapping]


def reference(y0, x, a, b, mapping, scale):
    """fp64 loop: y[t, slice i] += scale * B_i[n] @ A_i[n] @ x[t] for tokens with slot n >= 0."""
    y = y0.double().clone()
    for t, n in enumerate(slot_of(mapping)):
        if n < 0:
            continue
        off = 0
        for i, size in enumerate(SLICES):
            y[t, off : off + size] += scale * (b[i][n, 0].double() @ (a[i][n, 0].double() @ x[t].double()))
            off += size
    return y


def wrapper(cls, mapping, is_prefill):
    from vllm.lora.layers import LoRAMapping

    w = cls(64, 8, "cpu")
    w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=is_prefill), list(IDS), SLOTS, 100)
    return w


def inputs(t, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, H_IN, generator=g), torch.randn(t, sum(SLICES), generator=g)


def run(cls, mapping, is_prefill, a, b, scale=0.5, **kwargs):
    x, y0 = inputs(len(mapping))
    y = y0.clone()
    wrapper(cls, mapping, is_prefill).add_lora_linear(y, x, a, b, scale, SLICES, **kwargs)
    return x, y0, y


@pytest.mark.parametrize("mapping,is_prefill", CASES)
def test_einsum_wrapper_equals_vllm_cpu_and_fp64(mapping, is_prefill):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    cpu_lora_fix.install()  # vLLM's CPU ops are only right for -1 tokens with dlora's fix
    a, b = stacks()
    x, y0, ours = run(PunicaWrapperEinsum, mapping, is_prefill, a, b)
    _, _, theirs = run(PunicaWrapperCPU, mapping, is_prefill, a, b)
    want = reference(y0, x, a, b, mapping, 0.5)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs.double(), want, rtol=1e-5, atol=1e-5)
    base = torch.tensor(slot_of(mapping)) < 0
    assert torch.equal(ours[base], y0[base])  # -1 rows: not a bit changed
    assert not torch.equal(ours[~base], y0[~base])


@pytest.mark.parametrize("mapping,is_prefill", CASES)
def test_meta_is_segmented_for_runs_and_per_token_otherwise(mapping, is_prefill):
    w = wrapper(PunicaWrapperEinsum, mapping, is_prefill)
    own = w._dlora_pass
    meta = own.meta
    assert own.compensate is None
    assert meta.is_segmented == is_prefill  # PREFILL has runs of one adapter, DECODE has none
    assert meta.token_indices.tolist() == slot_of(mapping)


def test_a_batch_without_adapters_is_left_alone():
    a, b = stacks()
    _, y0, y = run(PunicaWrapperEinsum, (0, 0, 0, 0), True, a, b)
    assert torch.equal(y, y0)


def test_add_inputs_false_writes_the_delta():
    a, b = stacks()
    x, y0, y = run(PunicaWrapperEinsum, DECODE, False, a, b, add_inputs=False)
    want = reference(torch.zeros_like(y0), x, a, b, DECODE, 0.5)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_padding_rows_beyond_the_mapping_get_no_adapter():
    a, b = stacks()
    x, y0 = inputs(len(DECODE) + 3)
    y = y0.clone()
    wrapper(PunicaWrapperEinsum, DECODE, False).add_lora_linear(y, x, a, b, 1.0, SLICES)
    assert torch.equal(y[len(DECODE) :], y0[len(DECODE) :])
    want = reference(y0[: len(DECODE)], x[: len(DECODE)], a, b, DECODE, 1.0)
    torch.testing.assert_close(y[: len(DECODE)].double(), want, rtol=1e-5, atol=1e-5)


def test_transposed_b_is_cached_and_follows_in_place_updates():
    a, b = stacks()
    w = wrapper(PunicaWrapperEinsum, PREFILL, True)
    assert w._dlora_packed(a[0], b[0]) is w._dlora_packed(a[0], b[0])  # no re-pack per layer call
    x, y0 = inputs(len(PREFILL))
    w.add_lora_linear(y0.clone(), x, a, b, 1.0, SLICES)
    # what vLLM's set_lora does: overwrite a slot through a view, which bumps the version counter
    new_a, new_b = stacks(seed=7)
    for i in range(len(SLICES)):
        a[i][2, 0].copy_(new_a[i][2, 0])
        b[i][2, 0, :, :4].copy_(new_b[i][2, 0, :, :4])
        b[i][2, 0, :, 4:] = 0
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, 1.0, SLICES)
    torch.testing.assert_close(y.double(), reference(y0, x, a, b, PREFILL, 1.0), rtol=1e-5, atol=1e-5)


def test_inference_tensors_are_repacked_instead_of_cached():
    with torch.inference_mode():
        a, b = stacks()
        x, y0, y = run(PunicaWrapperEinsum, PREFILL, True, a, b)
    torch.testing.assert_close(y.double(), reference(y0, x, a, b, PREFILL, 0.5), rtol=1e-5, atol=1e-5)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The Triton wrapper's linear path (the mixin with backend "triton") under Triton's CPU
    interpreter. Its vLLM parent, PunicaWrapperGPU, needs CUDA, so the mixin sits on the CPU
    wrapper here; the override code is the same."""
    pytest.importorskip("triton")
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from tests.kernels.kernels_testlib import TRITON_INTERPRETED

    assert TRITON_INTERPRETED
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    class TritonOnCPU(DloraLinearMixin, PunicaWrapperCPU):
        kernel_backend = "triton"

    return TritonOnCPU


@pytest.mark.parametrize("mapping,is_prefill", CASES)
def test_triton_kernels_behind_the_same_override(mapping, is_prefill, triton_on_cpu):
    a, b = stacks()
    x, y0, y = run(triton_on_cpu, mapping, is_prefill, a, b)
    torch.testing.assert_close(y.double(), reference(y0, x, a, b, mapping, 0.5), rtol=1e-4, atol=1e-4)
    base = torch.tensor(slot_of(mapping)) < 0
    assert torch.equal(y[base], y0[base])


# ---- mixed merged steps: slot MERGED's adapter folded into W, the others compensated --------------

MERGED = 0  # slot of lora id 11 (X)
MIXED_PREFILL = (11, 11, 12, 12, 0, 0, 11, 13, 0, 11)  # X, another adapter, base, interleaved
MIXED_DECODE = (13, 11, 0, 12, 11, 0)
MIXED_CASES = [pytest.param(MIXED_PREFILL, True, id="prefill"), pytest.param(MIXED_DECODE, False, id="decode")]


def merged_step(cls, mapping, is_prefill, dtype, scale=0.5, seed=3):
    """W' = W + dX (rounded to `dtype`), y = W'x + the wrapper's delta with slot MERGED merged.
    Returns (x, W, y0 = W'x, y, stacks)."""
    a, b = stacks(dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(SLICES), H_IN, generator=g, dtype=torch.float64)
    dx = torch.cat([scale * (b[i][MERGED, 0].double() @ a[i][MERGED, 0].double()) for i in range(len(SLICES))])
    x = torch.randn(len(mapping), H_IN, generator=g).to(dtype)
    y0 = x @ (w + dx).to(dtype).t()
    w_ = wrapper(cls, mapping, is_prefill)
    w_.dlora_set_merged_slot(MERGED)  # after update_metadata, as the worker does
    y = y0.clone()
    w_.add_lora_linear(y, x, a, b, scale, SLICES)
    return x, w, y0, y, (a, b)


def check_mixed(x, w, y0, y, a, b, mapping, eps_factor):
    want = reference(x.double() @ w.t(), x, a, b, mapping, 0.5)  # fp64 W·x + dY_t·x
    merged = torch.tensor(slot_of(mapping)) == MERGED
    # W' = W + dX and the compensation each round in x's dtype at the size of those terms.
    size = float(want.abs().max() + (y0.double() - want)[~merged].abs().max())
    err = (y.double() - want)[~merged].abs().max()
    assert err <= eps_factor * torch.finfo(x.dtype).eps * size, (err, size)
    assert (y0.double() - want)[~merged].abs().max() > 10 * err  # uncompensated: off by dX·x
    assert torch.equal(y[merged], y0[merged])  # X's tokens: no LoRA term, not a bit changed


@pytest.mark.parametrize("dtype, eps_factor", [(torch.float32, 8), (torch.bfloat16, 4)])
@pytest.mark.parametrize("mapping,is_prefill", MIXED_CASES)
def test_mixed_step_gives_every_token_the_unmerged_result(mapping, is_prefill, dtype, eps_factor):
    x, w, y0, y, (a, b) = merged_step(PunicaWrapperEinsum, mapping, is_prefill, dtype)
    check_mixed(x, w, y0, y, a, b, mapping, eps_factor)


@pytest.mark.parametrize("mapping,is_prefill", MIXED_CASES)
def test_mixed_step_on_the_triton_kernels(mapping, is_prefill, triton_on_cpu):
    x, w, y0, y, (a, b) = merged_step(triton_on_cpu, mapping, is_prefill, torch.float32)
    check_mixed(x, w, y0, y, a, b, mapping, 8)


def test_mixed_step_rows_beyond_the_mapping_and_shorter_inputs():
    x, w, y0, y, (a, b) = merged_step(PunicaWrapperEinsum, MIXED_PREFILL, True, torch.float32)
    step = wrapper(PunicaWrapperEinsum, MIXED_PREFILL, True)
    step.dlora_set_merged_slot(MERGED)
    padding = torch.randn(3, sum(SLICES))
    padded = torch.cat([y0, padding])
    step.add_lora_linear(padded, torch.cat([x, torch.randn(3, H_IN)]), a, b, 0.5, SLICES)
    torch.testing.assert_close(padded[: len(x)], y, rtol=1e-5, atol=1e-4)
    assert torch.equal(padded[len(x) :], padding)  # no adapter, no compensation
    short = y0[:5].clone()  # the first 5 tokens: X X Y Y base
    step.add_lora_linear(short, x[:5], a, b, 0.5, SLICES)
    torch.testing.assert_close(short, y[:5], rtol=1e-5, atol=1e-4)


def test_mixed_step_of_merged_tokens_only_does_no_lora_work(monkeypatch):
    calls = []
    monkeypatch.setattr(punica_wrapper, "add_lora", lambda *args, **kw: calls.append(args))
    _, _, y0, y, _ = merged_step(PunicaWrapperEinsum, (11, 11, 11, 11), True, torch.float32)
    assert torch.equal(y, y0) and calls == []
    w = wrapper(PunicaWrapperEinsum, (11, 11, 11, 11), True)
    assert w._dlora_pass is not None  # unmerged, X's tokens apply X
    w.dlora_set_merged_slot(MERGED)
    assert w._dlora_pass is None
    w.dlora_set_merged_slot(None)  # unmerge: back to the normal pass
    assert w._dlora_pass is not None


def test_mixed_passes_skip_merged_tokens_and_compensate_the_rest():
    w = PunicaWrapperEinsum(64, 8, "cpu")
    w.dlora_set_merged_slot(MERGED)  # before the first mapping: kept for it
    from vllm.lora.layers import LoRAMapping

    w.update_metadata(LoRAMapping(MIXED_DECODE, MIXED_DECODE, is_prefill=False), list(IDS), SLOTS, 100)
    step = w._dlora_pass  # one call per slice, as unmerged: X's tokens none, base tokens -dX
    assert step.compensate == MERGED and step.meta.token_indices.tolist() == [2, -1, 0, 1, -1, 0]
    a, b = stacks()
    full, comp = w._dlora_packed(a[0], b[0]), w._dlora_packed(a[0], b[0], merged_slot=MERGED)
    rx = RANKS[MERGED]
    assert full.ranks == tuple(RANKS)  # each slot's live rows only (slot 1 is rank 4 padded to 8)
    assert comp.ranks == tuple(r if j == MERGED else r + rx for j, r in enumerate(RANKS))
    off, comp_off = full.rank_offsets.tolist(), comp.rank_offsets.tolist()
    x_rows = slice(off[MERGED], off[MERGED] + rx)
    for j in range(SLOTS):  # slot X: A_X / -B_X; others [A_j; A_X] / [B_j; -B_X]
        lo, own = comp_off[j], 0 if j == MERGED else RANKS[j]
        assert torch.equal(comp.a[lo : lo + own], full.a[off[j] : off[j] + own])
        assert torch.equal(comp.b[lo : lo + own], full.b[off[j] : off[j] + own])
        assert torch.equal(comp.a[lo + own : comp_off[j + 1]], full.a[x_rows])
        assert torch.equal(comp.b[lo + own : comp_off[j + 1]], -full.b[x_rows])
    assert w._dlora_packed(a[0], b[0], merged_slot=MERGED) is comp  # cached with the packed stacks


def test_einsum_makes_one_lora_call_per_layer_unmerged_and_mixed(monkeypatch):
    """On CPU a call's fixed cost dominates: the slices go in one call, and a mixed step's
    compensation rides in the same call."""
    calls = []
    monkeypatch.setattr(punica_wrapper, "add_lora", lambda y, x, lora, *a, **kw: calls.append((y.shape, lora.ranks)))
    a, b = stacks()
    run(PunicaWrapperEinsum, MIXED_PREFILL, True, a, b)
    k = len(SLICES)
    assert calls == [((len(MIXED_PREFILL), sum(SLICES)), tuple(k * r for r in RANKS))]
    calls.clear()
    merged_step(PunicaWrapperEinsum, MIXED_PREFILL, True, torch.float32)
    rx = RANKS[MERGED]
    assert calls == [
        ((len(MIXED_PREFILL), sum(SLICES)), tuple(k * (r if j == MERGED else r + rx) for j, r in enumerate(RANKS)))
    ]


def test_zero_rows_and_untargeted_layers_cost_nothing(monkeypatch):
    """vLLM pads every adapter to max_lora_rank and gives modules an adapter does not target
    all-zero stacks: only live rank rows reach the kernel, and a layer without any gets no call."""
    calls = []
    real_add_lora = punica_wrapper.add_lora
    monkeypatch.setattr(
        punica_wrapper,
        "add_lora",
        lambda y, x, lora, *a, **kw: (calls.append(lora.ranks), real_add_lora(y, x, lora, *a, **kw)),
    )
    a, b = stacks()
    a[1][2].zero_(), b[1][2].zero_()  # slot 2's adapter does not target slice 1 (k_proj, say)
    x, y0, y = run(PunicaWrapperEinsum, PREFILL, True, a, b)
    torch.testing.assert_close(y.double(), reference(y0, x, a, b, PREFILL, 0.5), rtol=1e-5, atol=1e-5)
    assert calls == [(3 * RANKS[0], 3 * RANKS[1], 2 * RANKS[2])]
    calls.clear()
    zeros = tuple(torch.zeros_like(t) for t in a), tuple(torch.zeros_like(t) for t in b)
    _, y0, y = run(PunicaWrapperEinsum, PREFILL, True, *zeros)
    assert torch.equal(y, y0) and calls == []


def onednn_has_kernels_for(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN builds a matmul for `dtype` (fp16 needs AVX512-FP16 or AMX-FP16;
    CI machines differ), asked of vLLM's op directly."""
    from vllm import _custom_ops as ops

    try:
        ops.create_onednn_mm(torch.zeros(16, 16, dtype=dtype), 32)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_einsum_on_cpu_runs_prepacked_onednn_gemms_where_onednn_has_them(dtype):
    onednn = dtype == torch.float32 or onednn_has_kernels_for(dtype)  # fp32: every x86 CPU
    a, b = stacks(dtype=dtype)
    w = wrapper(PunicaWrapperEinsum, DECODE, False)
    ((lora, lo, hi),) = w._dlora_calls(a, b, SLICES, None)
    assert (lo, hi) == (0, sum(SLICES))
    assert isinstance(lora.gemm, OneDnnGemm) == onednn
    x, y0 = (t.to(dtype) for t in inputs(len(DECODE)))
    y = y0.clone()
    w.add_lora_linear(y, x, a, b, 0.5, SLICES)
    want = reference(y0, x, a, b, DECODE, 0.5)
    torch.testing.assert_close(y.double(), want, rtol=0, atol=4 * torch.finfo(dtype).eps * float(want.abs().max()))


# ---- install / uninstall / checks ----------------------------------------------------------------


@pytest.fixture
def restore_platform():
    from vllm.platforms import current_platform

    before = current_platform.get_punica_wrapper()
    own = type(current_platform).__dict__.get("get_punica_wrapper")
    yield current_platform
    lora_backend.uninstall()
    assert current_platform.get_punica_wrapper() == before
    assert type(current_platform).__dict__.get("get_punica_wrapper") is own


def test_install_switches_the_class_vllms_selector_builds(restore_platform):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.lora.punica_wrapper.punica_selector import get_punica_wrapper

    platform = restore_platform
    own = type(platform).__dict__.get("get_punica_wrapper")
    assert lora_backend.install("einsum") is True
    assert lora_backend.install("einsum") is False  # idempotent
    assert lora_backend.installed() == "einsum"
    assert platform.get_punica_wrapper() == lora_backend.WRAPPERS["einsum"]
    assert type(get_punica_wrapper(64, 8, "cpu")) is PunicaWrapperEinsum

    assert lora_backend.install("vllm") is True  # `vllm` = vLLM's own wrapper again
    assert lora_backend.installed() == "vllm"
    assert type(platform).__dict__.get("get_punica_wrapper") is own
    assert type(get_punica_wrapper(64, 8, "cpu")) is PunicaWrapperCPU
    assert lora_backend.uninstall() is False


def test_triton_is_refused_on_cpu_even_with_the_interpreter(restore_platform, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(lora_backend.LoRABackendError, match="needs CUDA GPUs.*einsum"):
        lora_backend.install("triton")
    assert lora_backend.installed() == "vllm"
    with pytest.raises(lora_backend.LoRABackendError, match="unknown LoRA backend"):
        lora_backend.install("cuda")


def test_start_checks():
    lora_backend.check("vllm", gpu=False, enforce_eager=False)
    lora_backend.check("einsum", gpu=False, enforce_eager=True)
    lora_backend.check("triton", gpu=True, enforce_eager=True)
    with pytest.raises(lora_backend.LoRABackendError, match="needs CUDA GPUs"):
        lora_backend.check("triton", gpu=False, enforce_eager=True)
    with pytest.raises(lora_backend.LoRABackendError, match="enforce_eager"):
        lora_backend.check("einsum", gpu=False, enforce_eager=False)
    if not torch.cuda.is_available():  # `dlora serve`'s one-line pre-start error on this machine
        with pytest.raises(lora_backend.LoRABackendError, match="needs CUDA GPUs"):
            lora_backend.check_config(DloraConfig(engine=EngineConfig(lora_backend="triton")))


def test_the_choice_reaches_the_replica_env(monkeypatch):
    from dlora.replica.ray_replica import replica_runtime_env

    cfg = DloraConfig(engine=EngineConfig(lora_backend="einsum"))
    assert replica_runtime_env(cfg)["env_vars"]["DLORA_LORA_BACKEND"] == "einsum"
    monkeypatch.setenv("DLORA_LORA_BACKEND", "einsum")
    assert env.DLORA_LORA_BACKEND.get() == "einsum"
    monkeypatch.setenv("DLORA_LORA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DLORA_LORA_BACKEND"):
        env.DLORA_LORA_BACKEND.get()
    monkeypatch.delenv("DLORA_LORA_BACKEND")
    assert env.DLORA_LORA_BACKEND.get() == "vllm"


def test_a_new_adapter_in_one_slot_rereads_that_slot_only():
    # What vLLM does when it activates an adapter: writes it into a slot's stacks (bumping their
    # version) and maps the slot to the new id. The other slots' packed rows are kept as they were
    # (the same tensors), the changed slot's are read again, and the result is still exact.
    from vllm.lora.layers import LoRAMapping

    a, b = stacks()
    w = wrapper(PunicaWrapperEinsum, PREFILL, True)
    first = w.__dict__.setdefault("_dlora_pack_cache", {})
    w._dlora_packed(a[0], b[0])
    (before,) = first.values()
    new_a, new_b = stacks(seed=7)
    a[0][1, 0].copy_(new_a[0][1, 0])
    b[0][1, 0].copy_(new_b[0][1, 0])
    ids = [11, 99, 13]  # slot 1 now holds adapter 99
    w.update_metadata(LoRAMapping([99] * 3, [99] * 3, is_prefill=True), ids, SLOTS, 100)
    packed = w._dlora_packed(a[0], b[0])
    (after,) = first.values()  # one entry per stack: replaced, not added
    assert after.slots[0] is before.slots[0] and after.slots[2] is before.slots[2]
    assert after.slots[1] is not before.slots[1] and after.slots[1].lora_id == 99
    assert packed.ranks == tuple(RANKS)
    lo, hi = RANKS[0], RANKS[0] + RANKS[1]
    torch.testing.assert_close(packed.a[lo:hi], new_a[0][1, 0, : RANKS[1]])
    torch.testing.assert_close(packed.b[lo:hi], new_b[0][1, 0, :, : RANKS[1]].t())


def test_lm_head_lora_is_skipped_unless_an_adapter_adapts_the_lm_head(monkeypatch):
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    cpu_lora_fix.install()  # the LM head's term goes through vLLM's CPU ops: -1 tokens need the fix
    vocab, calls = 50, []
    parent = PunicaWrapperCPU.add_lora_logits
    monkeypatch.setattr(
        PunicaWrapperCPU, "add_lora_logits", lambda self, *a, **kw: calls.append(1) or parent(self, *a, **kw)
    )
    w = wrapper(PunicaWrapperEinsum, DECODE, False)
    a = torch.zeros(SLOTS, 1, R, H_IN)
    b = torch.zeros(SLOTS, 1, vocab, R)
    x = torch.randn(len(DECODE), H_IN)
    y0 = torch.randn(len(DECODE), vocab)
    y = y0.clone()
    w.add_lora_logits(y, x, a, b, 1.0)  # q/k/v/o adapters: the LM head's stacks are all zero
    assert calls == [] and torch.equal(y, y0)
    g = torch.Generator().manual_seed(3)
    a[2, 0, :4] = torch.randn(4, H_IN, generator=g)  # slot 2's adapter adapts the LM head
    b[2, 0, :, :4] = torch.randn(vocab, 4, generator=g)
    w.add_lora_logits(y, x, a, b, 1.0)
    assert calls == [1]
    want = y0.double().clone()
    for t, n in enumerate(slot_of(DECODE)):
        if n == 2:
            want[t] += b[2, 0].double() @ (a[2, 0].double() @ x[t].double())
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
