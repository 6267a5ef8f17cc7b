"""The background LoRA reads (engine_ext/lora_prefetch.py), on a stand-in for vLLM's LoRA manager.

The real engine's side (a cold load beside a running stream, the refusal of a corrupt adapter)
is in test_cold_load.py; here the bookkeeping: one read per adapter, a failed read raised where
vLLM's own read would raise, nothing read twice or kept forever."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from dlora.engine_ext import lora_prefetch


@dataclass(frozen=True)
class Req:
    """The LoRARequest fields the prefetcher reads."""

    lora_int_id: int
    lora_path: str


class FakeCache:
    """vLLM's `LRUCacheLoRAModelManager`: its packing of a model, and no MoE layers."""

    def __init__(self) -> None:
        self.modules: dict = {}
        self.packed: list = []

    def _create_merged_loras_inplace(self, model) -> None:
        self.packed.append(model)


class FakeManager:
    """vLLM's `WorkerLoRAManager._load_adapter`: reads block on `gate`, `bad` paths fail."""

    def __init__(self) -> None:
        self.reads: list[Req] = []
        self.gate = threading.Event()
        self.gate.set()
        self._adapter_manager = FakeCache()

    def _load_adapter(self, req: Req):
        self.gate.wait(5)
        self.reads.append(req)
        if req.lora_path == "bad":
            raise ValueError("corrupt adapter file")
        return ("model", req.lora_int_id)


def test_load_adapter_returns_the_prefetched_model_and_reads_once_per_adapter():
    manager = FakeManager()
    prefetcher = lora_prefetch.install(manager)
    assert lora_prefetch.install(manager) is prefetcher  # idempotent: one wrapper, one prefetcher
    manager.gate.clear()
    assert prefetcher.start(Req(1, "a"))
    assert not prefetcher.start(Req(1, "a"))  # a concurrent load of the same adapter reuses the read
    assert not prefetcher.done(1) and prefetcher.done(2)
    manager.gate.set()
    assert manager._load_adapter(Req(1, "a")) == ("model", 1)  # waits for the read it was handed
    assert prefetcher.done(1) and prefetcher.pending() == 0
    assert manager._load_adapter(Req(2, "b")) == ("model", 2)  # nothing prefetched: vLLM reads it
    assert manager.reads == [Req(1, "a"), Req(2, "b")]
    assert manager._adapter_manager.packed == [("model", 1)]  # packed ahead in the thread only


def test_a_failed_read_raises_from_load_adapter_once():
    manager = FakeManager()
    prefetcher = lora_prefetch.install(manager)
    prefetcher.start(Req(3, "bad"))
    while not prefetcher.done(3):
        pass
    with pytest.raises(ValueError, match="corrupt adapter file"):
        manager._load_adapter(Req(3, "bad"))
    assert prefetcher.pending() == 0  # the next attempt reads the files again


def test_a_prefetch_for_another_path_under_the_same_id_is_not_handed_out():
    manager = FakeManager()
    prefetcher = lora_prefetch.install(manager)
    prefetcher.start(Req(4, "old"))
    assert manager._load_adapter(Req(4, "new")) == ("model", 4)
    assert manager.reads[-1] == Req(4, "new")
    assert prefetcher.pending() == 1


def test_reads_never_taken_are_dropped_oldest_first():
    manager = FakeManager()
    prefetcher = lora_prefetch.install(manager)
    n = lora_prefetch.MAX_UNTAKEN + 3
    for i in range(n):
        prefetcher.start(Req(i, f"p{i}"))
        while not prefetcher.done(i):
            pass
    assert prefetcher.pending() <= lora_prefetch.MAX_UNTAKEN + 1
    manager._load_adapter(Req(0, "p0"))  # dropped: read again
    assert manager.reads.count(Req(0, "p0")) == 2
    manager._load_adapter(Req(n - 1, f"p{n - 1}"))  # kept: not read again
    assert manager.reads.count(Req(n - 1, f"p{n - 1}")) == 1
