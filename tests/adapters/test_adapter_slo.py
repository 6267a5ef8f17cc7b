"""An adapter's SLO is part of its registration: persisted with it, restored at start (config and
admin-API adapters), kept by an in-place update unless a new one is given, told to the router's
accounting, and dropped from it on unregistration (router over simulated replicas)."""

from __future__ import annotations

import asyncio
import json

from dlora.adapters.lifecycle import ref_of
from dlora.adapters.registry import AdapterRegistry, parse_records
from dlora.adapters.validate import AdapterInfo
from dlora.config import AdapterSpec
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.sim.toy_replica import ToyReplica
from dlora.slo.config import AdapterSlo
from tests.adapters.test_registration_placement import manager

INFO = AdapterInfo(path="/x/a", rank=8, alpha=16.0, target_modules=("q_proj",), size_bytes=10)
OWN = AdapterSlo(ttft_s=0.5, tpot_s=0.05)


def test_the_slo_is_saved_with_the_registration_and_read_back(tmp_path):
    reg = AdapterRegistry(tmp_path)
    reg.load_persisted()
    reg.add("own", INFO, slo=OWN)
    reg.add("default", INFO)
    saved = {a["name"]: a for a in json.loads((tmp_path / "adapters.json").read_text())["adapters"]}
    assert saved["own"]["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05} and saved["default"]["slo"] is None
    again = {r.name: r.slo for r in AdapterRegistry(tmp_path).load_persisted()}
    assert again == {"own": OWN, "default": None}


def test_entries_saved_before_slos_existed_load_and_a_bad_slo_is_refused_by_name():
    entry = {"name": "a", "int_id": 1, "path": "/x", "rank": 8, "alpha": 16.0, "target_modules": ["q_proj"]}
    entry |= {"size_bytes": 1, "pinned": False, "source": "api", "version": 1}
    bad = {**entry, "name": "b", "int_id": 2, "slo": {"ttft_s": -1, "tpot_s": 0.1}}
    records, problems = parse_records([entry, bad])
    assert [(r.name, r.slo) for r in records] == [("a", None)]
    assert problems == ["adapters[1]: slo.ttft_s=-1: must be a finite number of seconds > 0"]


async def _serve_one(router, rec) -> None:
    req = GenerateRequest(f"r-{rec.name}", (1, 2, 3), SamplingSpec(max_tokens=3), ref_of(rec))
    async for _ in router.generate(req):
        pass


def test_registration_update_restart_and_unload_carry_the_slo_to_the_router(micro, tmp_path):
    async def run():
        state = tmp_path / "state"
        mgr, router = manager(micro, state, [ToyReplica(0)])
        await router.start()
        rec = await mgr.register("own", str(micro["good"]), slo=OWN)
        await mgr.register("plain", str(micro["good"]))
        assert rec.slo == OWN and router.slo.target("own") == OWN and router.slo.target("plain") is None

        kept = await mgr.register("own", str(micro["good"]), inplace=True)  # no slo: the old one stays
        assert (kept.version, kept.slo, router.slo.target("own")) == (2, OWN, OWN)
        newer = AdapterSlo(ttft_s=2.0, tpot_s=0.2)
        changed = await mgr.register("own", str(micro["good"]), inplace=True, slo=newer)
        assert (changed.version, changed.slo, router.slo.target("own")) == (3, newer, newer)
        given = await mgr.register("plain", str(micro["good"]), inplace=True, slo=OWN)
        assert router.slo.target("plain") == given.slo == OWN
        await router.shutdown()

        # A restart: the admin-API adapters come back with their SLOs, the config's with theirs.
        mgr, router = manager(micro, state, [ToyReplica(0)])
        await router.start()
        spec = AdapterSpec("from_config", str(micro["good"]), slo={"ttft_s": 1, "tpot_s": 0.1})
        assert await mgr.restore([spec]) == []
        assert router.slo.target("own") == newer and router.slo.target("plain") == OWN
        assert router.slo.target("from_config") == AdapterSlo(1, 0.1)
        assert mgr.registry.get("own").slo == newer

        await _serve_one(router, mgr.lookup("own"))
        await _serve_one(router, mgr.lookup("plain"))
        assert set(router.slo.counts()) == {"own", "plain"}
        await mgr.unregister("own")
        assert set(router.slo.counts()) == {"plain"} and router.slo.target("own") is None
        await router.shutdown()

    asyncio.run(run())
