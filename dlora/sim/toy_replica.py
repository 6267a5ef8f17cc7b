"""An in-process replica with a toy deterministic "model", same interface as the Ray replica.

It lets the router, dispatch and migration be tested (and simulated) without engines: the next token
is a pure function of the adapter and the whole context, so a request continued elsewhere as
`prompt + generated` produces exactly the tokens it would have produced in place — the property the
real engine has for greedy decoding in fp32. `kill()` makes it fail like a dead actor.
Output lengths: by default every request runs to its `max_tokens` (as with `ignore_eos`);
`eos_period` maps an adapter to p, and a token divisible by p then ends its request like an EOS
("stop"), so lengths vary per request (≈ geometric, mean p) and are a function of the context,
hence the same whether or not the request was moved.
Queueing: with `max_running` set, at most that many requests generate at once and the others wait
by (`priority`, `arrival_time`) (the request's first arrival, else when it came here), as in the
engine's waiting queue (an abort ends a wait); with `max_loras` set, a waiting
request whose adapter would be one too many is skipped for later ones; like the engine's scheduler it
reports each request's wait, until it was admitted or aborted, with its stats (`queue_waits`).
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import AdapterRef, BatchingState, Delta, GenerateRequest, ReplicaStats

VOCAB = 1000


def next_token(adapter: str | None, context: tuple[int, ...]) -> int:
    return zlib.crc32(repr((adapter, context)).encode()) % VOCAB


@dataclass
class ToyReplica:
    replica_id: int
    step_s: float = 0.002  # seconds per generated token
    max_adapters: int = 4
    eos_period: Mapping[str | None, int] = field(default_factory=dict)  # adapter -> p: tokens % p == 0 end it
    max_running: int | None = None  # requests generating at once; the rest queue (None: no limit)
    max_loras: int | None = None  # distinct adapters generating at once (vLLM max_loras; None: no limit)
    kv_capacity_tokens: int | None = None  # reported in stats as an engine reports its KV size
    load_s: float = 0.0  # seconds add_adapter takes
    started: int = 0
    loaded: dict[int, str] = field(default_factory=dict)
    add_calls: int = 0
    _alive: bool = False
    _aborted: set[str] = field(default_factory=set)
    _running: set[str] = field(default_factory=set)  # every request it holds, queued or generating
    _generating: int = 0
    _generating_adapters: Counter[str | None] = field(default_factory=Counter)
    # waiting: request id -> ((priority, arrival time), adapter, admission)
    _queue: dict[str, tuple[tuple[int, float], str | None, asyncio.Future]] = field(default_factory=dict)
    _waits: list[tuple[str, float]] = field(default_factory=list)  # ended since the last stats read

    async def start(self) -> None:
        self.started += 1
        self.loaded.clear()
        self._alive = True

    def kill(self) -> None:
        self._alive = False
        for rid in list(self._queue):  # the waiting requests fail with the replica
            self._fail_wait(rid)

    def _check(self) -> None:
        if not self._alive:
            raise ReplicaFailure(f"replica {self.replica_id} is dead")

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        self._check()
        adapter = req.adapter.name if req.adapter else None
        if req.adapter and req.adapter.int_id not in self.loaded:
            raise RuntimeError(f"adapter {adapter} not loaded on replica {self.replica_id}")
        context = tuple(req.prompt_token_ids)
        self._running.add(req.request_id)
        admitted = False
        try:
            arrival = time.time() if req.arrival_time is None else req.arrival_time
            admitted = await self._admission(req.request_id, (req.priority, arrival), adapter)
            self._check()
            if not admitted:
                yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
                return
            for i in range(req.sampling.max_tokens):
                await asyncio.sleep(self.step_s)
                self._check()
                if req.request_id in self._aborted:
                    yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
                    return
                tok = next_token(adapter, context)
                context += (tok,)
                if is_eos(self.eos_period, adapter, tok) and not req.sampling.ignore_eos:
                    yield Delta(token_ids=[tok], text="", finished=True, finish_reason="stop")
                    return
                last = i == req.sampling.max_tokens - 1
                yield Delta(token_ids=[tok], text=f"<{tok}>", finished=last, finish_reason="length" if last else None)
        finally:
            self._running.discard(req.request_id)
            self._aborted.discard(req.request_id)
            if admitted:
                self._release(adapter)

    async def _admission(self, request_id: str, rank: tuple[int, float], adapter: str | None) -> bool:
        """Wait for a running slot; False when aborted or killed while waiting."""
        since = time.monotonic()
        fut = asyncio.get_running_loop().create_future()
        self._queue[request_id] = (rank, adapter, fut)
        self._pump()  # admits it at once (no suspension) when it may run now
        try:
            admitted = await fut
        except asyncio.CancelledError:  # the stream was closed while (or just as) it was admitted
            if fut.done() and not fut.cancelled() and fut.result():
                self._release(adapter)
            raise
        finally:
            self._queue.pop(request_id, None)
        self._waits.append((request_id, time.monotonic() - since))
        return admitted

    def _lora_blocked(self, adapter: str | None) -> bool:
        """vLLM's max_loras: a new adapter joins only while fewer distinct adapters run."""
        return (
            self.max_loras is not None
            and adapter is not None
            and adapter not in self._generating_adapters
            and sum(a is not None for a in self._generating_adapters) >= self.max_loras
        )

    def _pump(self) -> None:
        """Admit waiting requests in (priority, arrival) order while slots are free, skipping those whose adapter
        finds every max_loras slot taken (as vLLM's scheduler skips them and takes later ones)."""
        for rid, (_, adapter, fut) in sorted(self._queue.items(), key=lambda kv: kv[1][0]):
            if self.max_running is not None and self._generating >= self.max_running:
                return
            if fut.done():  # its waiter was cancelled
                self._queue.pop(rid, None)
            elif self._alive and not self._lora_blocked(adapter):
                self._queue.pop(rid)
                self._generating += 1
                self._generating_adapters[adapter] += 1
                fut.set_result(True)

    def _release(self, adapter: str | None) -> None:
        self._generating -= 1
        self._generating_adapters[adapter] -= 1
        if self._generating_adapters[adapter] <= 0:
            del self._generating_adapters[adapter]
        self._pump()

    def _fail_wait(self, request_id: str) -> None:
        _, _, fut = self._queue.pop(request_id)
        if not fut.done():
            fut.set_result(False)

    async def abort(self, request_id: str) -> None:
        self._check()
        if request_id in self._queue:
            self._fail_wait(request_id)
        elif request_id in self._running:
            self._aborted.add(request_id)

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        self._check()
        self.add_calls += 1
        await asyncio.sleep(self.load_s)
        self.loaded[ref.int_id] = ref.name

    async def remove_adapter(self, int_id: int) -> bool:
        self._check()
        return self.loaded.pop(int_id, None) is not None

    async def stats(self) -> ReplicaStats:
        self._check()
        waits, self._waits = tuple(self._waits), []
        batching = BatchingState(
            policy="sim",
            mode="unmerged",
            merged_adapter=None,
            num_switches=0,
            merge_failures=0,
            switch_times={},
            num_running=self._generating,
            num_waiting=len(self._queue),
            queue_waits=waits,
            kv_capacity_tokens=self.kv_capacity_tokens,
        )
        return ReplicaStats(
            self.replica_id,
            num_unfinished=len(self._running),
            resident_adapter_ids=sorted(self.loaded),
            batching=batching,
        )

    async def ping(self) -> None:
        self._check()

    async def shutdown(self) -> None:
        self._alive = False


def is_eos(eos_period: Mapping[str | None, int], adapter: str | None, tok: int) -> bool:
    p = eos_period.get(adapter)
    return p is not None and tok % p == 0


def reference_tokens(
    adapter: str | None, prompt: tuple[int, ...], n: int, eos_period: Mapping[str | None, int] | None = None
) -> list[int]:
    """What an undisturbed run produces (up to and including its EOS token, if any)."""
    context, out = tuple(prompt), []
    for _ in range(n):
        tok = next_token(adapter, context)
        out.append(tok)
        context += (tok,)
        if is_eos(eos_period or {}, adapter, tok):
            break
    return out
