"""Where the in-place merge keeps its copies of the pristine weight rows, and how they go back.

Runs inside vLLM's worker process.

An in-place unmerge copies the saved rows back over the merged ones (bit-exact by construction,
see `merge.WeightMerger`). On a GPU that copy is the whole switch cost, so where the copies live
matters: device memory copies back at device bandwidth (a 7B model's q/k/v/o, 4 GiB, in a few ms),
pinned host memory at PCIe speed (~0.2 s), pageable host memory at a fraction of that and with a
host-side staging copy. Device memory is what the KV cache is made of, though, so only a budget of
it is used (`DLORA_PRISTINE_DEVICE_GIB`), first come first served in the order rows are saved;
rows beyond it go to pinned host memory. If the device allocation fails (the memory vLLM left free
is smaller than the budget), that row goes to host memory instead: never an error.

On CPU the device is the host: every copy is an ordinary host tensor, as before.

Copies are issued non_blocking on the current stream and the stream is synchronized once per
batch (`sync`), so many rows pipeline instead of one round trip each, and nothing reads a row
before its copy has landed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dlora import env

DEVICE = "device"
HOST = "host"
GIB = 1 << 30


def budget_bytes() -> int:
    """The device budget for pristine rows, from the environment (default in dlora/env.py)."""
    return int(env.DLORA_PRISTINE_DEVICE_GIB.get() * GIB)


def split_budget(sizes: Iterable[tuple[str, int]], used: int, budget: int) -> dict[str, str]:
    """Tier of each (name, bytes), in order: DEVICE while `used` + its bytes fit `budget`, else HOST.

    First fit in saving order, not best fit: a row that does not fit does not stop a later,
    smaller one from taking what is left, and rows already placed never move.
    """
    tiers = {}
    for name, size in sizes:
        if used + size <= budget:
            tiers[name] = DEVICE
            used += size
        else:
            tiers[name] = HOST
    return tiers


@dataclass
class _Saved:
    rows: torch.Tensor
    tier: str


class PristineRows:
    """Saved pristine rows by checkpoint weight name; a row is saved once and kept for good."""

    def __init__(self, device_budget_bytes: int | None = None):
        self.budget = budget_bytes() if device_budget_bytes is None else device_budget_bytes
        self._saved: dict[str, _Saved] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._saved

    def save(self, views: dict[str, torch.Tensor]) -> None:
        """Copy aside the rows of every view not saved yet (they must hold pristine values now)."""
        new = [(n, v) for n, v in views.items() if n not in self._saved]
        if not new:
            return
        tiers = split_budget(((n, _nbytes(v)) for n, v in new), self.device_bytes, self.budget)
        for n, v in new:
            self._saved[n] = _copy_aside(v, tiers[n])
        _sync(new[0][1])

    def restore(self, views: dict[str, torch.Tensor]) -> None:
        """Copy the saved rows back over each view (all must have been saved)."""
        if not views:
            return
        for n, v in views.items():
            v.copy_(self._saved[n].rows, non_blocking=True)
        _sync(next(iter(views.values())))

    def tier(self, name: str) -> str:
        return self._saved[name].tier

    @property
    def device_bytes(self) -> int:
        return sum(_nbytes(s.rows) for s in self._saved.values() if s.tier == DEVICE)

    @property
    def host_bytes(self) -> int:
        return sum(_nbytes(s.rows) for s in self._saved.values() if s.tier == HOST)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_aside(v: torch.Tensor, tier: str) -> _Saved:
    if v.device.type == "cpu":  # device == host: one plain copy, whichever tier the budget says
        return _Saved(v.clone(), tier)
    if tier == DEVICE:
        try:
            return _Saved(v.clone(), DEVICE)
        except torch.OutOfMemoryError:
            pass  # less free device memory than the budget: host memory instead
    try:
        rows = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
    except RuntimeError:  # pinning refused (e.g. locked-memory limit): pageable memory still works
        rows = torch.empty(v.shape, dtype=v.dtype)
    rows.copy_(v, non_blocking=rows.is_pinned())
    return _Saved(rows, HOST)


def _sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()
