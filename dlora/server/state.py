"""Everything a request handler needs, built once at server start."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dlora.adapters.lifecycle import SNAPSHOT_SUBDIR, AdapterManager, ref_of
from dlora.adapters.registry import AdapterRegistry
from dlora.adapters.resolver import AdapterResolver, FilesystemResolver
from dlora.adapters.resolver_s3 import S3Resolver
from dlora.adapters.validate import BaseModelShapes
from dlora.cluster.balancer import Balancer
from dlora.cluster.elastic import ElasticCluster
from dlora.cluster.from_config import router_config
from dlora.cluster.router import Replica, Router
from dlora.config import DloraConfig
from dlora.replica.messages import AdapterRef
from dlora.server.admission import InFlight
from dlora.server.metrics import Metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dlora.server.vllm_frontend import Frontend

log = logging.getLogger(__name__)


class Service(Protocol):
    """Work a layer above the server builds on its state (the batch service, dlora/batch/): started
    with the state's background tasks and closed with it. Why a protocol: the server's handlers run
    batch lines, so the batch package imports the server, never the other way."""

    def start(self) -> None: ...

    async def close(self) -> None: ...


@dataclass
class ServerState:
    cfg: DloraConfig
    model_path: str
    base_model_name: str
    tokenizer: PreTrainedTokenizerBase
    router: Router
    adapters: AdapterManager
    metrics: Metrics
    balancer: Balancer
    # The autoscaler's controller (`cluster.autoscale`); None: a fixed replica count.
    elastic: ElasticCluster | None = None
    # /v1/files and /v1/batches (built on the state by build_state's `batches`: lines run through it).
    batches: Service | None = None
    # vLLM's serving classes over this state (set by build_state: the routes and batch lines use it).
    frontend: Frontend | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Online completions admitted and not yet answered: admission counts them against
    # server.max_pending_requests, and the batch gate fits batch work in the room they leave.
    admitted: InFlight = field(default_factory=InFlight)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    def start_background(self) -> None:
        self._tasks.append(asyncio.create_task(self.balancer.run()))
        if self.elastic is not None:
            self._tasks.append(asyncio.create_task(self.elastic.run()))
        if self.batches is not None:
            self.batches.start()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.batches is not None:
            await self.batches.close()
        if self.elastic is not None:
            await self.elastic.close()
        await self.router.shutdown()

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.cfg.model.max_model_len


def base_model_name(cfg: DloraConfig, model_path: str) -> str:
    return cfg.model.served_name or Path(model_path).name


def adapter_resolvers(cfg: DloraConfig) -> tuple[AdapterResolver, ...]:
    """Where a request's unregistered adapter name is looked up, in order (none unless enabled)."""
    if not cfg.server.resolve_adapters:
        return ()
    found: list[AdapterResolver] = [FilesystemResolver(cfg.server.adapter_roots)]
    if cfg.server.adapter_s3_uri is not None:
        download_root = cfg.state_dir / "resolved"
        found.append(S3Resolver(cfg.server.adapter_s3_uri, cfg.server.adapter_s3_endpoint_url, download_root))
    return tuple(found)


async def build_state(
    cfg: DloraConfig,
    replicas: list[Replica] | None = None,
    make_replica: Callable[[int], Replica] | None = None,
    batches: Callable[[ServerState], Service] | None = None,
) -> ServerState:
    """Prepare the model, start the replicas, and register the configured and persisted adapters.
    `replicas` (and, with autoscaling, `make_replica`) stand in for the Ray actors; `batches` builds
    the batch service on the state (dlora.app.state passes dlora/batch's)."""
    from transformers import AutoTokenizer

    from dlora.cluster.launcher import ReplicaFactory, create_replicas
    from dlora.models.smollm2 import resolve_model_path
    from dlora.server import vllm_frontend

    model_path = resolve_model_path(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    name = base_model_name(cfg, model_path)
    release: Callable[[int], None] = lambda replica_id: None  # noqa: E731
    if replicas is None:
        factory = ReplicaFactory(cfg, model_path)
        replicas = create_replicas(cfg, model_path, factory)
        make_replica, release = factory.make, factory.release
    manager_box: list[AdapterManager] = []
    router = Router(
        replicas,
        cfg=router_config(cfg),
        pinned_adapters=lambda: manager_box[0].pinned_refs(),
    )
    adapters = AdapterManager(
        registry=AdapterRegistry(cfg.state_dir),
        router=router,
        base=BaseModelShapes.from_model_dir(model_path),
        max_rank=cfg.engine.max_lora_rank,
        roots=cfg.server.adapter_roots,
        base_model_name=name,
        max_pinned=cfg.engine.max_cpu_loras - cfg.engine.max_loras,
        snapshot_root=cfg.state_dir / SNAPSHOT_SUBDIR,
        resolvers=adapter_resolvers(cfg),
    )
    manager_box.append(adapters)
    await router.start()
    for problem in await adapters.restore(cfg.adapters):
        log.error("%s", problem)
    metrics = Metrics()
    adapters.on_resolve = lambda outcome: metrics.adapters_resolved.labels(outcome).inc()
    router.queue_times.observer = metrics.observe_queue_time

    def on_round(r) -> None:
        metrics.migration_solve.observe(r.plan.solve_ms / 1000)
        metrics.migration_rounds.labels(r.trigger.reason).inc()

    balancer = Balancer(
        router,
        adapter_ref=lambda n: ref_of(adapters.lookup(n)),
        cfg=cfg.cluster,
        on_round=on_round,
        on_preload=lambda p: metrics.preloads.inc(len(p.loads)),
    )
    elastic = None
    autoscale = cfg.cluster.autoscale
    if autoscale is not None:
        if make_replica is None:
            raise ValueError("cluster.autoscale needs a way to make replicas (make_replica)")

        def hot_adapters() -> list[AdapterRef]:
            """What a new replica preloads: the adapters most requested over the rate window."""
            rates = router.adapter_rates(autoscale.rate_window_s)
            hottest = sorted(rates, key=lambda a: (-rates[a], a))[: cfg.engine.max_loras]
            return list(balancer.registered_refs(hottest).values())

        elastic = ElasticCluster(
            router,
            autoscale,
            make_replica,
            release,
            preload=hot_adapters,
            tick_s=cfg.cluster.monitor_interval_s,
            on_event=metrics.observe_scale_event,
        )
    state = ServerState(cfg, model_path, name, tokenizer, router, adapters, metrics, balancer, elastic)
    state.frontend = vllm_frontend.build(state)
    state.batches = batches(state) if batches is not None else None
    state.start_background()
    log.info("serving %s with %d adapter(s) on %d replica(s)", name, len(adapters.registry), len(router.slots))
    return state
