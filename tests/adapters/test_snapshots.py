"""Replicas are given an immutable snapshot of each validated adapter, never its source directory:
a source changed or deleted after registration cannot reach an engine, and a damaged snapshot
fails only its own adapter (router over simulated replicas; the real server: tests/server)."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dlora.adapters import snapshot
from dlora.adapters.lifecycle import SNAPSHOT_SUBDIR, AdapterManager, AdapterUnavailableError
from dlora.adapters.registry import AdapterRegistry
from dlora.adapters.validate import AdapterValidationError, BaseModelShapes
from dlora.cluster.router import Router
from dlora.config import AdapterSpec
from dlora.replica.messages import AdapterRef
from dlora.sim.toy_replica import ToyReplica


@dataclass
class PathRecordingReplica(ToyReplica):
    paths: list[str] = field(default_factory=list)

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        self.paths.append(ref.path)
        await super().add_adapter(ref, pinned)


@pytest.fixture
def source(micro, tmp_path):
    d = tmp_path / "roots" / "mine"
    shutil.copytree(micro["good"], d)
    return d


def manager(micro, state: Path, roots: tuple[str, ...] = ()):
    replica = PathRecordingReplica(0)
    router = Router([replica])
    mgr = AdapterManager(
        AdapterRegistry(state),
        router,
        BaseModelShapes.from_model_dir(micro["base"]),
        max_rank=8,
        roots=roots,
        base_model_name="base",
        snapshot_root=None if state is None else state / SNAPSHOT_SUBDIR,
    )
    return mgr, router, replica


def test_replicas_get_a_verified_read_only_copy_that_outlives_the_source(micro, source, tmp_path):
    async def run():
        mgr, router, replica = manager(micro, tmp_path / "state", roots=(str(source.parent),))
        await router.start()
        rec = await mgr.register("mine", str(source))
        snap = Path(rec.path)
        assert snap.parent == tmp_path / "state" / "adapters" and snap.name.startswith("mine-")
        assert replica.paths == [rec.path]
        for f in snapshot.SNAPSHOT_FILES:
            assert (snap / f).read_bytes() == (source / f).read_bytes()
            assert not os.stat(snap / f).st_mode & 0o222  # read-only
        assert snapshot.verify(snap)
        shutil.rmtree(source)  # the source goes away: the adapter is still served from its copy
        assert mgr.lookup("mine").path == rec.path
        await router.shutdown()

    asyncio.run(run())


def test_a_damaged_snapshot_fails_only_its_own_adapter(micro, source, tmp_path):
    async def run():
        mgr, router, _ = manager(micro, tmp_path / "state")
        await router.start()
        rec = await mgr.register("mine", str(source))
        other = await mgr.register("other", str(micro["good"]))
        weights = Path(rec.path) / snapshot.WEIGHTS_FILE
        os.chmod(weights, 0o644)
        weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
        with pytest.raises(AdapterUnavailableError):
            mgr.lookup("mine")
        assert mgr.lookup("other") == other
        assert [r.name for r in mgr.pinned_refs()] == []
        shutil.rmtree(rec.path)
        with pytest.raises(AdapterUnavailableError):
            mgr.lookup("mine")
        await router.shutdown()

    asyncio.run(run())


def test_restart_reuses_intact_snapshots_refuses_damaged_ones_and_prunes_the_rest(micro, source, tmp_path):
    state = tmp_path / "state"

    async def first_run():
        mgr, router, _ = manager(micro, state)
        await router.start()
        kept = await mgr.register("kept", str(source))
        damaged = await mgr.register("damaged", str(source))
        gone = await mgr.register("gone", str(source))
        await mgr.unregister("gone")
        await router.shutdown()
        return kept, damaged, gone

    kept, damaged, gone = asyncio.run(first_run())
    assert Path(gone.path).is_dir()  # an unloaded adapter's copy stays until the next start
    shutil.rmtree(source)  # persisted adapters are restored from their snapshots, not their sources
    cfg = Path(damaged.path) / snapshot.CONFIG_FILE
    os.chmod(cfg, 0o644)
    cfg.write_text(cfg.read_text().replace('"r": 4', '"r": 4 '))  # still valid, but not what was checked
    (state / "adapters" / ".staging-leftover").mkdir()

    async def second_run():
        mgr, router, _ = manager(micro, state)
        await router.start()
        problems = await mgr.restore([])
        assert [r.name for r in mgr.registry.all()] == ["kept"]
        assert mgr.lookup("kept").path == kept.path
        assert len(problems) == 1 and "damaged" in problems[0] and "does not match its manifest" in problems[0]
        await router.shutdown()

    asyncio.run(second_run())
    assert sorted(p.name for p in (state / "adapters").iterdir()) == [Path(kept.path).name]


def test_config_adapters_are_snapshotted_too(micro, source, tmp_path):
    async def run():
        mgr, router, _ = manager(micro, tmp_path / "state")
        await router.start()
        problems = await mgr.restore([AdapterSpec(name="cfg", path=str(source))])
        assert problems == []
        assert snapshot.is_snapshot_path(mgr.lookup("cfg").path, tmp_path / "state" / "adapters")
        await router.shutdown()

    asyncio.run(run())


def test_bad_files_leave_no_snapshot_behind(micro, source, tmp_path):
    async def run():
        mgr, router, _ = manager(micro, tmp_path / "state")
        await router.start()
        (source / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}')
        with pytest.raises(AdapterValidationError, match="lora_alpha"):
            await mgr.register("bad", str(source))
        (source / "adapter_config.json").unlink()
        with pytest.raises(AdapterValidationError, match="adapter_config.json not found"):
            await mgr.register("bad", str(source))
        assert "bad" not in mgr.registry
        assert list((tmp_path / "state" / "adapters").iterdir()) == []
        await router.shutdown()

    asyncio.run(run())


def test_without_a_state_dir_the_source_is_served(micro, source):
    async def run():
        mgr, router, replica = manager(micro, None)
        await router.start()
        rec = await mgr.register("mine", str(source))
        assert rec.path == str(source.resolve()) and replica.paths == [rec.path]
        await router.shutdown()

    asyncio.run(run())
