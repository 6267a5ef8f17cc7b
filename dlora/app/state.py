"""The server state as `dlora serve` and `dlora batch run` run it: the server's, with the batch
service built on it."""

from __future__ import annotations

from collections.abc import Callable

from dlora.batch.execute import server_batches
from dlora.cluster.router import Replica
from dlora.config import DloraConfig
from dlora.server import state as server_state
from dlora.server.state import ServerState


async def build_state(
    cfg: DloraConfig,
    replicas: list[Replica] | None = None,
    make_replica: Callable[[int], Replica] | None = None,
) -> ServerState:
    """`dlora.server.state.build_state` with /v1/files and /v1/batches served from the state."""
    return await server_state.build_state(cfg, replicas, make_replica, batches=server_batches)
