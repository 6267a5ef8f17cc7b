"""An admin load refused for a reason only the server can see into (the engine's refusal, a registry
that cannot be saved) answers with the kind of reason and a request id, never the engine's error
text or a server path; the server log has both, under that id. On the real app over toy replicas
(no engine: the engine's refusal is a toy replica's). The client's own mistakes in a load body, on
a running server: test_hostile_client.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from dataclasses import dataclass

from dlora.adapters import registry_store
from dlora.config import from_dict
from dlora.replica.messages import AdapterRef
from dlora.sim.toy_replica import ToyReplica
from tests import asgi_app, harness

SECRET = "/srv/models/.secret/lora-cache"  # what an engine's or the OS's error text may name


@dataclass
class RefusingReplica(ToyReplica):
    """An engine that refuses the adapters named `refused*`, in words naming a server path."""

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        if ref.name.startswith("refused"):
            raise RuntimeError(f"{SECRET}/{ref.name}: CUDA error: out of memory (engine core pid 4242)")
        await super().add_adapter(ref, pinned)


@contextlib.asynccontextmanager
async def app_over(tiny_model, state_dir):
    cfg = from_dict(harness.tiny_config(tiny_model, state_dir, 0))
    async with asgi_app.app_over(cfg, [RefusingReplica(0, step_s=0.001)]) as (http, _):
        yield http


def test_an_engine_refusal_names_no_engine_text(tiny_model, tmp_path, caplog):
    async def run():
        async with app_over(tiny_model, tmp_path / "state") as http:
            body = {"lora_name": "refused", "lora_path": str(tiny_model.adapters["a3"])}
            with caplog.at_level(logging.WARNING):
                r = await http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "lora_path" and err["type"] == "BadRequestError"
            assert err["message"].startswith("invalid adapter 'refused': the engine refused the adapter (request id ")
            assert SECRET not in r.text and "CUDA" not in r.text and "pid" not in r.text
            request_id = re.search(r"request id ([0-9a-f]+)", err["message"]).group(1)
            logged = [rec.getMessage() for rec in caplog.records if request_id in rec.getMessage()]
            assert logged and SECRET in logged[0] and "CUDA error" in logged[0], caplog.text
            names = {a["name"] for a in (await http.get("/v1/adapters")).json()["data"]}
            assert "refused" not in names and {"a0", "a1", "a2"} <= names

    asyncio.run(run())


def test_a_registry_that_cannot_be_saved_names_no_path(tiny_model, tmp_path, monkeypatch, caplog):
    state_dir = tmp_path / "state"
    replace = os.replace

    def full_disk(src, dst):
        """The registry file's write fails (the adapter's snapshot, written first, fits)."""
        if os.path.basename(dst) != "adapters.json":
            return replace(src, dst)
        raise OSError(28, "No space left on device", str(dst))

    async def run():
        async with app_over(tiny_model, state_dir) as http:
            monkeypatch.setattr(registry_store.os, "replace", full_disk)
            body = {"lora_name": "late", "lora_path": str(tiny_model.adapters["a3"])}
            with caplog.at_level(logging.ERROR):
                r = await http.post("/v1/load_lora_adapter", json=body)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert (
                err["message"]
                == "cannot save the adapter registry: No space left on device; the change was not applied"
            )
            assert str(state_dir) not in r.text
            assert str(state_dir) in caplog.text  # the operator learns where
            monkeypatch.undo()
            assert "late" not in {a["name"] for a in (await http.get("/v1/adapters")).json()["data"]}

    asyncio.run(run())
