"""Replica failures by type, bounded resubmissions, deadlines on hung replicas, all replicas down,
replicas that cannot be rebuilt: in-process replicas, real Ray/vLLM exception objects."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.exceptions import EngineDeadError

from dlora.cluster.errors import NoReplicaError, RequestTimeout, ResubmissionLimit
from dlora.cluster.router import Router, RouterConfig
from dlora.replica.errors import EngineNotStarted, ReplicaFailure, RequestRejected
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from dlora.replica.ray_replica import _is_replica_failure, stream_error
from dlora.sim.toy_replica import ToyReplica, reference_tokens


def request(rid: str, n: int = 20) -> GenerateRequest:
    return GenerateRequest(rid, (1, 2, 3), SamplingSpec(max_tokens=n), None)


async def collect(router: Router, req: GenerateRequest) -> list[int]:
    return [t async for d in router.generate(req) for t in d.token_ids]


def remote(cause: BaseException, fn: str = "ReplicaActor.generate") -> RayTaskError:
    """What Ray raises in the caller when an actor method raised `cause` (unpickled on this side)."""
    return RayTaskError(fn, "Traceback (most recent call last): ...", pickle.loads(pickle.dumps(cause)))


# ---- typed failure mapping ------------------------------------------------------------------------


def test_a_dead_engine_or_actor_is_a_replica_failure_by_type():
    for e in (
        remote(EngineDeadError()),
        remote(EngineDeadError()).as_instanceof_cause(),
        remote(EngineNotStarted("no engine")),
        ActorDiedError(),
        ReplicaFailure("x"),
    ):
        assert _is_replica_failure(e), e
    for cause in (EngineDeadError(), EngineNotStarted("no engine")):  # what the output stream carries
        assert stream_error(cause).kind == "replica_failure", cause


def test_error_text_never_makes_a_replica_look_dead():
    """A request's own error mentioning the words must not restart a healthy replica."""
    tricky = remote(RuntimeError("EngineDeadError: EngineDead in the prompt"))
    assert not _is_replica_failure(tricky)
    assert not _is_replica_failure(ValueError("EngineDead"))


def rejection(cause: BaseException) -> BaseException:
    """What the router-side handle raises for `cause` raised inside the replica (via the output stream)."""
    return stream_error(cause).exception(replica_id=0)


def test_vllm_input_errors_become_request_rejections():
    bad = rejection(ValueError("max_tokens must be at least 1, got 0."))
    assert isinstance(bad, RequestRejected) and bad.message == "max_tokens must be at least 1, got 0."
    assert "Traceback" not in str(bad)
    assert isinstance(rejection(TypeError("bad type")), RequestRejected)
    typed = rejection(VLLMValidationError("too long", parameter="max_tokens"))
    assert isinstance(typed, RequestRejected) and typed.param == "max_tokens"
    boom = rejection(RuntimeError("boom"))  # not the request's fault: stays an error
    assert not isinstance(boom, (RequestRejected, ReplicaFailure))


# ---- stand-in replicas -----------------------------------------------------------------------------


class PoisonedReplica(ToyReplica):
    """Dies whenever it serves a request whose id starts with "poison", after its first token."""

    def generate(self, req):
        inner = super().generate(req)
        if not req.request_id.startswith("poison"):
            return inner

        async def dying():
            async for d in inner:
                yield d
                self.kill()

        return dying()


class RejectingReplica(ToyReplica):
    def generate(self, req):
        async def refuse():
            raise RequestRejected("stop strings must not be empty", "stop")
            yield  # an async generator

        return refuse()


class HungReplica(ToyReplica):
    """Answers start; then its stats and streams never answer (a wedged engine)."""

    hung: bool = False
    closed: int = 0

    async def start(self):
        if self.hung:  # a rebuild hangs too
            await asyncio.Event().wait()
        await super().start()

    async def stats(self):
        if self.hung:
            await asyncio.Event().wait()
        return await super().stats()

    def generate(self, req):
        if not self.hung:
            return super().generate(req)

        async def stuck():
            try:
                await asyncio.Event().wait()
                yield
            finally:
                self.closed += 1  # the stream was closed: the engine's request is aborted

        return stuck()


class UnbuildableReplica(ToyReplica):
    """Starts once; every rebuild fails (e.g. the model path vanished)."""

    async def start(self):
        if self.started:
            self.started += 1
            raise RuntimeError("cannot build the engine")
        await super().start()


def make(replicas, **cfg) -> Router:
    return Router(replicas, cfg=RouterConfig(**({"dispatch": "least_loaded"} | cfg)))


# ---- bounded resubmissions --------------------------------------------------------------------------


def test_a_request_that_kills_replicas_is_given_up_after_max_resubmissions():
    async def run():
        replicas = [PoisonedReplica(i, step_s=0.002) for i in range(4)]
        router = make(replicas, max_resubmissions=2)
        await router.start()
        with pytest.raises(ResubmissionLimit, match="request failed on 3 replicas; giving up"):
            await collect(router, request("poison-1"))
        assert router.counters["resubmissions"] == 2 and router.counters["resubmission_limit"] == 1
        # an ordinary request still completes, on whatever is up or rebuilt
        assert await collect(router, request("fine")) == reference_tokens(None, (1, 2, 3), 20)
        await router.shutdown()

    asyncio.run(run())


def test_a_rejected_request_fails_alone_and_is_not_resubmitted():
    async def run():
        router = make([RejectingReplica(0), RejectingReplica(1)])
        await router.start()
        with pytest.raises(RequestRejected) as info:
            await collect(router, request("r"))
        assert info.value.param == "stop"
        assert router.counters["resubmissions"] == 0 and all(s.healthy for s in router.slots)
        await router.shutdown()

    asyncio.run(run())


# ---- deadlines ---------------------------------------------------------------------------------------


def test_a_hung_engine_is_waited_for_up_to_the_stall_bound_then_its_streams_move():
    """Its actor answers pings (the engine is busy, for all the router can tell): the first missed
    deadline keeps the replica; the stats read still unanswered at the stall bound fails it."""

    async def run():
        hung, good = HungReplica(0, step_s=0.002), ToyReplica(1, step_s=0.002)
        router = make([hung, good], actor_call_timeout_s=0.2, replica_stall_timeout_s=0.6, dispatch="round_robin")
        await router.start()
        await router.refresh_stats()  # both report once
        hung.hung = True
        task = asyncio.create_task(collect(router, request("h", n=10)))
        while "h" not in router.requests or router.requests["h"].engine_request_id is None:
            await asyncio.sleep(0.005)
        assert router.requests["h"].slot.replica_id == 0
        t0 = time.monotonic()
        stats = await router.refresh_stats()  # does not wait on the hung replica past its deadline
        assert time.monotonic() - t0 < 0.5
        assert router.slots[0].healthy and stats[0].healthy and router.counters["busy_deadlines"] == 1
        assert not task.done() and router.counters["resubmissions"] == 0
        await asyncio.sleep(0.3)
        stats = await router.refresh_stats()  # the same read, asked 0.7 s ago: past the stall bound
        assert not stats[0].healthy and stats[1].healthy and not router.slots[0].healthy
        assert await asyncio.wait_for(task, 2) == reference_tokens(None, (1, 2, 3), 10)  # finished on replica 1
        assert hung.closed == 1 and router.counters["resubmissions"] == 1
        for t in [s.recovering for s in router.slots if s.recovering]:
            t.cancel()

    asyncio.run(run())


class DeadActorReplica(HungReplica):
    """Its pings hang too: the actor itself no longer answers."""

    async def ping(self):
        if self.hung:
            await asyncio.Event().wait()
        await super().ping()


def test_a_replica_that_misses_a_deadline_and_its_ping_fails_at_once():
    async def run():
        dead, good = DeadActorReplica(0, step_s=0.002), ToyReplica(1, step_s=0.002)
        router = make([dead, good], actor_call_timeout_s=0.2, replica_stall_timeout_s=60.0, dispatch="round_robin")
        await router.start()
        dead.hung = True
        task = asyncio.create_task(collect(router, request("h", n=10)))
        while "h" not in router.requests or router.requests["h"].engine_request_id is None:
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        stats = await router.refresh_stats()  # the stats deadline, then the ping's: far below the stall bound
        assert time.monotonic() - t0 < 1.0
        assert not stats[0].healthy and not router.slots[0].healthy and router.counters["busy_deadlines"] == 0
        assert await asyncio.wait_for(task, 2) == reference_tokens(None, (1, 2, 3), 10)
        for t in [s.recovering for s in router.slots if s.recovering]:
            t.cancel()

    asyncio.run(run())


class SlowStatsReplica(ToyReplica):
    """Its stats take `stats_s` (a long engine step) and are counted."""

    def __init__(self, replica_id: int, stats_s: float, **kw) -> None:
        super().__init__(replica_id, **kw)
        self.stats_s, self.stats_calls = stats_s, 0

    async def stats(self):
        self.stats_calls += 1
        await asyncio.sleep(self.stats_s)
        return await super().stats()


def test_a_slow_replica_is_not_rebuilt_and_its_late_stats_are_used():
    async def run():
        slow = SlowStatsReplica(0, stats_s=0.3, step_s=0.002)
        router = make([slow], actor_call_timeout_s=0.2, replica_stall_timeout_s=10.0)
        await router.start()
        task = asyncio.create_task(collect(router, request("s", n=10)))
        first = await router.refresh_stats()  # missed the deadline; the ping answers
        assert router.slots[0].healthy and router.counters["busy_deadlines"] >= 1
        assert not first[0].healthy  # it had never reported: nothing to stand in for it
        late = await router.refresh_stats()  # awaits the same pending read, which now answers
        assert late[0].healthy and slow.stats_calls == 1
        assert router.reported[0] is late[0]
        assert await asyncio.wait_for(task, 2) == reference_tokens(None, (1, 2, 3), 10)
        assert router.counters["resubmissions"] == 0 and router.slots[0].restarts == 0
        await router.shutdown()

    asyncio.run(run())


def test_a_slow_adapter_load_is_waited_for_not_taken_for_a_failure():
    async def run():
        slow = ToyReplica(0, load_s=0.5)
        router = make([slow], actor_call_timeout_s=0.2, replica_stall_timeout_s=10.0)
        await router.start()
        await router.load_everywhere(AdapterRef("a", 1, "/a"))
        assert slow.loaded == {1: "a"} and router.slots[0].healthy and router.slots[0].restarts == 0
        assert router.counters["busy_deadlines"] == 2  # 0.2 s and 0.4 s missed, answered at 0.5 s
        await router.shutdown()

    asyncio.run(run())


def test_a_request_past_its_deadline_is_aborted_and_fails_with_request_timeout():
    async def run():
        hung = HungReplica(0)
        router = make([hung], request_timeout_s=0.3)
        await router.start()
        hung.hung = True
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout, match="deadline"):
            await collect(router, request("slow"))
        assert 0.3 <= time.monotonic() - t0 < 1.5
        assert hung.closed == 1 and router.requests == {}  # its stream was closed in the engine
        assert router.slots[0].healthy  # a slow request is not a failed replica

    asyncio.run(run())


def test_a_deadline_also_bounds_the_wait_for_a_replica():
    async def run():
        router = make([ToyReplica(0)], request_timeout_s=0.2, recovery_grace_s=5.0)
        await router.start()
        router.slots[0].healthy = False  # down, and nothing rebuilds it
        router.slots[0].ready.clear()
        t0 = time.monotonic()
        with pytest.raises(RequestTimeout):
            await collect(router, request("w"))
        assert time.monotonic() - t0 < 1.0

    asyncio.run(run())


# ---- all replicas down; replicas that cannot be rebuilt ----------------------------------------------


def test_all_replicas_down_fails_at_once_with_no_replica_error():
    async def run():
        replicas = [UnbuildableReplica(i) for i in range(2)]
        router = make(replicas, recovery_grace_s=0.2)
        await router.start()
        for r in replicas:
            r.kill()
        t0 = time.monotonic()
        with pytest.raises(NoReplicaError, match="no replica is up"):
            await collect(router, request("x"))
        assert time.monotonic() - t0 < 1.5  # the grace, not a wait for a replica to come back
        await router.shutdown()

    asyncio.run(run())


def test_a_replica_that_cannot_be_rebuilt_is_given_up_and_not_retried_in_a_loop():
    async def run():
        replica = UnbuildableReplica(0)
        router = make([replica], max_restart_attempts=2)
        await router.start()
        replica.kill()
        await router.refresh_stats()  # finds it dead: rebuilds start (1 s apart)
        assert router.may_serve_soon()  # down, but rebuilds are still tried
        for _ in range(300):
            if router.slots[0].gave_up:
                break
            await asyncio.sleep(0.01)
        assert router.slots[0].gave_up and router.slots[0].failed_restarts == 2 and not router.slots[0].healthy
        assert not router.may_serve_soon()  # what batch lines read to stop waiting for a replica
        attempts = replica.started
        await asyncio.sleep(1.5)  # a tight loop would have tried again by now
        assert replica.started == attempts
        assert [st.healthy for st in router.reported_stats()] == [False]
        router.slots[0].recovering.cancel()

    asyncio.run(run())
