"""vLLM's CPU LoRA ops apply the last slot's adapter to no-adapter tokens; our wrappers don't."""

from __future__ import annotations

import torch

from dlora.engine_ext import cpu_lora_fix

T, H_IN, H_OUT, R, SLOTS = 6, 16, 12, 4, 3
IDX = torch.tensor([-1, 0, 2, -1, 1, 2])


def weights():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, R, H_IN, generator=g, dtype=torch.float64)
    b = torch.randn(SLOTS, 1, H_OUT, R, generator=g, dtype=torch.float64)
    x = torch.randn(T, H_IN, generator=g, dtype=torch.float64)
    return x, a, b


def reference(x, a, b, scale):
    """fp64 loop: y[t] = scale * x[t] @ A[i].T @ B[i].T for tokens with an adapter, else 0."""
    y = torch.zeros(T, H_OUT, dtype=torch.float64)
    for t, i in enumerate(IDX.tolist()):
        if i >= 0:
            y[t] = scale * (x[t] @ a[i, 0].T) @ b[i, 0].T
    return y


def raw(fn):
    """vLLM's own op, even if dlora's fix is installed in this process."""
    return getattr(fn, "__wrapped__", fn)


def run(shrink, expand, x, a, b, scale):
    buf = torch.zeros(T, R, dtype=torch.float64)
    shrink(x, a, buf, IDX, scale)
    y = torch.zeros(T, H_OUT, dtype=torch.float64)
    expand(buf, b, y, IDX, add_inputs=True)
    return y


def test_vllm_cpu_ops_leak_the_last_adapter_into_base_tokens():
    from vllm.lora.ops.torch_ops import lora_ops

    x, a, b = weights()
    y = run(raw(lora_ops.bgmv_shrink), raw(lora_ops.bgmv_expand), x, a, b, 0.5)
    base_rows = IDX < 0
    assert y[base_rows].abs().max() > 0.1  # the bug: base tokens received slot 2's adapter


def test_wrapped_ops_equal_the_fp64_reference():
    from vllm.lora.ops.torch_ops import lora_ops

    x, a, b = weights()
    y = run(
        cpu_lora_fix.mask_shrink(raw(lora_ops.bgmv_shrink)),
        cpu_lora_fix.mask_expand(raw(lora_ops.bgmv_expand)),
        x,
        a,
        b,
        0.5,
    )
    torch.testing.assert_close(y, reference(x, a, b, 0.5), rtol=1e-12, atol=1e-12)


def test_expand_slice_leaves_base_rows_untouched():
    from vllm.lora.ops.torch_ops import lora_ops

    x, a, b = weights()
    buf = torch.randn(T, R, dtype=torch.float64)
    y = torch.full((T, H_OUT + 4), 7.0, dtype=torch.float64)
    cpu_lora_fix.mask_expand(raw(lora_ops.bgmv_expand_slice))(buf, b, y, IDX, 2, H_OUT, add_inputs=True)
    assert torch.equal(y[IDX < 0], torch.full((2, H_OUT + 4), 7.0, dtype=torch.float64))
    want = 7.0 + buf[1] @ b[0, 0].T
    torch.testing.assert_close(y[1, 2 : 2 + H_OUT], want)


def test_install_patches_the_names_the_cpu_wrapper_calls():
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    saved = {
        n: (getattr(lora_ops, n), getattr(punica_cpu, n)) for n in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    }
    try:
        cpu_lora_fix.install()
        assert cpu_lora_fix.install() is False  # idempotent
        x, a, b = weights()
        # sgmv_* reach the fix through lora_ops globals: one segment per token here.
        buf = torch.zeros(T, R, dtype=torch.float64)
        ones = torch.ones(T, dtype=torch.long)
        lora_ops.sgmv_shrink(x, a, buf, None, ones, IDX, T, 1, T, 0.5)
        y = torch.zeros(T, H_OUT, dtype=torch.float64)
        punica_cpu.bgmv_expand(buf, b, y, IDX, add_inputs=True)
        torch.testing.assert_close(y, reference(x, a, b, 0.5), rtol=1e-12, atol=1e-12)
    finally:
        for n, (ops_fn, cpu_fn) in saved.items():
            setattr(lora_ops, n, ops_fn)
            setattr(punica_cpu, n, cpu_fn)
