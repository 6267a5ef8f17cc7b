"""Start (or join) Ray and create the replica actors, one per core on CPU, one per GPU on a cluster."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

from dlora import env
from dlora.config import DloraConfig
from dlora.engine_ext import lora_backend
from dlora.replica.model_manifest import manifest_of
from dlora.replica.ray_replica import create_replica

if TYPE_CHECKING:
    from dlora.cluster.router import Replica

log = logging.getLogger(__name__)


OOM_POLICY_ENV = "RAY_worker_killing_policy_by_group"


class RayJoinError(RuntimeError):
    """`cluster.ray_address` could not be joined; the message says why and what to do."""


def init_ray(cfg: DloraConfig) -> None:
    if ray.is_initialized():
        return
    if cfg.cluster.ray_address:
        join_ray(cfg.cluster.ray_address)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # When the host runs short of memory, Ray's memory monitor kills workers. Its default policy
    # (Ray 2.56+) may kill several at once, and replicas are long-lived workers started together:
    # every replica went at the same instant and nothing was left to serve. One at a time frees a
    # replica's memory while the others serve its requests. Read by the raylet when it starts.
    os.environ.setdefault(OOM_POLICY_ENV, "true")
    ray.init(
        num_cpus=max(cores, most_replicas(cfg) * cfg.cluster.cores_per_replica),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=env.DLORA_RAY_TEMP_DIR.get(),
        log_to_driver=True,
    )


def join_ray(address: str) -> None:
    log.info("joining Ray cluster at %s", address)
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        log.debug("joining the Ray cluster at %s failed", address, exc_info=True)
        raise RayJoinError(join_failure(address, e)) from None  # Ray's chain holds whole tracebacks as text


def join_failure(address: str, e: BaseException) -> str:
    """One line: which setting, and why joining failed. `ray start` clusters use token
    authentication by default, and Ray reports a missing token deep inside a connection error."""
    chain: list[str] = []
    cur: BaseException | None = e
    while cur is not None and len(chain) < 8:
        chain.append(str(cur))
        cur = cur.__cause__ or cur.__context__
    if any("InvalidAuthToken" in text or "AuthenticationError" in text for text in chain):
        why = (
            "the cluster uses token authentication and this process has no matching token: run dlora with "
            "RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        )
    else:
        first = next(iter(str(e).strip().splitlines()), "")
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return f"cluster.ray_address={address!r}: could not join the Ray cluster: {why}"


def most_replicas(cfg: DloraConfig) -> int:
    """The most replicas the cluster may run at once (autoscaling's max_replicas, else num_replicas)."""
    a = cfg.cluster.autoscale
    return max(cfg.cluster.num_replicas, a.max_replicas if a is not None else 0)


def cluster_has_gpus(n: int) -> bool:
    return ray.cluster_resources().get("GPU", 0) >= n


def replica_cores(cfg: DloraConfig, replicas: int | None = None) -> list[tuple[int, ...] | None]:
    """The CPU cores each of the first `replicas` (default num_replicas) replicas is pinned to,
    `cluster.cores_per_replica` each, taken in order from `cluster.cpu_cores` (else this
    process's cores) and wrapping around (None on GPU nodes or unknown affinity)."""
    n = cfg.cluster.num_replicas if replicas is None else replicas
    if cfg.cluster.cpu_cores:
        cores = list(cfg.cluster.cpu_cores)
    elif hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        return [None] * n
    k = cfg.cluster.cores_per_replica
    return [tuple(cores[(i * k + j) % len(cores)] for j in range(k)) for i in range(n)]


class ReplicaFactory:
    """Makes replica actors on the Ray cluster (not started): the initial ones, and the ones
    autoscaling adds. On CPU each takes the cores of the lowest position (0, 1, ...) no live
    replica holds, so a replica added after another was removed gets the freed cores; `release`
    says a replica is gone."""

    def __init__(self, cfg: DloraConfig, model_path: str) -> None:
        init_ray(cfg)
        self.cfg, self.model_path = cfg, model_path
        # What every replica checks its node's model directory against (model_manifest.py)
        self.model = manifest_of(model_path)
        self.gpu = cluster_has_gpus(cfg.cluster.num_replicas)
        lora_backend.check(cfg.engine.lora_backend, gpu=self.gpu, enforce_eager=cfg.engine.enforce_eager)
        self.positions: dict[int, int] = {}  # live replica id -> its position

    def make(self, replica_id: int) -> Replica:
        position = min(set(range(len(self.positions) + 1)) - set(self.positions.values()))
        self.positions[replica_id] = position
        cores = None if self.gpu else replica_cores(self.cfg, position + 1)[position]
        names = self.cfg.cluster.replica_resources
        resource = names[position % len(names)] if names else None
        log.info(
            "creating replica %d on %s%s",
            replica_id,
            "a GPU" if self.gpu else f"cores {cores}",
            f", on a node with Ray resource {resource!r}" if resource else "",
        )
        return create_replica(replica_id, self.cfg, self.model_path, cores, self.gpu, resource, self.model)

    def release(self, replica_id: int) -> None:
        self.positions.pop(replica_id, None)


def create_replicas(cfg: DloraConfig, model_path: str, factory: ReplicaFactory | None = None) -> list[Replica]:
    factory = factory or ReplicaFactory(cfg, model_path)
    return [factory.make(i) for i in range(cfg.cluster.num_replicas)]
