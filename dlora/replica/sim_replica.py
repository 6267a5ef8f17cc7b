"""An in-process replica with a toy deterministic "model", same interface as the Ray replica.

It lets the router, dispatch and migration be tested (and simulated) without engines: the next token
is a pure function of the adapter and the whole context, so a request continued elsewhere as
`prompt + generated` produces exactly the tokens it would have produced in place — the property the
real engine has for greedy decoding in fp32. `kill()` makes it fail like a dead actor.
Output lengths: by default every request runs to its `max_tokens` (as with `ignore_eos`);
`eos_period` maps an adapter to p, and a token divisible by p then ends its request like an EOS
("stop"), so lengths vary per request (≈ geometric, mean p) and are a function of the context,
hence the same whether or not the request was moved.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import AsyncIterator

from dlora.replica.errors import ReplicaFailure
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, ReplicaStats

VOCAB = 1000


def next_token(adapter: str | None, context: tuple[int, ...]) -> int:
    return zlib.crc32(repr((adapter, context)).encode()) % VOCAB


@dataclass
class SimReplica:
    replica_id: int
    step_s: float = 0.002  # seconds per generated token
    max_adapters: int = 4
    eos_period: Mapping[str | None, int] = field(default_factory=dict)  # adapter -> p: tokens % p == 0 end it
    started: int = 0
    loaded: dict[int, str] = field(default_factory=dict)
    add_calls: int = 0
    _alive: bool = False
    _aborted: set[str] = field(default_factory=set)
    _running: set[str] = field(default_factory=set)

    async def start(self) -> None:
        self.started += 1
        self.loaded.clear()
        self._alive = True

    def kill(self) -> None:
        self._alive = False

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
        try:
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

    async def abort(self, request_id: str) -> None:
        self._check()
        if request_id in self._running:
            self._aborted.add(request_id)

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        self._check()
        self.add_calls += 1
        await asyncio.sleep(0)
        self.loaded[ref.int_id] = ref.name

    async def remove_adapter(self, int_id: int) -> bool:
        self._check()
        return self.loaded.pop(int_id, None) is not None

    async def stats(self) -> ReplicaStats:
        self._check()
        return ReplicaStats(self.replica_id, num_unfinished=len(self._running),
                            resident_adapter_ids=sorted(self.loaded))

    async def shutdown(self) -> None:
        self._alive = False


def is_eos(eos_period: Mapping[str | None, int], adapter: str | None, tok: int) -> bool:
    p = eos_period.get(adapter)
    return p is not None and tok % p == 0


def reference_tokens(adapter: str | None, prompt: tuple[int, ...], n: int,
                     eos_period: Mapping[str | None, int] | None = None) -> list[int]:
    """What an undisturbed run produces (up to and including its EOS token, if any)."""
    context, out = tuple(prompt), []
    for _ in range(n):
        tok = next_token(adapter, context)
        out.append(tok)
        context += (tok,)
        if is_eos(eos_period or {}, adapter, tok):
            break
    return out
