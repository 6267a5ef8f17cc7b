"""A discrete-step simulator of one replica: the real batching policies, a modelled engine.

Why: a policy's effect on latency is a few percent, while a real 60-second benchmark point on a
shared 2-core VM moves by 10-20% from one run to the next. Here the policy objects that run inside
the engine (`dlora.scheduling`) decide every step exactly as they would there, while the engine
is a model: continuous batching like vLLM v1's scheduler (running requests decode one token per
step; waiting ones are admitted in the policy's priority order while `max_num_seqs` and the token
budget allow, their whole prompt prefilled in that step, which yields their first token), at most
`max_loras` distinct adapters per step, step times from `StepCosts`, and the merged kernels of
the `merged_cache_entries` most recently merged adapters kept (a cached merge is a swap, a cold
one goes through vLLM's reload). Time is simulated; `noise_sd` multiplies each step's compute
time by a seeded log-normal factor, so a policy's robustness to a noisy machine can be seen too.

What it leaves out: preemption (KV is never short here), chunked prefill of long prompts across
steps, failed merges, and the Ray/HTTP hops (the same for every policy).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dlora.scheduling import BatchingPolicy, IterationStats, Mode, RequestView, Switch, check_decision
from dlora.sim.step_costs import StepCosts


@dataclass(frozen=True, slots=True)
class SimRequest:
    req_id: str
    adapter: str | None
    arrival: float  # seconds
    prompt_tokens: int
    output_tokens: int  # what it generates (its end of sequence comes then)
    max_tokens: int | None = None  # the cap the policy sees; None: output_tokens (fixed lengths)


@dataclass(slots=True)
class _Live:
    req: SimRequest
    admitted: bool = False
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None

    def view(self) -> RequestView:
        computed = self.req.prompt_tokens + self.generated if self.admitted else 0
        return RequestView(
            self.req.req_id,
            self.req.adapter,
            self.req.arrival,
            self.req.prompt_tokens,
            computed,
            self.generated,
            self.admitted,
            # fixed-length benchmarks (ignore_eos) cap each request at its length
            self.req.output_tokens if self.req.max_tokens is None else self.req.max_tokens,
        )


@dataclass(frozen=True, slots=True)
class RequestResult:
    req_id: str
    adapter: str | None
    arrival: float
    first_token_at: float
    finished_at: float
    output_tokens: int

    @property
    def latency(self) -> float:
        return self.finished_at - self.arrival


@dataclass
class SimResult:
    requests: list[RequestResult]
    steps: int = 0
    merged_steps: int = 0
    switches: int = 0
    cold_merges: int = 0
    switch_seconds: float = 0.0
    busy_seconds: float = 0.0
    held_back_request_seconds: float = 0.0  # unfinished requests not allowed to run, x step time

    @property
    def avg_latency_per_output_token(self) -> float:
        """dLoRA's metric: total latency / total output tokens (seconds)."""
        return sum(r.latency for r in self.requests) / max(1, sum(r.output_tokens for r in self.requests))


@dataclass
class BatchingSim:
    policy: BatchingPolicy
    costs: StepCosts
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_loras: int = 8
    noise_sd: float = 0.0
    seed: int = 0
    mixed: bool = False  # the engine compensates other requests on merged weights
    _weights: str | None = field(default=None, init=False)
    _cache: OrderedDict = field(default_factory=OrderedDict, init=False)

    def run(self, requests: Iterable[SimRequest], max_steps: int = 1_000_000) -> SimResult:
        rng = random.Random(self.seed)
        pending = sorted(requests, key=lambda r: (r.arrival, r.req_id))
        live: dict[str, _Live] = {}
        done: list[RequestResult] = []
        result = SimResult(done)
        now, i = 0.0, 0
        for _ in range(max_steps):
            while i < len(pending) and pending[i].arrival <= now:
                live[pending[i].req_id] = _Live(pending[i])
                i += 1
            if not live:
                if i == len(pending):
                    return result
                self.policy.decide([], now)  # idle: the policy's clock closes the last step
                now = pending[i].arrival
                continue
            now += self._step(live, now, rng, result)
            for rid in [rid for rid, s in live.items() if s.finished_at is not None]:
                s = live.pop(rid)
                # picked as finished; its first token came in that step or earlier
                assert s.first_token_at is not None and s.finished_at is not None
                done.append(
                    RequestResult(
                        rid, s.req.adapter, s.req.arrival, s.first_token_at, s.finished_at, s.req.output_tokens
                    )
                )
        raise RuntimeError(f"simulation did not finish in {max_steps} steps")

    def _step(self, live: dict[str, _Live], now: float, rng: random.Random, result: SimResult) -> float:
        views = [s.view() for s in live.values()]
        decision = self.policy.decide(views, now, self.max_num_seqs)
        check_decision(decision, views, None, self.mixed)
        target = decision.merged_adapter if decision.mode is Mode.MERGED else None
        switch_s = self._switch(target, decision.switch, result)
        batch = self._schedule(live, decision.allowed_req_ids, target)
        compute = self._compute_time(live, batch, target) * self._noise(rng)
        prefill = sum(live[rid].req.prompt_tokens for rid in batch if not live[rid].admitted)
        decodes = sum(1 for rid in batch if live[rid].admitted)
        dt = compute + switch_s
        result.steps += 1
        result.merged_steps += target is not None
        result.busy_seconds += dt
        result.held_back_request_seconds += dt * (len(live) - len(batch))
        end = now + dt
        for rid in batch:
            s = live[rid]
            s.admitted = True
            s.generated += 1
            if s.first_token_at is None:
                s.first_token_at = end
            if s.generated >= s.req.output_tokens:
                s.finished_at = end
        self.policy.observe(
            IterationStats(
                decision.mode,
                decision.merged_adapter,
                len(batch),
                dt,
                switch_s,
                num_tokens=prefill + decodes,
                prefill_tokens=prefill,
            )
        )
        return dt

    def _switch(self, target: str | None, switch: Switch, result: SimResult) -> float:
        if target == self._weights:
            return 0.0
        seconds = 0.0
        if self._weights is not None:
            seconds += self.costs.unmerge_s
            result.switches += 1
        if target is not None:
            cached = target in self._cache
            seconds += self.costs.merge_cached_s if cached else self.costs.merge_cold_s
            result.cold_merges += not cached
            result.switches += 1
            self._cache[target] = None
            self._cache.move_to_end(target)
            while len(self._cache) > self.costs.merged_cache_entries:
                self._cache.popitem(last=False)
        self._weights = target
        result.switch_seconds += seconds
        return seconds

    def _schedule(self, live: dict[str, _Live], allowed: Sequence[str], merged: str | None) -> list[str]:
        """The allowed requests the engine runs this step, in the policy's priority order."""
        running = sum(1 for s in live.values() if s.admitted)
        budget = self.max_num_batched_tokens
        adapters: set[str] = set() if merged is None else {merged}
        batch = []
        for rid in allowed:
            s = live[rid]
            a = s.req.adapter
            if a is not None and a not in adapters:
                if len(adapters) >= self.max_loras:
                    continue
            tokens = 1 if s.admitted else s.req.prompt_tokens
            if not s.admitted and (running >= self.max_num_seqs or tokens > budget):
                continue
            if a is not None:
                adapters.add(a)
            budget -= tokens
            running += not s.admitted
            batch.append(rid)
        return batch

    def _compute_time(self, live: dict[str, _Live], batch: list[str], merged: str | None) -> float:
        prefill = lora_seqs = lora_prefill = 0
        adapters: set[str] = set()
        for rid in batch:
            s = live[rid]
            tokens = 0 if s.admitted else s.req.prompt_tokens
            prefill += tokens
            a = s.req.adapter
            # Mixed merged steps compensate every other token (base ones too) with X's delta.
            if a != merged and (a is not None or merged is not None):
                lora_seqs += 1
                lora_prefill += tokens
                adapters.update(x for x in (a, merged) if x is not None)
        return self.costs.step(len(batch), prefill, lora_seqs, lora_prefill, len(adapters))

    def _noise(self, rng: random.Random) -> float:
        return math.exp(rng.gauss(-(self.noise_sd**2) / 2, self.noise_sd)) if self.noise_sd > 0 else 1.0
