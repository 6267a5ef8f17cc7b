"""Case factories, an fp64 token-by-token oracle, poisoned buffers and the Triton set-up for the
kernel tests (see conftest.py for why the kernels are imported here under the interpreter)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from dataclasses import dataclass

import torch

from dlora_kernels import LoRABatchMeta, PackedLoRA, pack_lora


def _import_interpreted_kernels() -> bool:
    """Import the Triton kernel modules with TRITON_INTERPRET=1, then restore the variable."""
    if importlib.util.find_spec("triton") is None:
        return False
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from triton.runtime.interpreter import InterpretedFunction

        import dlora_kernels.triton_lora as triton_lora
        import dlora_kernels.triton_merge as triton_merge

        for module in (triton_lora, triton_merge):  # imported before, without the interpreter?
            kernels = [v for k, v in vars(module).items() if k.endswith("_kernel")]
            if not all(isinstance(k, InterpretedFunction) for k in kernels):
                importlib.reload(module)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return True


CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TRITON_INTERPRETED = not CUDA and _import_interpreted_kernels()
TRITON_RUNNABLE = TRITON_INTERPRETED or (CUDA and importlib.util.find_spec("triton") is not None)

# Relative Frobenius error of the update (out - before) against the fp64 oracle.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
POPULARITIES = ("distinct", "uniform", "zipf:1.5", "identical")
NO_LORA_FRACTION = 0.15


@dataclass(frozen=True)
class Case:
    kind: str  # "sgmv" (segmented prefill) or "bgmv" (per-token decode)
    dtype: torch.dtype
    popularity: str
    num_adapters: int
    ranks: tuple[int, ...]
    h_in: int
    h_out: int
    num_requests: int  # segments (sgmv) or tokens (bgmv)
    max_seg_len: int = 8
    seed: int = 0

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.kind}-{dt}-{self.popularity}-N{self.num_adapters}-r{min(self.ranks)}_"
            f"{max(self.ranks)}-H{self.h_in}x{self.h_out}"
        )


def adapter_choices(popularity: str, count: int, num_adapters: int, gen: torch.Generator) -> list[int]:
    """Adapter slot per request under a popularity model (Punica's test vocabulary)."""
    if popularity == "distinct":
        perm = torch.randperm(num_adapters, generator=gen).tolist()
        return [perm[i % num_adapters] for i in range(count)]
    if popularity == "identical":
        return [int(torch.randint(num_adapters, (1,), generator=gen))] * count
    if popularity == "uniform":
        weights = torch.ones(num_adapters)
    elif popularity.startswith("zipf:"):
        alpha = float(popularity.split(":")[1])
        weights = torch.tensor([1.0 / (k + 1) ** alpha for k in range(num_adapters)])
    else:
        raise ValueError(popularity)
    return torch.multinomial(weights, count, replacement=True, generator=gen).tolist()


def make_lora(case: Case, gen: torch.Generator) -> PackedLoRA:
    """Adapters with unit-scale outputs: A ~ N(0, 1/H_in), B ~ N(0, 1/r)."""
    lora_a = [torch.randn(r, case.h_in, generator=gen) / math.sqrt(case.h_in) for r in case.ranks]
    lora_b = [torch.randn(case.h_out, r, generator=gen) / math.sqrt(r) for r in case.ranks]
    return pack_lora([a.to(case.dtype) for a in lora_a], [b.to(case.dtype) for b in lora_b])


def make_meta(case: Case, gen: torch.Generator) -> LoRABatchMeta:
    adapters = adapter_choices(case.popularity, case.num_requests, case.num_adapters, gen)
    no_lora = torch.rand(case.num_requests, generator=gen) < NO_LORA_FRACTION
    adapters = [-1 if off else a for a, off in zip(adapters, no_lora.tolist())]
    if case.kind == "bgmv":
        return LoRABatchMeta.decode(adapters)
    lens = torch.randint(0, case.max_seg_len + 1, (case.num_requests,), generator=gen).tolist()
    lens[0] = case.max_seg_len  # at least one full segment; zeros stay as empty segments
    return LoRABatchMeta.prefill(lens, adapters)


def build(case: Case) -> tuple[PackedLoRA, LoRABatchMeta, torch.Generator]:
    gen = torch.Generator().manual_seed(case.seed)
    return make_lora(case, gen), make_meta(case, gen), gen


def token_ranks(lora: PackedLoRA, meta: LoRABatchMeta) -> list[int]:
    """Rank of each token's adapter, 0 for tokens without one."""
    return [lora.ranks[n] if n >= 0 else 0 for n in meta.token_indices.tolist()]


def written_mask(lora: PackedLoRA, meta: LoRABatchMeta, width: int) -> torch.Tensor:
    """[T, width] bool: the elements of the rank buffer v a shrink must update."""
    ranks = torch.tensor(token_ranks(lora, meta))
    return torch.arange(width)[None, :] < ranks[:, None]


# Poison for output elements that must stay untouched: finite, so that a kernel writing
# "old + anything" there is caught (NaN + anything would still be NaN). Exact in fp16 and bf16.
SENTINEL = -4096.0


def poisoned(
    shape: tuple[int, int], dtype: torch.dtype, keep: torch.Tensor, gen: torch.Generator, poison: float = SENTINEL
) -> torch.Tensor:
    """Random values where `keep`, `poison` everywhere else. Outputs get the finite SENTINEL
    (must come back bit-identical); inputs that must never be read get NaN (any read shows)."""
    out = torch.randn(shape, generator=gen).to(dtype)
    return out.masked_fill_(~keep, poison)


def active_rows_mask(meta: LoRABatchMeta, width: int) -> torch.Tensor:
    return (meta.token_indices >= 0)[:, None].expand(-1, width)


# ---- fp64 oracle: token by token, independent of dlora_kernels' own references ----------------


def oracle_shrink(
    v: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float
) -> torch.Tensor:
    out = v.double().clone()
    for t, n in enumerate(meta.token_indices.tolist()):
        if n >= 0:
            a_n, _ = lora.adapter(n)
            out[t, : a_n.shape[0]] += scale * (a_n.double() @ x[t].double())
    return out


def oracle_expand(
    y: torch.Tensor, v: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float
) -> torch.Tensor:
    out = y.double().clone()
    for t, n in enumerate(meta.token_indices.tolist()):
        if n >= 0:
            _, b_n = lora.adapter(n)
            out[t] += scale * (b_n.double() @ v[t, : b_n.shape[1]].double())
    return out


def oracle_add_lora(
    y: torch.Tensor, x: torch.Tensor, lora: PackedLoRA, meta: LoRABatchMeta, scale: float
) -> torch.Tensor:
    out = y.double().clone()
    for t, n in enumerate(meta.token_indices.tolist()):
        if n >= 0:
            a_n, b_n = lora.adapter(n)
            out[t] += scale * (b_n.double() @ (a_n.double() @ x[t].double()))
    return out


def assert_update_close(
    out: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, written: torch.Tensor, dtype: torch.dtype
) -> None:
    """Untouched elements are bit-identical to before; written ones are finite and match the fp64
    oracle row by row (the row's error relative to its update), so one skipped element fails."""
    torch.testing.assert_close(
        out[~written],
        before[~written],
        rtol=0,
        atol=0,
        equal_nan=True,
        msg="an element that must stay untouched was written",
    )
    assert torch.isfinite(out[written]).all(), "an element that must be written is NaN/inf"
    worst = 0.0
    for t in range(out.shape[0]):
        cols = written[t]
        if not cols.any():
            continue
        got, want, old = out[t, cols].double(), expected[t, cols], before[t, cols].double()
        worst = max(worst, ((got - want).norm() / max((want - old).norm().item(), 1e-30)).item())
    assert worst <= REL_TOL[dtype], f"row relative error {worst:.3g} > {REL_TOL[dtype]:.3g} ({dtype})"
