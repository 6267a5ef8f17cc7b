"""A replica's weight state, unknown and restoring included, in `GET /v1/replicas` and `/metrics`,
on the real app and router over simulated replicas (no engine): one reports weights that are
being restored, as an engine does after a switch its worker did not confirm."""

from __future__ import annotations

import asyncio
import dataclasses

from dlora.config import from_dict
from dlora.replica.messages import ReplicaStats
from dlora.server.metrics import Metrics
from dlora.sim.toy_replica import ToyReplica
from tests import harness
from tests.asgi_app import app_over


class RestoringReplica(ToyReplica):
    async def stats(self) -> ReplicaStats:
        st = await super().stats()
        assert st.batching is not None
        return dataclasses.replace(
            st, batching=dataclasses.replace(st.batching, weights="restoring", weight_restores=2)
        )


def test_the_weights_of_each_replica_are_listed_and_exported(tiny_model, tmp_path):
    raw = harness.tiny_config(tiny_model, tmp_path / "state", 0)
    raw["cluster"] = {"num_replicas": 2}

    async def run():
        replicas = [ToyReplica(0), RestoringReplica(1)]
        async with app_over(from_dict(raw), replicas) as (http, state):
            await state.router.refresh_stats()  # what the balancer's loop does every interval
            listed = (await http.get("/v1/replicas")).json()["data"]
            assert [d["weights"] for d in listed] == [
                {"state": "unmerged", "adapter": None, "restores": 0},
                {"state": "restoring", "adapter": None, "restores": 2},
            ]
            text = (await http.get("/metrics")).text
            state.router.slot(1).healthy = False  # down: its engine state is not shown as current
            assert [d["weights"] for d in (await http.get("/v1/replicas")).json()["data"]][1] is None
        return text

    text = asyncio.run(run())
    for line in [
        'dlora_weight_state{replica="0",state="unmerged"} 1.0',
        'dlora_weight_state{replica="0",state="restoring"} 0.0',
        'dlora_weight_state{replica="1",state="restoring"} 1.0',
        'dlora_weight_state{replica="1",state="unknown"} 0.0',
        'dlora_weight_restores_total{replica="1"} 2.0',
    ]:
        assert line in text, line


def test_a_removed_replicas_weight_series_go():
    from dlora.replica.messages import BatchingState

    m = Metrics()
    m.batching.update("3", BatchingState("unmerged", "unmerged", None, 0, 0, {}, weights="unknown"))
    assert 'dlora_weight_state{replica="3",state="unknown"} 1.0' in m.render().decode()
    m.batching.update("3", None)
    assert 'replica="3"' not in m.render().decode()
