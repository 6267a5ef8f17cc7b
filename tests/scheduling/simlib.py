"""Shared scheduling test code: a RequestView factory and a tiny deterministic discrete-step replica.

The simulated replica asks the policy for a decision each step, checks the decision contract,
lets every allowed request produce one token, and reports an `IterationStats` whose time comes
from a given cost function (plus a fixed switch time when the decision switches).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dlora.scheduling import (
    BatchingPolicy,
    IterationStats,
    Mode,
    RequestView,
    Switch,
    check_decision,
)
from dlora.scheduling.dynamic_batching import fcfs_key


def req(
    req_id: str, adapter: str | None, arrival: float, *, output: int = 0, running: bool = False, prompt: int = 8
) -> RequestView:
    return RequestView(req_id, adapter, arrival, prompt, prompt + output if running else 0, output, running)


def reqs(spec: Iterable[tuple[str | None, int]], start: float = 0.0) -> list[RequestView]:
    """[(adapter, count), ...] -> requests with ids '<adapter>-<i>' and increasing arrivals."""
    out, t = [], start
    for adapter, count in spec:
        for i in range(count):
            out.append(req(f"{adapter or 'base'}-{i}", adapter, t))
            t += 1.0
    return out


@dataclass
class SimRequest:
    req_id: str
    adapter: str | None
    arrival: float
    output_len: int
    generated: int = 0
    first_allowed: float | None = None
    finished_at: float | None = None
    held_back: float = 0.0  # total seconds inside B_fcfs but not allowed
    held_back_at_first: float | None = None  # held_back when first allowed
    stretch: float = 0.0  # current run of consecutive held-back seconds
    max_stretch: float = 0.0

    def view(self) -> RequestView:
        return RequestView(
            self.req_id,
            self.adapter,
            self.arrival,
            8,
            8 + self.generated if self.generated else 0,
            self.generated,
            self.generated > 0,
        )


def flat_cost(seconds: float) -> Callable[[Mode, int], float]:
    return lambda mode, n: seconds


def linear_cost(fixed: float, per_req: float, merged_ratio: float) -> Callable[[Mode, int], float]:
    def cost(mode: Mode, n: int) -> float:
        t = fixed + per_req * n
        return t * merged_ratio if mode is Mode.MERGED else t

    return cost


@dataclass
class StepSim:
    policy: BatchingPolicy
    max_batch: int
    cost: Callable[[Mode, int], float]
    switch_time: float = 0.02
    now: float = 0.0
    requests: list[SimRequest] = field(default_factory=list)
    decisions: list = field(default_factory=list)

    def add(self, req_id: str, adapter: str | None, at: float, output_len: int) -> SimRequest:
        r = SimRequest(req_id, adapter, at, output_len)
        self.requests.append(r)
        return r

    def pending(self) -> list[SimRequest]:
        return [r for r in self.requests if r.finished_at is None and r.arrival <= self.now]

    def step(self) -> None:
        live = self.pending()
        if not live:
            future = [r.arrival for r in self.requests if r.finished_at is None and r.arrival > self.now]
            self.now = min(future) if future else self.now + 1.0
            return
        views = [r.view() for r in live]
        d = self.policy.decide(views, self.now, self.max_batch)
        check_decision(d, views, self.max_batch, mixed=self.policy.config.mixed_merged)
        self.decisions.append((self.now, d))
        switching = d.switch is not Switch.NONE
        dt = self.cost(d.mode, len(d.allowed_req_ids)) + (self.switch_time if switching else 0.0)
        self._account(live, set(d.allowed_req_ids), dt)
        self.policy.observe(
            IterationStats(d.mode, d.merged_adapter, len(d.allowed_req_ids), dt, self.switch_time if switching else 0.0)
        )
        self.now += dt

    def _account(self, live: list[SimRequest], allowed: set[str], dt: float) -> None:
        fcfs = {r.req_id for r in sorted(live, key=lambda r: fcfs_key(r.view()))[: self.max_batch]}
        for r in live:
            if r.req_id in allowed:
                if r.first_allowed is None:
                    r.first_allowed, r.held_back_at_first = self.now, r.held_back
                r.generated += 1
                r.stretch = 0.0
                if r.generated >= r.output_len:
                    r.finished_at = self.now + dt
            elif r.req_id in fcfs:
                r.held_back += dt
                r.stretch += dt
                r.max_stretch = max(r.max_stretch, r.stretch)

    def run_until(self, t_end: float, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.now >= t_end:
                return
            self.step()
        raise AssertionError("simulation did not reach t_end")

    def run_to_completion(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if all(r.finished_at is not None for r in self.requests):
                return
            self.step()
        raise AssertionError("requests left unfinished")
