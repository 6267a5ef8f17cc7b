"""A replica without an engine (Ray restarted its actor process) is a replica failure, so the router
rebuilds it instead of passing an AttributeError to the client."""

from __future__ import annotations

import asyncio
import os
import pickle
import time
from pathlib import Path

import pytest
from ray.exceptions import RayTaskError

from dlora.config import DloraConfig
from dlora.replica.engine import EngineHost
from dlora.replica.errors import EngineNotStarted, ReplicaFailure
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import _is_replica_failure

REQ = GenerateRequest("r1", (1, 2, 3), SamplingSpec(max_tokens=4), None)
REF = AdapterRef("a", 1, "/x/a")


async def first_delta(stream):
    async for delta in stream:
        return delta


def test_engine_less_host_raises_engine_not_started():
    """What a restarted actor process holds: an EngineHost whose start() has not run (no vLLM here)."""
    host = EngineHost(DloraConfig(), "/models/m")
    calls = {
        "generate": lambda: first_delta(host.generate(REQ)),
        "add_adapter": lambda: host.add_adapter(REF, pinned=True),
        "remove_adapter": lambda: host.remove_adapter(1),
        "resident_adapter_ids": host.resident_adapter_ids,
        "device_adapter_ids": host.device_adapter_ids,
        "batching_state": host.batching_state,
        "check_health": host.check_health,
    }
    for name, call in calls.items():
        with pytest.raises(EngineNotStarted, match="no engine for '/models/m'") as info:
            asyncio.run(call())
        assert isinstance(info.value, ReplicaFailure), name
        assert _is_replica_failure(info.value), name
    # Nothing runs without an engine: abort has nothing to do and the count is zero.
    asyncio.run(host.abort("r1"))
    assert host.num_unfinished() == 0
    host.shutdown()  # idempotent without an engine


def test_engine_not_started_raised_in_the_actor_is_a_replica_failure():
    """Ray hands an actor's exception to the caller as a RayTaskError carrying the (unpickled) cause."""
    cause = pickle.loads(pickle.dumps(EngineNotStarted("no engine")))
    wrapped = RayTaskError("ReplicaActor.generate", "Traceback ...", cause)
    assert _is_replica_failure(wrapped)
    assert _is_replica_failure(wrapped.as_instanceof_cause())
    # Ordinary errors inside the actor (a bad adapter, a bad request) stay errors of that request.
    assert not _is_replica_failure(RayTaskError("ReplicaActor.add_adapter", "Traceback ...", ValueError("bad")))
    assert not _is_replica_failure(ValueError("bad"))


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from dlora.cluster.launcher import init_ray

    ray.shutdown()  # a Ray another module left running here was not started by init_ray
    init_ray(DloraConfig())
    yield
    ray.shutdown()


@pytest.mark.engine  # starts a Ray head
def test_the_ray_head_dlora_starts_kills_one_replica_at_a_time_when_memory_runs_short(ray_cluster):
    """Ray's memory monitor runs in the raylet, which reads its policy from its environment at start."""
    import ray

    from dlora.cluster.launcher import OOM_POLICY_ENV

    # Ray names each cluster it starts and passes the name to its raylet: the raylet of the
    # cluster this test started, not of another one on the host.
    cluster_name = ray._private.worker._global_node.session_name
    environs = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "raylet":
                if cluster_name.encode() in (entry / "cmdline").read_bytes():
                    environs.append((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
    assert len(environs) == 1
    assert f"{OOM_POLICY_ENV}=true".encode() in environs[0]


@pytest.mark.engine
def test_restarted_actor_surfaces_replica_failure(ray_cluster):
    """A real replica actor is killed and restarted by Ray (max_restarts), as after the OOM killer:
    the new process ran only __init__, and every call through the router's handle is a ReplicaFailure."""
    import ray
    from ray.exceptions import RayActorError

    from dlora.replica.ray_replica import create_replica

    replica = create_replica(0, DloraConfig(), "/models/m", cores=None, gpu=False)

    def pid(actor_self) -> int:
        return os.getpid()

    async def run():
        first = await replica.actor.__ray_call__.remote(pid)
        ray.kill(replica.actor, no_restart=False)
        deadline = time.monotonic() + 120
        while True:  # wait for the restarted process (calls fail with ActorUnavailable meanwhile)
            try:
                if await replica.actor.__ray_call__.remote(pid) != first:
                    break
            except RayActorError:
                pass
            assert time.monotonic() < deadline, "Ray did not restart the actor"
            await asyncio.sleep(0.5)
        failures = {}
        for name, call in {
            "generate": lambda: first_delta(replica.generate(REQ)),
            "stats": replica.stats,
            "ping": replica.ping,  # what tells a busy replica from a dead one: no engine is dead
            "add_adapter": lambda: replica.add_adapter(REF, True),
            "remove_adapter": lambda: replica.remove_adapter(1),
        }.items():
            with pytest.raises(ReplicaFailure) as info:
                await call()
            failures[name] = info.value
        await replica.abort("r1")  # nothing to abort: no error
        return failures

    try:
        failures = asyncio.run(run())
    finally:
        ray.kill(replica.actor, no_restart=True)
    for name, e in failures.items():
        assert "no engine for '/models/m'" in str(e), name
        if name != "generate":  # a request's error comes down the output stream as data, not as Ray's error
            assert isinstance(e.__cause__, RayTaskError) and isinstance(e.__cause__.cause, EngineNotStarted), name


def test_errors_in_the_output_stream_are_classified_by_type():
    """What a request's task inside the actor sends down the output stream when its stream raises."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError

    from dlora.replica.ray_replica import stream_error

    assert stream_error(EngineDeadError()).kind == "replica_failure"
    assert stream_error(EngineNotStarted("no engine")).kind == "replica_failure"
    bad = stream_error(VLLMValidationError("top_k must be -1 or at least 1", parameter="top_k"))
    assert (bad.kind, bad.param) == ("rejected", "top_k")
    assert bad.message.startswith("top_k must be -1 or at least 1") and "Traceback" not in bad.message
    assert stream_error(ValueError("prompt too long")).kind == "rejected"
    # The words alone never make a replica look dead.
    assert stream_error(RuntimeError("EngineDeadError in the prompt")).kind == "error"
