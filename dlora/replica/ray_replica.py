"""A replica as a Ray actor, and the handle the router uses to talk to it.

The actor builds its engine in an explicit `start()` (not `__init__`) so the controller can
rebuild it in place after the engine dies, and Ray restarts the process after a hard crash
(`max_restarts`); in both cases the router resubmits the replica's requests elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from dlora import env as dlora_env
from dlora.config import DloraConfig
from dlora.replica.engine import EngineHost
from dlora.replica.errors import AdapterUnavailable, ReplicaFailure, RequestRejected
from dlora.replica.messages import AdapterRef, BatchingState, Delta, GenerateRequest, ReplicaStats
from dlora.replica.model_manifest import ModelManifest, ModelMismatch
from dlora.replica.model_manifest import check as check_model
from dlora.replica.output_mux import OutputDemux, OutputMux, StreamError

log = logging.getLogger(__name__)


@ray.remote
class ReplicaActor:
    def __init__(
        self,
        replica_id: int,
        cfg: DloraConfig,
        model_path: str,
        cores: tuple[int, ...] | None,
        model: ModelManifest | None = None,
    ):
        self.replica_id = replica_id
        self.cores = cores
        self.model = model  # the server's view of the model directory, checked on this node at start
        self.host = EngineHost(cfg, model_path, node=node_name())
        self.mux = OutputMux()
        self._running: set[asyncio.Task] = set()
        # The newest engine sample (engine_ext/samples.py) the stats reads have passed on: each
        # read carries the samples after it, so the router gets every one once.
        self._samples_seen = 0

    async def start(self) -> int:
        self.host.shutdown()
        await asyncio.to_thread(check_model, self.host.model_path, self.model, self.host.node)
        self._samples_seen = 0  # a new engine numbers its samples from 1
        cores = self.cores if hasattr(os, "sched_setaffinity") else None  # None: no pinning
        previous = os.sched_getaffinity(0) if cores is not None else None
        if cores is not None:
            # The engine-core process inherits this thread's affinity when it is spawned ...
            os.sched_setaffinity(0, set(cores))
        try:
            await self.host.start()
        finally:
            if previous is not None:
                # ... but this thread then runs vLLM's output handling (detokenising, streaming),
                # which must not compete with the model on its core.
                os.sched_setaffinity(0, previous)
        return os.getpid()

    async def submit(self, req: GenerateRequest) -> None:
        """Start `req`; its deltas leave through `outputs`, with every other request's."""
        task = asyncio.create_task(self._run(req))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, req: GenerateRequest) -> None:
        try:
            async for delta in self.host.generate(req):
                self.mux.put(req.request_id, delta)
        except Exception as e:
            self.mux.put(req.request_id, stream_error(e))

    async def outputs(self):
        """The replica's one output stream (Ray streaming): each item is a Batch of every delta ready."""
        async for batch in self.mux.batches():
            yield batch

    async def abort(self, request_id: str) -> None:
        await self.host.abort(request_id)

    async def add_adapter(self, ref: AdapterRef, pinned: bool) -> None:
        await self.host.add_adapter(ref, pinned)

    async def remove_adapter(self, int_id: int) -> bool:
        return await self.host.remove_adapter(int_id)

    async def stats(self) -> ReplicaStats:
        await self.host.check_health()
        return ReplicaStats(
            replica_id=self.replica_id,
            num_unfinished=self.host.num_unfinished(),
            resident_adapter_ids=await self.host.resident_adapter_ids(),
            batching=await self._batching_state(),
            device_adapter_ids=await self._device_adapter_ids(),
        )

    async def ping(self) -> None:
        """Answers at once, between engine steps or during one (the engine core is its own
        process): raises only if the engine died or was never started."""
        await self.host.check_health()

    async def _device_adapter_ids(self) -> list[int]:
        try:
            return await self.host.device_adapter_ids()
        except Exception as e:  # /v1/adapters and metrics only: a failed read must not fail the replica
            log.warning("replica %d: cannot read the LoRA device slots: %s", self.replica_id, e)
            return []

    async def _batching_state(self) -> BatchingState | None:
        try:
            state = await self.host.batching_state(self._samples_seen)
        except Exception as e:  # metrics only: a failed read must not make the replica look dead
            log.warning("replica %d: cannot read the batching state: %s", self.replica_id, e)
            return None
        self._samples_seen = state.samples_seq
        return state

    async def shutdown(self) -> None:
        self.host.shutdown()


def node_name() -> str:
    """This process's Ray node, as errors name it: its IP and the start of its node id."""
    return f"{ray.util.get_node_ip_address()} (node {ray.get_runtime_context().get_node_id()[:12]})"


def _engine_dead_error() -> type[BaseException]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def _client_error() -> type[BaseException]:
    from vllm.exceptions import VLLMClientError

    return VLLMClientError


def _kills_replica(cause: BaseException) -> bool:
    """Raised inside a replica, `cause` means the replica failed: a ReplicaFailure of its own
    (EngineNotStarted: Ray restarted the process, which has no engine until start() runs again) or
    vLLM's engine died. By type only: a request's own error text must never make a healthy replica
    look dead."""
    return isinstance(cause, (ReplicaFailure, _engine_dead_error()))


def _rejected(cause: BaseException) -> RequestRejected | None:
    """vLLM refused the request's own values (it raises ValueError/TypeError or its client errors
    while checking a request's inputs): the request fails alone with that message, the replica is fine."""
    if _kills_replica(cause) or not isinstance(cause, (ValueError, TypeError, _client_error())):
        return None
    param = getattr(cause, "parameter", None) or getattr(cause, "param", None)
    return RequestRejected(str(cause), param if isinstance(param, str) else None)


def stream_error(e: BaseException) -> StreamError:
    """A request's error inside the replica, as plain data for the output stream."""
    if isinstance(e, AdapterUnavailable):
        return StreamError("adapter_unavailable", e.why, e.name, e.node)
    if _kills_replica(e):
        return StreamError("replica_failure", f"{type(e).__name__}: {e}")
    rejected = _rejected(e)
    if rejected is not None:
        return StreamError("rejected", rejected.message, rejected.param)
    return StreamError("error", f"{type(e).__name__}: {e}")


def _is_replica_failure(e: BaseException) -> bool:
    """The actor died or is unreachable, or a call to it raised what `_kills_replica` names."""
    if isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError, ReplicaFailure)):
        return True
    return isinstance(e, RayTaskError) and _kills_replica(e.cause)


class RayReplica:
    """Router-side handle: async generator over Deltas, failures surfaced as ReplicaFailure."""

    def __init__(self, replica_id: int, actor):
        self.replica_id = replica_id
        self.actor = actor
        self.demux = OutputDemux()
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        await self._call(self.actor.start.remote())

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        self._ensure_reader()
        queue = self.demux.open(req.request_id)
        finished = False
        try:
            await self._call(self.actor.submit.remote(req))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamError):
                    raise item.exception(self.replica_id)
                finished = item.finished
                yield item
        finally:
            self.demux.close(req.request_id)
            if not finished:
                # Client went away or the router gave up: stop the work inside the engine. No
                # await here: this runs while the task is being cancelled.
                self.actor.abort.remote(req.request_id)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self.demux.epoch += 1
            self._reader = asyncio.create_task(self._read_outputs(self.demux.epoch))

    async def _read_outputs(self, epoch: int) -> None:
        """Sort the replica's output stream into its requests' queues; when the stream breaks (the
        actor died), every request it carried fails as a replica failure and is resubmitted."""
        try:
            async for ref in self.actor.outputs.options(num_returns="streaming").remote():
                self.demux.deliver(await ref)
            failure: BaseException = ReplicaFailure(f"replica {self.replica_id}: its output stream ended")
        except asyncio.CancelledError:
            failure = ReplicaFailure(f"replica {self.replica_id}: its output stream was closed")
            raise
        except Exception as e:  # the actor died, or Ray lost the stream: either way its requests are gone
            failure = ReplicaFailure(f"replica {self.replica_id}: output stream failed: {e}")
        finally:
            self.demux.fail_epoch(epoch, failure)

    async def abort(self, request_id: str) -> None:
        await self._call(self.actor.abort.remote(request_id))

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        await self._call(self.actor.add_adapter.remote(ref, pinned))

    async def remove_adapter(self, int_id: int) -> bool:
        return await self._call(self.actor.remove_adapter.remote(int_id))

    async def stats(self) -> ReplicaStats:
        return await self._call(self.actor.stats.remote())

    async def ping(self) -> None:
        await self._call(self.actor.ping.remote())

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        try:
            await asyncio.wait_for(self.actor.shutdown.remote(), timeout=30)
        except Exception:
            pass
        ray.kill(self.actor, no_restart=True)

    async def _call(self, ref):
        try:
            return await ref
        except Exception as e:
            if isinstance(e, RayTaskError) and isinstance(e.cause, (AdapterUnavailable, ModelMismatch)):
                # the router tries another replica for that adapter / serves on the other replicas
                raise e.cause from None
            if _is_replica_failure(e):
                raise ReplicaFailure(f"replica {self.replica_id}: {e}") from e
            raise


def replica_runtime_env(cfg: DloraConfig) -> dict:
    """Environment for a replica process: vLLM's CPU knobs that must be set before import."""
    env = {
        # Worker inside the engine-core process: one process less, ~620 MiB and ~9 s saved.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.engine.kv_cache_space_gib),
        # We pin the cores ourselves; vLLM's "auto" would put every replica on core 0.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # One engine thread per core of the replica (Ray would set it from num_cpus, GPU replicas too).
        "OMP_NUM_THREADS": str(cfg.cluster.cores_per_replica),
        "VLLM_HOST_IP": "127.0.0.1",
        # The V1 model runner, the one the tests exercise: on CUDA vLLM 0.32 would pick its V2
        # runner, whose outputs arrive wrapped (AsyncModelRunnerOutput); dlora's switch reports
        # survive that too (engine_ext/worker.py), but V2 has never run dlora's switching end to end.
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "DLORA_LORA_BACKEND": cfg.engine.lora_backend,  # read by the worker extension via lora_backend.install
        "DLORA_MERGED_CACHE_MIB": str(cfg.engine.merged_cache_mib),  # read by the worker's merger
    }
    trace = dlora_env.DLORA_STEP_TRACE.get()
    if trace:
        env[dlora_env.DLORA_STEP_TRACE.name] = trace  # the engine's scheduler writes it (step_trace.py)
    # read by the worker's in-place merger (pristine_rows.py); a Ray cluster's nodes may not have it
    env[dlora_env.DLORA_PRISTINE_DEVICE_GIB.name] = str(dlora_env.DLORA_PRISTINE_DEVICE_GIB.get())
    return {"env_vars": env}


# What a replica asks of its node's custom resource (`cluster.replica_resources`): a share, so a
# node started with one unit of it holds up to a thousand replicas; its CPUs or GPUs limit them.
REPLICA_RESOURCE_SHARE = 0.001


def create_replica(
    replica_id: int,
    cfg: DloraConfig,
    model_path: str,
    cores: tuple[int, ...] | None,
    gpu: bool,
    resource: str | None = None,
    model: ModelManifest | None = None,
) -> RayReplica:
    # ray.remote is typed as returning the class itself, not the ActorClass that has .options
    actor = ReplicaActor.options(  # type: ignore[attr-defined]
        name=f"dlora-replica-{replica_id}",
        num_cpus=0 if gpu else cfg.cluster.cores_per_replica,
        num_gpus=1 if gpu else 0,
        max_concurrency=10_000,
        max_restarts=-1,
        resources={resource: REPLICA_RESOURCE_SHARE} if resource else None,
        runtime_env=replica_runtime_env(cfg),
    ).remote(replica_id, cfg, model_path, cores, model)
    return RayReplica(replica_id, actor)
