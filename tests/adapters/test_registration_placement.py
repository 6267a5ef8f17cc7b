"""Registration places an adapter by demand: one replica checks it (refused: never recorded), pinned
ones go everywhere, a new version goes where the old one is, an unload leaves no replica holding it
(router over simulated replicas; the real server: tests/server/test_host_lora_cache.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from dlora.adapters.lifecycle import SNAPSHOT_SUBDIR, AdapterManager
from dlora.adapters.registry import AdapterRegistry
from dlora.adapters.validate import AdapterValidationError, BaseModelShapes
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import AdapterRef
from dlora.sim.toy_replica import ToyReplica
from dlora.slo.config import SloConfig


@dataclass
class RefusingReplica(ToyReplica):
    """An engine that refuses every adapter (as vLLM does one it cannot load)."""

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        raise ValueError(f"cannot load {ref.name}")


def manager(micro, state: Path, replicas, host_cache_bytes: int | None = None, slo: SloConfig | None = None):
    router = Router(replicas, cfg=RouterConfig(host_cache_bytes=host_cache_bytes, slo=slo or SloConfig()))
    mgr = AdapterManager(
        AdapterRegistry(state),
        router,
        BaseModelShapes.from_model_dir(micro["base"]),
        max_rank=8,
        roots=(),
        base_model_name="base",
        snapshot_root=state / SNAPSHOT_SUBDIR,
    )
    return mgr, router


def holders(replicas, int_id: int) -> list[int]:
    return [r.replica_id for r in replicas if int_id in r.loaded]


def test_unpinned_on_one_replica_pinned_on_all_and_unload_everywhere(micro, tmp_path):
    async def run():
        replicas = [ToyReplica(i) for i in range(3)]
        mgr, router = manager(micro, tmp_path / "state", replicas)
        await router.start()
        one = await mgr.register("one", str(micro["good"]))
        two = await mgr.register("two", str(micro["good"]))
        pinned = await mgr.register("pinned", str(micro["good"]), pinned=True)
        assert holders(replicas, one.int_id) == [0] and holders(replicas, two.int_id) == [1]
        assert holders(replicas, pinned.int_id) == [0, 1, 2]
        await router.load_on(2, AdapterRef("one", one.int_id, one.path))  # a request took it to replica 2
        await mgr.unregister("one")
        assert holders(replicas, one.int_id) == [] and not any(one.int_id in s.loaded for s in router.slots)
        await router.shutdown()

    asyncio.run(run())


def test_an_adapter_the_engine_refuses_is_never_recorded(micro, tmp_path):
    async def run():
        mgr, router = manager(micro, tmp_path / "state", [RefusingReplica(0), RefusingReplica(1)])
        await router.start()
        with pytest.raises(AdapterValidationError, match="^the engine refused the adapter$") as e:
            await mgr.register("bad", str(micro["good"]))
        assert e.value.described() == "the engine refused the adapter: cannot load bad"
        assert "bad" not in mgr.registry
        await router.shutdown()

    asyncio.run(run())


def test_an_adapter_larger_than_the_host_cache_budget_is_refused(micro, tmp_path):
    async def run():
        replicas = [ToyReplica(0)]
        mgr, router = manager(micro, tmp_path / "state", replicas, host_cache_bytes=1000)
        await router.start()
        with pytest.raises(AdapterValidationError, match="engine.max_cpu_lora_mib"):
            await mgr.register("big", str(micro["good"]))  # its safetensors file is well over 1000 bytes
        assert "big" not in mgr.registry and replicas[0].add_calls == 0
        await router.shutdown()

    asyncio.run(run())


def test_an_in_place_update_loads_the_new_version_where_the_old_one_is(micro, tmp_path):
    async def run():
        replicas = [ToyReplica(i) for i in range(3)]
        mgr, router = manager(micro, tmp_path / "state", replicas)
        await router.start()
        old = await mgr.register("mine", str(micro["good"]))
        await router.load_on(2, AdapterRef("mine", old.int_id, old.path))
        new = await mgr.register("mine", str(micro["good"]), inplace=True)
        assert new.version == 2 and holders(replicas, new.int_id) == [0, 2]
        for _ in range(100):  # the old version is unloaded once no request holds it
            if not holders(replicas, old.int_id):
                break
            await asyncio.sleep(0.05)
        assert holders(replicas, old.int_id) == []
        await router.shutdown()

    asyncio.run(run())
