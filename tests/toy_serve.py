"""`dlora serve` over toy replicas: the real config loading, app, uvicorn and signal handling (drain
included) in a process of its own, with `dlora.sim.toy_replica.ToyReplica`s in place of the Ray
actors and their vLLM engines. It starts in seconds, for tests of the HTTP layer where the engine is
not the subject (`harness.launch(..., toy=True)`).

    python -m tests.toy_serve --config CONFIG.yaml

Each replica generates `TOKEN_S` seconds per token, `engine.max_num_seqs` requests at once.
"""

from __future__ import annotations

import sys

from dlora import cli
from dlora.app import serve_cmd
from dlora.sim.toy_replica import ToyReplica

TOKEN_S = 0.01  # a 450-token stream takes ~5 s, as on a real tiny-model replica


async def toy_state(cfg):
    from dlora.app.state import build_state

    replicas = [
        ToyReplica(i, step_s=TOKEN_S, max_running=cfg.engine.max_num_seqs) for i in range(cfg.cluster.num_replicas)
    ]
    return await build_state(cfg, replicas=replicas)


if __name__ == "__main__":
    serve_cmd.start_state = toy_state  # the one seam: what builds the replicas
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
