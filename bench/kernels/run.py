"""Benchmark the batched-LoRA ops against vLLM's own torch LoRA ops and a plain torch loop.

    .venv/bin/python -m bench.kernels.run            # full CPU grid, ~2-3 min on 1 thread
    .venv/bin/python -m bench.kernels.run --quick    # a few cases, for a smoke run

Per case (model hidden size H, SGMV prefill or BGMV decode, T tokens, N adapters, ranks) it
times, as medians of repeated runs that alternate between methods (1 torch thread):
    shrink / expand   vllm (vllm.lora.ops.torch_ops sgmv_*/bgmv_*, weights stacked and padded to
                      the max rank), ref (dlora_kernels.reference loop), einsum (one-hot, packed)
    add (both)        the same three (einsum: whichever of its two forms it picks), plus einsum_onehot
                      (its one-hot form always) and einsum_paper (the literal 3-operand one-hot einsum)
and, per (H, rank), merge_lora_inplace: ours (row-tiled addmm_) against a whole-matrix addmm_ and
the naive `W += s * (B @ A)` that materialises the H x H delta.
On CUDA it also times the Triton kernels and reports achieved bandwidth as a fraction of the
device's measured copy bandwidth. Writes bench/kernels/result.json on CPU (result_cuda.json on
CUDA) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dlora.bench.plot import pyplot, save_figure
from dlora.bench.provenance import machine as provenance_machine
from dlora.bench.provenance import provenance
from dlora.bench.results import write_result
from dlora_kernels import (
    LoRABatchMeta,
    PackedLoRA,
    add_lora,
    einsum,
    lora_expand,
    lora_shrink,
    merge_lora_inplace,
    pack_lora,
    reference,
)

MODELS = {"smollm2-135m": 576, "llama-7b": 4096}
RANK_SETS = {"r8": (8,), "r64": (64,), "mixed8-64": (8, 16, 32, 64)}
NUM_ADAPTERS = (1, 8, 64)
TOKEN_SETTINGS = (("bgmv", 16), ("bgmv", 64), ("sgmv", 256))  # sgmv: segments of 16 tokens
PREFILL_SEGMENT = 16
ROUND_BUDGET_S = 2.5
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class BenchCase:
    model: str
    hidden: int
    mode: str  # "sgmv" (segmented prefill) or "bgmv" (per-token decode)
    num_tokens: int
    num_adapters: int
    ranks_label: str

    @property
    def ranks(self) -> tuple[int, ...]:
        pool = RANK_SETS[self.ranks_label]
        return tuple(pool[i % len(pool)] for i in range(self.num_adapters))

    @property
    def label(self) -> str:
        return f"{self.model} {self.mode} T={self.num_tokens} N={self.num_adapters} {self.ranks_label}"


@dataclass
class Inputs:
    lora: PackedLoRA
    meta: LoRABatchMeta
    x: torch.Tensor
    v: torch.Tensor
    y: torch.Tensor
    a_stacked: torch.Tensor  # [N, R_max, H] (vLLM layout: lora_a)
    b_stacked: torch.Tensor  # [N, H, R_max] (vLLM layout: lora_b)
    seg_lens: torch.Tensor  # vLLM sgmv metadata
    seg_starts: torch.Tensor
    seg_adapters: torch.Tensor


def make_inputs(case: BenchCase, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    h = case.hidden
    lora = pack_lora(
        [torch.randn(r, h, generator=gen) / h**0.5 for r in case.ranks],
        [torch.randn(h, r, generator=gen) / r**0.5 for r in case.ranks],
    ).to(device)
    if case.mode == "sgmv":
        num_segments = case.num_tokens // PREFILL_SEGMENT
        adapters = torch.randint(case.num_adapters, (num_segments,), generator=gen).tolist()
        meta = LoRABatchMeta.prefill([PREFILL_SEGMENT] * num_segments, adapters, device)
    else:
        meta = LoRABatchMeta.decode(torch.randint(case.num_adapters, (case.num_tokens,), generator=gen), device)
    a_stacked, b_stacked = lora.stacked()
    seg = LoRABatchMeta.segments_of(meta.token_indices.tolist(), device)
    assert seg.seg_starts is not None and seg.seg_adapters is not None
    return Inputs(
        lora=lora,
        meta=meta,
        x=torch.randn(case.num_tokens, h, generator=gen).to(device),
        v=torch.zeros(case.num_tokens, lora.max_rank, device=device),
        y=torch.zeros(case.num_tokens, h, device=device),
        a_stacked=a_stacked,
        b_stacked=b_stacked,
        seg_lens=(seg.seg_starts[1:] - seg.seg_starts[:-1]).long(),
        seg_starts=seg.seg_starts[:-1].long(),
        seg_adapters=seg.seg_adapters.long(),
    )


def vllm_ops(case: BenchCase, inp: Inputs) -> tuple[Callable[[], None], Callable[[], None]]:
    """vLLM's torch ops on the same batch (every token has an adapter: they index with -1)."""
    from vllm.lora.ops import torch_ops as vt

    t = case.num_tokens
    if case.mode == "sgmv":
        meta = (inp.seg_starts, inp.seg_lens, inp.seg_adapters, inp.seg_adapters.numel(), int(inp.seg_lens.max()), t)

        def shrink() -> None:
            vt.sgmv_shrink(inp.x, inp.a_stacked, inp.v, *meta, 1.0)

        def expand() -> None:
            vt.sgmv_expand(inp.v, inp.b_stacked, inp.y, *meta, True)
    else:
        idx = inp.meta.token_indices.long()

        def shrink() -> None:
            vt.bgmv_shrink(inp.x, inp.a_stacked, inp.v, idx, 1.0)

        def expand() -> None:
            vt.bgmv_expand(inp.v, inp.b_stacked, inp.y, idx, True)

    return shrink, expand


def lora_methods(case: BenchCase, inp: Inputs, with_triton: bool) -> dict[str, Callable[[], None]]:
    vllm_shrink, vllm_expand = vllm_ops(case, inp)
    lo, me, x, v, y = inp.lora, inp.meta, inp.x, inp.v, inp.y
    methods: dict[str, Callable[[], None]] = {
        "shrink/vllm": vllm_shrink,
        "shrink/ref": lambda: lora_shrink(v, x, lo, me, backend="reference"),
        "shrink/einsum": lambda: lora_shrink(v, x, lo, me, backend="einsum"),
        "expand/vllm": vllm_expand,
        "expand/ref": lambda: lora_expand(y, v, lo, me, backend="reference"),
        "expand/einsum": lambda: lora_expand(y, v, lo, me, backend="einsum"),
        "add/vllm": lambda: (vllm_shrink(), vllm_expand()),
        "add/ref": lambda: add_lora(y, x, lo, me, backend="reference"),
        "add/einsum": lambda: add_lora(y, x, lo, me, backend="einsum"),
        "add/einsum_onehot": lambda: einsum.add_lora_einsum(y, x, lo, me, form="onehot"),
        "add/einsum_paper": lambda: reference.lora_einsum_onehot(y, x, inp.a_stacked, inp.b_stacked, me.token_indices),
    }
    if with_triton:
        methods["shrink/triton"] = lambda: lora_shrink(v, x, lo, me, backend="triton")
        methods["expand/triton"] = lambda: lora_expand(y, v, lo, me, backend="triton")
        methods["add/triton"] = lambda: add_lora(y, x, lo, me, backend="triton")
    return methods


def merge_methods(
    w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, with_triton: bool
) -> dict[str, Callable[[], None]]:
    methods: dict[str, Callable[[], None]] = {
        "merge/ours": lambda: merge_lora_inplace(w, a, b, 0.5, 1, backend="reference"),
        "merge/addmm_whole": lambda: w.addmm_(b, a, alpha=0.5),
        "merge/naive_delta": lambda: w.add_(b @ a, alpha=0.5),
    }
    if with_triton:
        methods["merge/triton"] = lambda: merge_lora_inplace(w, a, b, 0.5, 1, backend="triton")
    return methods


def time_alternating(
    methods: dict[str, Callable[[], None]], device: torch.device, min_reps: int, max_reps: int
) -> tuple[dict[str, float], int]:
    """Median seconds per method; each round runs every method once, order alternating."""
    inner = 10 if device.type == "cuda" else 1

    def once(fn: Callable[[], None]) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / inner

    round_s = sum(once(fn) for fn in methods.values())  # warm-up round
    reps = max(min_reps, min(max_reps, int(ROUND_BUDGET_S / max(round_s, 1e-9))))
    samples: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(reps):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            samples[name].append(once(methods[name]))
    return {k: statistics.median(v) for k, v in samples.items()}, reps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lora_bytes(case: BenchCase, inp: Inputs, op: str) -> int:
    """Bytes an ideal kernel moves: activations once, each present adapter's rows once."""
    present = sorted(set(inp.meta.token_indices.tolist()) - {-1})
    rank_rows = sum(inp.lora.ranks[n] for n in present)
    el = inp.x.element_size()
    t, h, r = case.num_tokens, case.hidden, inp.lora.max_rank
    shrink = (t * h + rank_rows * h) * el + 2 * t * r * 4
    expand = t * r * 4 + rank_rows * h * el + 2 * t * h * el
    return {"shrink": shrink, "expand": expand, "add": shrink + expand}[op]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the roofline reference."""
    src = torch.empty(64 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    medians, _ = time_alternating({"copy": lambda: dst.copy_(src)}, device, 5, 20)
    return 2 * src.numel() * src.element_size() / medians["copy"]


def run_lora_case(
    case: BenchCase, device: torch.device, with_triton: bool, copy_bw: float | None, min_reps: int, max_reps: int
) -> dict:
    inp = make_inputs(case, device)
    medians, reps = time_alternating(lora_methods(case, inp, with_triton), device, min_reps, max_reps)
    row = {
        **asdict(case),
        "ranks": list(case.ranks),
        "reps": reps,
        "median_ms": {k: round(s * 1e3, 4) for k, s in medians.items()},
    }
    row["speedup_vs_vllm"] = {
        k: round(medians[f"{k.split('/')[0]}/vllm"] / s, 3) for k, s in medians.items() if not k.endswith("/vllm")
    }
    if with_triton and copy_bw:
        row["triton_bandwidth_fraction"] = {
            op: round(lora_bytes(case, inp, op) / medians[f"{op}/triton"] / copy_bw, 3)
            for op in ("shrink", "expand", "add")
        }
    return row


def run_merge_case(
    model: str,
    hidden: int,
    rank: int,
    device: torch.device,
    with_triton: bool,
    copy_bw: float | None,
    min_reps: int,
    max_reps: int,
) -> dict:
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(hidden, hidden, generator=gen).to(device)
    a = torch.randn(rank, hidden, generator=gen).to(device) / hidden**0.5
    b = torch.randn(hidden, rank, generator=gen).to(device) / rank**0.5
    medians, reps = time_alternating(merge_methods(w, a, b, with_triton), device, min_reps, max_reps)
    row = {
        "model": model,
        "hidden": hidden,
        "rank": rank,
        "reps": reps,
        "median_ms": {k: round(s * 1e3, 4) for k, s in medians.items()},
        "speedup_vs_naive_delta": {
            k: round(medians["merge/naive_delta"] / s, 3) for k, s in medians.items() if k != "merge/naive_delta"
        },
    }
    if with_triton and copy_bw:
        moved = (2 * w.numel() + a.numel() + b.numel()) * w.element_size()
        row["triton_bandwidth_fraction"] = round(moved / medians["merge/triton"] / copy_bw, 3)
    return row


def machine_info(device: torch.device) -> dict:
    import triton
    import vllm

    info = {
        **provenance_machine(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": vllm.__version__,
        "triton": triton.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def cases(quick: bool) -> list[BenchCase]:
    if quick:
        return [
            BenchCase("smollm2-135m", 576, "bgmv", 16, 8, "mixed8-64"),
            BenchCase("smollm2-135m", 576, "sgmv", 256, 8, "mixed8-64"),
        ]
    return [
        BenchCase(model, hidden, mode, t, n, ranks)
        for model, hidden in MODELS.items()
        for mode, t in TOKEN_SETTINGS
        for n in NUM_ADAPTERS
        for ranks in RANK_SETS
    ]


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = [r for r in result["lora"] if r["ranks_label"] == "mixed8-64"]
    settings = [(m, t) for m, t in TOKEN_SETTINGS if any(r["mode"] == m and r["num_tokens"] == t for r in rows)]
    models = [m for m in MODELS if any(r["model"] == m for r in rows)]
    fig, axes = plt.subplots(
        len(models), len(settings), figsize=(4.2 * len(settings), 3.4 * len(models)), squeeze=False
    )
    for i, model in enumerate(models):
        for j, (mode, t) in enumerate(settings):
            ax = axes[i][j]
            sel = sorted(
                (r for r in rows if r["model"] == model and r["mode"] == mode and r["num_tokens"] == t),
                key=lambda r: r["num_adapters"],
            )
            for method in sorted({k for r in sel for k in r["median_ms"] if k.startswith("add/")}):
                ax.plot(
                    [r["num_adapters"] for r in sel],
                    [r["median_ms"][method] for r in sel],
                    marker="o",
                    label=method.removeprefix("add/"),
                )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_title(f"{model} {mode} T={t}", fontsize=9)
            ax.set_xlabel("adapters loaded, N (tokens pick uniformly)")
            ax.set_ylabel("shrink+expand, ms")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        f"LoRA shrink+expand, mixed ranks 8-64, fp32, {result['machine']['device']}, "
        f"{result['machine']['torch_threads']} thread(s)",
        fontsize=10,
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small cases only")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (PNG goes next to it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-reps", type=int, default=7)
    parser.add_argument("--max-reps", type=int, default=15)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with_triton = device.type == "cuda"
    out = args.out or HERE / ("result.json" if device.type == "cpu" else f"result_{device.type}.json")
    copy_bw = copy_bandwidth(device) if with_triton else None
    result: dict = {
        **provenance("bench.kernels.run", argv),
        "machine": machine_info(device),
        "loadavg_start": os.getloadavg(),
        "dtype": "float32",
        "copy_bandwidth_GBps": copy_bw and round(copy_bw / 1e9, 2),
        "notes": NOTES,
        "lora": [],
        "merge": [],
    }
    todo = cases(args.quick)
    started = time.perf_counter()
    for i, case in enumerate(todo, 1):
        row = run_lora_case(case, device, with_triton, copy_bw, args.min_reps, args.max_reps)
        result["lora"].append(row)
        add = row["median_ms"]
        print(
            f"[{i}/{len(todo)}] {case.label}: add ms vllm {add['add/vllm']:.3f} ref "
            f"{add['add/ref']:.3f} einsum {add['add/einsum']:.3f} paper "
            f"{add['add/einsum_paper']:.3f} ({time.perf_counter() - started:.0f}s)",
            flush=True,
        )
    merge_models = {"smollm2-135m": 576} if args.quick else MODELS
    for model, hidden in merge_models.items():
        for rank in (8, 64):
            row = run_merge_case(model, hidden, rank, device, with_triton, copy_bw, args.min_reps, args.max_reps)
            result["merge"].append(row)
            print(f"[merge] {model} r={rank}: {row['median_ms']}", flush=True)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["loadavg_end"] = os.getloadavg()
    write_result(result, out, plot, indent=1, print_summary=False)
    print(f"wrote {out} and {out.with_suffix('.png')} in {result['wall_s']}s")


NOTES = (
    "median_ms: medians over `reps` rounds; each round runs every method once, in alternating "
    "order. speedup_vs_vllm = vLLM's time / this method's time for the same op (>1 = faster). "
    "vllm = vllm.lora.ops.torch_ops sgmv_*/bgmv_* (what PunicaWrapperCPU calls) on weights "
    "stacked and zero-padded to the max rank; ref = dlora_kernels.reference loop; einsum = "
    "dlora_kernels one-hot einsum on packed mixed-rank weights (add: the einsum backend's pick of "
    "its one-hot and grouped forms; einsum_onehot: the one-hot form always); einsum_paper "
    "= literal einsum('th,tn,nrh->tr') / einsum('tr,tn,nor->to') on stacked weights. Every token "
    "has an adapter (vLLM's torch ops would index adapter -1 as the last one). sgmv: segments of "
    f"{PREFILL_SEGMENT} tokens, adapters drawn uniformly; bgmv: each token's adapter uniform."
)


if __name__ == "__main__":
    main()
