"""The in-place merge strategy of `WeightMerger` on the Triton merge kernel (the CUDA path).

Same fake vLLM-layout model and checks as tests/engine_ext/test_merge_inplace.py, but with the
kernel `merge_lora_inplace` picks where Triton runs: natively on CUDA, under Triton's
interpreter on CPU. The kernel writes into row slices of the fused qkv / gate_up parameters
(views with an offset), which is what the engine hands it.
"""

from __future__ import annotations

import pytest
import torch

import dlora_kernels.triton_merge as triton_merge
from dlora.engine_ext.merge import CheckpointTensors, ParameterViews, WeightMerger
from dlora_kernels import select_backend
from tests.engine_ext.test_merge_inplace import (  # noqa: F401  (base_dir is a fixture)
    LLAMA_PACKED,
    FakeVllmModel,
    all_rows,
    assert_bits_equal,
    base_dir,
    reference,
    snapshot,
    write_adapter,
)
from tests.kernels.kernels_testlib import DEVICE, TRITON_RUNNABLE

pytestmark = pytest.mark.skipif(not TRITON_RUNNABLE, reason="no triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_inplace_strategy_on_the_triton_kernel(base_dir, tmp_path, monkeypatch, dtype):  # noqa: F811
    assert select_backend(DEVICE) == "triton"
    launches = []
    real = triton_merge.merge_lora_inplace_triton

    def spy(w, *args, **kwargs):
        launches.append(w.data_ptr())
        real(w, *args, **kwargs)

    monkeypatch.setattr(triton_merge, "merge_lora_inplace_triton", spy)
    ckpt = CheckpointTensors(base_dir)
    model = FakeVllmModel(ckpt, dtype).to(DEVICE)
    original = snapshot(model)

    def no_reload(items):
        raise AssertionError("plain parameters must merge in place")

    merger = WeightMerger(ckpt, no_reload, LLAMA_PACKED, dtype, live=ParameterViews(model, LLAMA_PACKED))
    x = write_adapter(tmp_path / "x", ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], seed=1)
    y = write_adapter(tmp_path / "y", ["v_proj", "gate_proj"], seed=2)
    before = {n: t.cpu() for n, t in all_rows(model).items()}
    merger.merge(str(x))
    assert merger.strategy == "inplace" and len(launches) == 10  # 5 modules x 2 layers
    ref = reference(before, x)
    # bf16: one ulp, not half: Triton's interpreter rounds fp32 -> bf16 toward zero (CUDA: to nearest).
    rtol, atol = (2**-7, 1e-6) if dtype == torch.bfloat16 else (1e-5, 1e-4)
    for n, got in all_rows(model).items():
        got = got.cpu()
        if n in ref:
            assert torch.allclose(got.double(), ref[n], rtol=rtol, atol=atol), n
        else:
            assert torch.equal(got, before[n]), n
    merger.merge(str(y))
    merger.merge(str(x))
    merger.unmerge()
    assert_bits_equal(model, original)
