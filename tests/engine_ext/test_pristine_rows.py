"""Where the in-place merge keeps pristine weight rows: the device budget split, and exact restores."""

from __future__ import annotations

import pytest
import torch

from dlora import env
from dlora.engine_ext.pristine_rows import DEVICE, GIB, HOST, PristineRows, budget_bytes, split_budget


def test_rows_fill_the_device_budget_in_saving_order_then_go_to_host():
    sizes = [("q", 40), ("k", 30), ("v", 40), ("o", 20)]
    assert split_budget(sizes, used=0, budget=100) == {"q": DEVICE, "k": DEVICE, "v": HOST, "o": DEVICE}
    assert split_budget(sizes, used=0, budget=0) == dict.fromkeys(["q", "k", "v", "o"], HOST)
    assert split_budget(sizes, used=90, budget=100) == dict.fromkeys(["q", "k", "v", "o"], HOST)
    assert split_budget(sizes, used=0, budget=10**9) == dict.fromkeys(["q", "k", "v", "o"], DEVICE)
    assert split_budget([("q", 100)], used=0, budget=100) == {"q": DEVICE}  # exactly full fits


def test_the_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(env.DLORA_PRISTINE_DEVICE_GIB.name, raising=False)
    assert budget_bytes() == GIB
    monkeypatch.setenv(env.DLORA_PRISTINE_DEVICE_GIB.name, "0.5")
    assert budget_bytes() == GIB // 2
    assert PristineRows().budget == GIB // 2
    monkeypatch.setenv(env.DLORA_PRISTINE_DEVICE_GIB.name, "-1")
    with pytest.raises(ValueError, match="DLORA_PRISTINE_DEVICE_GIB"):
        budget_bytes()


def test_saved_rows_come_back_bit_exact_and_are_saved_once():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(48, 32, generator=g).to(torch.bfloat16)
    pristine = fused.clone()
    views = {"q": fused[:32], "k": fused[32:40], "v": fused[40:]}
    rows = PristineRows(device_budget_bytes=32 * 32 * 2 + 8 * 32 * 2)  # room for q and k only
    rows.save(views)
    assert [rows.tier(n) for n in views] == [DEVICE, DEVICE, HOST]
    assert (rows.device_bytes, rows.host_bytes) == (40 * 32 * 2, 8 * 32 * 2)
    fused.add_(1.0)  # what a merge does to the live rows
    rows.save(views)  # already saved: the merged values must not replace the pristine copies
    rows.restore(views)
    assert torch.equal(fused.view(torch.int16), pristine.view(torch.int16))
