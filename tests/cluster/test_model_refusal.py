"""A replica whose node lacks the server's model directory refuses to start (ModelMismatch); the
router starts with the others, serves on them and gives up rebuilding it after its attempts; if
every replica refuses, the start fails with the refusal (in-process replicas)."""

from __future__ import annotations

import asyncio

import pytest

from dlora.cluster.router import Router, RouterConfig
from dlora.replica.messages import GenerateRequest, SamplingSpec
from dlora.replica.model_manifest import ModelMismatch
from dlora.sim.toy_replica import ToyReplica, reference_tokens

REFUSAL = "node 10.0.0.3 (node cd): model directory /models/m: it is missing; this replica does not start"


class WrongNode(ToyReplica):
    async def start(self) -> None:
        self.started += 1
        raise ModelMismatch(REFUSAL)


def test_the_other_replicas_serve_and_the_refusing_one_is_given_up(caplog):
    async def run():
        refusing = WrongNode(1)
        router = Router(
            [ToyReplica(0), refusing],
            cfg=RouterConfig(dispatch="least_loaded", max_restart_attempts=2, recovery_grace_s=0.05),
        )
        await router.start()
        assert [s.healthy for s in router.slots] == [True, False]
        for i in range(3):
            req = GenerateRequest(f"r{i}", (1, 2, 3), SamplingSpec(max_tokens=5), None)
            assert [t async for d in router.generate(req) for t in d.token_ids] == reference_tokens(None, (1, 2, 3), 5)
        deadline = asyncio.get_running_loop().time() + 10
        while not router.slots[1].gave_up:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        assert refusing.started >= 2
        await router.shutdown()

    asyncio.run(run())
    assert f"replica 1 did not start: {REFUSAL}" in caplog.text


def test_when_every_replica_refuses_the_start_fails_with_the_refusal():
    async def run():
        router = Router([WrongNode(0), WrongNode(1)], cfg=RouterConfig())
        with pytest.raises(ModelMismatch, match="model directory /models/m: it is missing"):
            await router.start()
        await router.shutdown()

    asyncio.run(run())
