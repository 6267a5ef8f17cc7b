"""`dlora serve`: load the config, start Ray + replicas, serve HTTP with uvicorn.

The command line is vLLM's where the two share a flag (`dlora serve MODEL --max-loras 8 ...`), each
such flag setting a key of the YAML config; any other `vllm serve` flag is refused by name.

Start-up failures are one line on stderr (`dlora serve: error: ...`): bad values, and a
server.host:server.port that cannot be bound (bound first, before anything slow), are refused by
`load_config`, `bind_listener` and `check_before_start` (exit 2), and anything that fails while
the replicas start is reported as a `dlora.cli.StartupError` (exit 1); the traceback is logged
at debug level (`--log-level debug`).
Once serving, SIGTERM/SIGINT drain (dlora.server.drain) and exit 0; a second signal exits 128+signal.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import socket

from dlora import config as config_mod
from dlora.app.serve_flags import add_vllm_flags, explain_unrecognized, load_config
from dlora.app.start_checks import check_before_start

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # uvicorn's default
# After the drain, uvicorn still waits this long for connections to close (keep-alive ones are
# closed at once; every request has ended by then).
SHUTDOWN_GRACE_S = 5


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Start Ray, the replica engines and the HTTP server. Takes vLLM's `vllm serve` flags that "
        "dlora shares (docs/configuration.md); any other vLLM flag is refused by name.",
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="model directory or auto:<name>, as --model")
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    add_vllm_flags(p.add_argument_group("vLLM's flags", "the `vllm serve` flags dlora takes"))
    p.add_argument("--kv-cache-space-gib", dest="engine.kv_cache_space_gib", type=int)
    p.add_argument("--num-kv-blocks", dest="engine.num_kv_blocks", type=int)
    p.add_argument("--num-replicas", dest="cluster.num_replicas", type=int)
    p.add_argument("--ray-address", dest="cluster.ray_address")
    p.add_argument("--admin-token", dest="server.admin_token")
    p.add_argument("--state-dir", dest="server.state_dir")
    own = frozenset(option for action in p._actions for option in action.option_strings)
    p.set_defaults(func=run, explain_unrecognized=functools.partial(explain_unrecognized, own=own))


def describe_failure(e: BaseException) -> str:
    """An exception as one line: Ray's wrapper replaced by the replica's own exception, each
    `raise ... from` cause appended."""
    from ray.exceptions import RayTaskError

    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, RayTaskError) and cur.cause is not None:
            cur = cur.cause  # its str() is the remote traceback
            continue
        text = " ".join(str(cur).split())
        part = f"{type(cur).__name__}: {text}" if text else type(cur).__name__
        if part not in parts:
            parts.append(part)
        cur = cur.__cause__
    return "; caused by ".join(parts)


async def start_state(cfg: config_mod.DloraConfig):
    """Build the server state (replicas up, adapters loaded); a failure becomes a one-line StartupError."""
    from dlora.app.state import build_state
    from dlora.cli import StartupError

    try:
        return await build_state(cfg)
    except Exception as e:
        log.debug("start-up failed", exc_info=True)
        hint = "" if log.isEnabledFor(logging.DEBUG) else " (--log-level debug logs the traceback)"
        raise StartupError(f"start-up failed: {describe_failure(e)}{hint}") from e


def bind_listener(host: str, port: int) -> socket.socket:
    """Take server.host:server.port now, before Ray and the replicas start (a minute), so a port in
    use is one line at once rather than uvicorn's [Errno 98] after the replicas loaded, and nobody
    can take the port meanwhile. Connections made while the replicas start wait in the backlog."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ]
    except socket.gaierror as e:
        raise config_mod.ConfigError(f"server.host={host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    # As asyncio's create_server does: a restart must not wait for the last run's TIME_WAIT connections.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise config_mod.ConfigError(
                f"server.port={port}: address already in use on {host} (another process listens there; "
                "choose another with --port)"
            ) from None
        raise config_mod.ConfigError(
            f"server.host={host!r}, server.port={port}: cannot listen there ({e.strerror})"
        ) from None
    return sock


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    listener = bind_listener(cfg.server.host, cfg.server.port)
    try:
        cfg = check_before_start(cfg)
    except BaseException:
        listener.close()
        raise
    # Imported only now: the app pulls in vLLM (seconds), and a bad value is refused without it.
    import uvicorn

    from dlora.app.asgi import create_app
    from dlora.server.drain import Drain
    from dlora.server.draining_server import DrainingServer

    logging.basicConfig(level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The state is built before uvicorn starts rather than in the app's lifespan, where uvicorn would
    # log a failure's whole traceback; from here on the lifespan owns it (closes it at shutdown).
    built: list = []

    async def state():
        return built[0]

    drain = Drain(cfg.server.drain_timeout_s)
    server = DrainingServer(
        uvicorn.Config(
            create_app(state, drain),
            host=cfg.server.host,
            port=cfg.server.port,
            log_level=cfg.server.log_level,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        ),
        drain,
    )

    async def main() -> None:
        built.append(await start_state(cfg))
        await server.serve(sockets=[listener])

    try:  # Ctrl-C while the replicas start is a KeyboardInterrupt (uvicorn's handlers come later)
        with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
            runner.run(main())
    finally:
        listener.close()
    return server.exit_code if server.started else 3  # uvicorn.run's exit code when the server did not start
