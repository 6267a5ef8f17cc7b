"""The Triton kernels' achieved memory bandwidth against the device's own copy bandwidth.

Every op here is bound by memory traffic (LoRA ranks are small), so bytes moved / time, next to
what a plain device-to-device copy reaches, says how far a kernel is from the roofline. Bytes are
counted as each op must move them at least once: shrink reads x and A and reads+writes v; expand
reads v and B and reads+writes y; merge reads and writes W (A and B are negligible). Shapes are a
Llama-7B projection (4096 x 4096, bf16) with 8 adapters of rank 16 (and 64 for the rank tiles).

Each op is timed two ways. `call_us` is one call as the caller sees it (CUDA events around the
Python call: the wrapper, Triton's launch and the kernel); `kernel_us` is the GPU time of the
kernels alone (torch's profiler). Decode-sized ops are small enough that the two differ by the
host-side launch cost, which CUDA graphs remove and eager mode pays every layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HIDDEN = 4096
NUM_ADAPTERS = 8
PREFILL_TOKENS = 2048
DECODE_TOKENS = 128
REPS = 20
COPY_BYTES = 1 << 30


def run() -> dict:
    copy = copy_bandwidth()
    kernels: dict[str, dict] = {}
    for rank in (16, 64):
        for kind in ("sgmv", "bgmv"):
            for op in ("shrink", "expand"):
                kernels[f"{kind}_{op}_r{rank}"] = _entry(*_lora_op(op, kind, rank), copy)
        kernels[f"merge_r{rank}"] = _entry(*_merge(rank), copy)
    return {"copy_gbps": round(copy, 1), "kernels": kernels}


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _time(lambda: dst.copy_(src)) / 1e9


def _entry(moved: int, fn: Callable[[], object], copy: float) -> dict:
    """Bandwidth per call and per kernel time, each also as a share of the copy bandwidth."""
    call, kernel = _time(fn), _kernel_time(fn)
    gbps, kernel_gbps = moved / call / 1e9, moved / kernel / 1e9
    return {
        "bytes": moved,
        "call_us": round(call * 1e6, 1),
        "kernel_us": round(kernel * 1e6, 1),
        "gbps": round(gbps, 1),
        "of_copy": round(gbps / copy, 3),
        "kernel_gbps": round(kernel_gbps, 1),
        "kernel_of_copy": round(kernel_gbps / copy, 3),
    }


def _lora_op(op: str, kind: str, rank: int) -> tuple[int, Callable[[], object]]:
    """(bytes the op must move, the op as a no-argument call)."""
    from dlora_kernels import LoRABatchMeta, lora_expand, lora_shrink, pack_lora

    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    lora = pack_lora(
        [torch.randn(rank, HIDDEN, device="cuda", dtype=dt, generator=g) * 0.01 for _ in range(NUM_ADAPTERS)],
        [torch.randn(HIDDEN, rank, device="cuda", dtype=dt, generator=g) * 0.01 for _ in range(NUM_ADAPTERS)],
    )
    if kind == "sgmv":
        t = PREFILL_TOKENS
        per = t // NUM_ADAPTERS
        meta = LoRABatchMeta.prefill([per] * NUM_ADAPTERS, list(range(NUM_ADAPTERS)), device="cuda")
    else:
        t = DECODE_TOKENS
        meta = LoRABatchMeta.decode([i % NUM_ADAPTERS for i in range(t)], device="cuda")
    x = torch.randn(t, HIDDEN, device="cuda", dtype=dt, generator=g)
    v = torch.zeros(t, rank, device="cuda", dtype=torch.float32)
    y = torch.zeros(t, HIDDEN, device="cuda", dtype=dt)
    if op == "shrink":
        return x.nbytes + lora.a.nbytes + 2 * v.nbytes, lambda: lora_shrink(v, x, lora, meta, 1.0, backend="triton")
    return v.nbytes + lora.b.nbytes + 2 * y.nbytes, lambda: lora_expand(y, v, lora, meta, 1.0, backend="triton")


def _merge(rank: int) -> tuple[int, Callable[[], object]]:
    from dlora_kernels import merge_lora_inplace

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(rank, HIDDEN, device="cuda", generator=g) * 0.01  # fp32, as merge.py passes them
    b = torch.randn(HIDDEN, rank, device="cuda", generator=g) * 0.01
    return 2 * w.nbytes, lambda: merge_lora_inplace(w, a, b, 1.0, 1, backend="triton")


def _time(fn) -> float:
    """Median seconds of one call, after a warm-up (which also pays Triton's compile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _kernel_time(fn) -> float:
    """Mean GPU seconds of the kernels one call launches, from torch's profiler (no host time)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    device_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return device_us / REPS / 1e6
