"""Start (or join) Ray and create the replica actors, one per core on CPU, one per GPU on a cluster."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import ray

from dlora import env
from dlora.config import DloraConfig
from dlora.engine_ext import lora_backend
from dlora.replica.ray_replica import create_replica

if TYPE_CHECKING:
    from dlora.cluster.router import Replica

log = logging.getLogger(__name__)


class RayJoinError(RuntimeError):
    """`cluster.ray_address` could not be joined; the message says why and what to do."""


def init_ray(cfg: DloraConfig) -> None:
    if ray.is_initialized():
        return
    if cfg.cluster.ray_address:
        join_ray(cfg.cluster.ray_address)
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ray.init(
        num_cpus=max(cores, cfg.cluster.num_replicas * cfg.cluster.cores_per_replica),
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


def cluster_has_gpus(n: int) -> bool:
    return ray.cluster_resources().get("GPU", 0) >= n


def replica_cores(cfg: DloraConfig) -> list[tuple[int, ...] | None]:
    """The CPU cores each replica is pinned to, `cluster.cores_per_replica` each, taken in order
    from `cluster.cpu_cores` (else this process's cores) and wrapping around (None on GPU nodes
    or unknown affinity)."""
    if cfg.cluster.cpu_cores:
        cores = list(cfg.cluster.cpu_cores)
    elif hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        return [None] * cfg.cluster.num_replicas
    k = cfg.cluster.cores_per_replica
    return [tuple(cores[(i * k + j) % len(cores)] for j in range(k)) for i in range(cfg.cluster.num_replicas)]


def create_replicas(cfg: DloraConfig, model_path: str) -> list[Replica]:
    init_ray(cfg)
    gpu = cluster_has_gpus(cfg.cluster.num_replicas)
    lora_backend.check(cfg.engine.lora_backend, gpu=gpu, enforce_eager=cfg.engine.enforce_eager)
    cores = [None] * cfg.cluster.num_replicas if gpu else replica_cores(cfg)
    log.info("creating %d replica(s) on %s", cfg.cluster.num_replicas, "GPUs" if gpu else f"cores {cores}")
    return [create_replica(i, cfg, model_path, cores[i], gpu) for i in range(cfg.cluster.num_replicas)]
