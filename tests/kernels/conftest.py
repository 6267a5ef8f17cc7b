"""Run the Triton kernels on CPU through Triton's interpreter, without leaking it elsewhere.

`triton.jit` decides at decoration time whether a kernel is interpreted. Without CUDA,
kernels_testlib (imported here, so before any test module) imports the kernel modules with
TRITON_INTERPRET=1, re-importing them if something imported them before, and restores the
variable at once: other test directories and the processes they start never see it. While a
test in this directory runs, the autouse fixture below sets it again, because
`dlora_kernels.ops.triton_usable` reads it. The kernels call only triton.language builtins, so
it does not matter whether triton itself was first imported with the variable set (peft and vLLM
import triton early). With CUDA the kernels run natively on the GPU instead.
"""

from __future__ import annotations

import pytest

from tests.kernels.kernels_testlib import TRITON_INTERPRETED


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if TRITON_INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
