"""Smoke test of bench/kernels/run.py on a tiny case: vLLM's torch ops are called with the right
arguments and every method agrees with the reference on the benchmark's own inputs."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels.kernels_testlib import TRITON_INTERPRETED


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("vllm")
    return importlib.import_module("bench.kernels.run")


@pytest.mark.parametrize("mode,tokens", [("bgmv", 8), ("sgmv", 32)])
def test_bench_methods_agree(bench, mode: str, tokens: int) -> None:
    case = bench.BenchCase("tiny", 48, mode, tokens, 3, "mixed8-64")
    results = {}
    for name in ("add/vllm", "add/ref", "add/einsum", "add/einsum_paper"):
        inp = bench.make_inputs(case, torch.device("cpu"))
        bench.lora_methods(case, inp, with_triton=False)[name]()
        results[name] = inp.y
    for name, y in results.items():
        torch.testing.assert_close(y, results["add/ref"], rtol=1e-4, atol=1e-4, msg=name)


def test_bench_row_has_medians_and_ratios(bench) -> None:
    case = bench.BenchCase("tiny", 48, "sgmv", 32, 3, "r8")
    row = bench.run_lora_case(case, torch.device("cpu"), False, None, min_reps=1, max_reps=1)
    assert set(row["median_ms"]) >= {"shrink/vllm", "expand/einsum", "add/einsum_paper"}
    assert row["speedup_vs_vllm"]["add/einsum"] > 0


@pytest.mark.skipif(not TRITON_INTERPRETED, reason="needs the Triton interpreter")
def test_bench_triton_path_under_interpreter(bench) -> None:
    """The CUDA-only path (Triton timings, bandwidth fractions), run once through the interpreter."""
    case = bench.BenchCase("tiny", 48, "bgmv", 4, 2, "r8")
    row = bench.run_lora_case(case, torch.device("cpu"), True, 1.0, min_reps=1, max_reps=1)
    assert set(row["triton_bandwidth_fraction"]) == {"shrink", "expand", "add"}  # copy_bw = 1 B/s
    merge = bench.run_merge_case("tiny", 48, 8, torch.device("cpu"), True, 1.0, 1, 1)
    assert merge["triton_bandwidth_fraction"] > 0
