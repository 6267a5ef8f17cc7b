"""MuxServe's per-adapter KV block quotas (§3.3, adaptive batch scheduling, Algorithm 3), with lending.

Why: in one shared KV cache a hot adapter can take every block and hold the others' requests out
of the batch. MuxServe gives each colocated model a quota of KV token blocks and, to serve popular
models in proportion, keeps every model's normalized consumption equal (Eq. 2's fairness
constraint |R(m_i) - R(m_j)| <= eps), with R = KV token blocks used / request rate. Here each
model is an adapter of one base model, so every block has the same size and the quotas are plain
block counts:

    quota_a = total_blocks * rate_a / sum(rate_b over active adapters b)

rounded to whole blocks by largest remainder so they sum to `total_blocks` exactly. The rates are
measured over the last period and the quotas re-adapted every period (`RateMeter`, `KvQuotas`;
the period is `slo.quota_period_s`; MuxServe gives no value). An adapter that shows no arrival in
a period gets no quota for the next one: its running requests keep their blocks, as borrowed.
Before the first adaptation there are no quotas: every block is lent to whoever needs it.

Lending (MuxServe moves blocks "from low-utilization LLMs to high-utilization LLMs"): quota an
owner does not use is lent. An adapter may go over its quota while blocks are free (`borrowed` in
the answer), but a borrower is the first to lose: `plan_admissions` admits requests within their
adapter's quota before any that would borrow, and when an owner within its quota finds no free
block, `admit` answers with the blocks to take back from borrowers (their requests are preempted,
most-over-quota adapter first), never taking a borrower below its own quota. Because the quotas
sum to the total, an owner within its quota can always be served that way.

Fairness to report (MuxServe Eq. 2): max over adapter pairs |R_a - R_b|, R = blocks used / rate.

Pure: inputs are block counts and rates, outputs are quotas and admission answers; time is passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

AdapterName = str | None  # an adapter name, or None for the base model


def _key(adapter: AdapterName) -> str:
    """Sort key that orders None (the base model) first, then names."""
    return "" if adapter is None else "\0" + adapter


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` tokens occupy."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size!r}: must be >= 1")
    return -(-max(0, tokens) // block_size)


def quota_shares(total_blocks: int, rates: Mapping[AdapterName, float]) -> dict[AdapterName, int]:
    """Each adapter's block quota in proportion to its rate, summing to `total_blocks` (largest
    remainder; ties to the higher rate, then the name). All rates zero: equal shares."""
    if total_blocks < 0:
        raise ValueError(f"total_blocks={total_blocks!r}: must be >= 0")
    for a, r in rates.items():
        if not (math.isfinite(r) and r >= 0):
            raise ValueError(f"request rate of {a!r}={r!r}: must be a finite number >= 0")
    if not rates:
        return {}
    total_rate = sum(rates.values())
    weights = dict(rates) if total_rate > 0 else {a: 1.0 for a in rates}
    total_w = sum(weights.values())
    exact = {a: total_blocks * w / total_w for a, w in weights.items()}
    quotas = {a: math.floor(x) for a, x in exact.items()}
    left = total_blocks - sum(quotas.values())
    by_remainder = sorted(exact, key=lambda a: (-(exact[a] - quotas[a]), -weights[a], _key(a)))
    for a in by_remainder[:left]:
        quotas[a] += 1
    return quotas


def fairness_gap(used_blocks: Mapping[AdapterName, int], rates: Mapping[AdapterName, float]) -> float:
    """MuxServe Eq. 2's max |R_a - R_b| with R = blocks used / request rate, over the adapters with
    a rate > 0 (an adapter without requests has no consumption to normalize); 0 for fewer than two."""
    r = [used_blocks.get(a, 0) / rate for a, rate in rates.items() if rate > 0]
    return max(r) - min(r) if len(r) >= 2 else 0.0


@dataclass(frozen=True, slots=True)
class Admission:
    """The answer for one request asking for `blocks` KV blocks."""

    admit: bool
    borrowed: int = 0  # blocks it takes beyond its adapter's quota (lent from others' unused quota)
    # blocks to take back from each borrowing adapter (by preempting its requests) before it runs
    reclaim: Mapping[AdapterName, int] = field(default_factory=dict)
    reason: str = ""


def reclaim_plan(
    need: int, requester: AdapterName, used: Mapping[AdapterName, int], quotas: Mapping[AdapterName, int]
) -> dict[AdapterName, int] | None:
    """Blocks to take back from adapters over their quota (not `requester`) to free `need` blocks:
    the most-over-quota adapter first, none below its quota; None if they hold too few."""
    excess = {a: u - quotas.get(a, 0) for a, u in used.items() if a != requester and u > quotas.get(a, 0)}
    plan: dict[AdapterName, int] = {}
    for a in sorted(excess, key=lambda a: (-excess[a], _key(a))):
        if need <= 0:
            break
        take = min(excess[a], need)
        plan[a] = take
        need -= take
    return plan if need <= 0 else None


def admit(
    adapter: AdapterName,
    blocks: int,
    used: Mapping[AdapterName, int],
    quotas: Mapping[AdapterName, int],
    total_blocks: int,
) -> Admission:
    """Whether a request of `adapter` needing `blocks` blocks may start, given the blocks each
    adapter `used` now. Free blocks go to anyone (borrowing beyond the quota); an adapter that
    stays within its quota also gets blocks back from borrowers when none is free."""
    free = total_blocks - sum(used.values())
    room = quotas.get(adapter, 0) - used.get(adapter, 0)  # its unused quota (negative: borrowing)
    within = blocks <= room
    if blocks <= free:
        borrowed = blocks - max(0, min(blocks, room))
        return Admission(True, borrowed=borrowed, reason="within quota" if within else "borrowing free blocks")
    if not within:
        return Admission(False, reason="over its quota and too few free blocks")
    plan = reclaim_plan(blocks - max(0, free), adapter, used, quotas)
    if plan is None:
        return Admission(False, reason="within its quota but borrowers hold too few blocks")
    return Admission(True, reclaim=plan, reason="within quota, reclaiming lent blocks")


@dataclass(frozen=True, slots=True)
class AdmissionPlan:
    admitted: tuple[str, ...]  # request ids, in the order they start
    reclaim: Mapping[AdapterName, int]  # blocks to take back from each borrower first
    borrowed: int  # blocks lent to the admitted borrowers


def plan_admissions(
    waiting: Sequence[tuple[str, AdapterName, int]],
    used: Mapping[AdapterName, int],
    quotas: Mapping[AdapterName, int],
    total_blocks: int,
) -> AdmissionPlan:
    """Which of `waiting` (request id, adapter, blocks), in their priority order, start now: first
    every request its adapter's quota covers (reclaiming lent blocks if needed), then, with the
    blocks still free, the ones that would borrow. So borrowers are refused first."""
    now_used = dict(used)
    admitted: list[str] = []
    reclaim: dict[AdapterName, int] = {}
    borrowed = 0
    later = []
    for req_id, adapter, blocks in waiting:
        if blocks > quotas.get(adapter, 0) - now_used.get(adapter, 0):
            later.append((req_id, adapter, blocks))
            continue
        ans = admit(adapter, blocks, now_used, quotas, total_blocks)
        if ans.admit:
            for a, n in ans.reclaim.items():
                now_used[a] -= n
                reclaim[a] = reclaim.get(a, 0) + n
            now_used[adapter] = now_used.get(adapter, 0) + blocks
            admitted.append(req_id)
    for req_id, adapter, blocks in later:
        ans = admit(adapter, blocks, now_used, quotas, total_blocks)
        if ans.admit and not ans.reclaim:
            now_used[adapter] = now_used.get(adapter, 0) + blocks
            borrowed += ans.borrowed
            admitted.append(req_id)
    return AdmissionPlan(tuple(admitted), reclaim, borrowed)


class RateMeter:
    """Arrivals per adapter since the period began; rates = count / elapsed seconds."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.counts: dict[AdapterName, int] = {}

    def arrived(self, adapter: AdapterName, count: int = 1) -> None:
        self.counts[adapter] = self.counts.get(adapter, 0) + count

    def rates(self, now: float) -> dict[AdapterName, float]:
        elapsed = now - self.start
        if elapsed <= 0:
            return {a: 0.0 for a in self.counts}
        return {a: n / elapsed for a, n in self.counts.items()}

    def restart(self, now: float) -> None:
        self.start, self.counts = now, {}


class KvQuotas:
    """One replica's quotas: measured rates, re-adapted every `period_s`, and admission answers."""

    def __init__(self, total_blocks: int, period_s: float, start: float) -> None:
        if period_s <= 0:
            raise ValueError(f"quota period {period_s!r}: must be > 0 seconds")
        self.total_blocks = total_blocks
        self.period_s = period_s
        self.meter = RateMeter(start)
        self.quotas: dict[AdapterName, int] = {}
        self.rates: dict[AdapterName, float] = {}  # the rates the quotas were set from

    def arrived(self, adapter: AdapterName, count: int = 1) -> None:
        self.meter.arrived(adapter, count)

    def adapt(self, now: float, active: Iterable[AdapterName] = ()) -> bool:
        """At the end of a period: quotas from the rates measured over it, for the adapters that
        arrived or are `active` (hold blocks or wait; a rate of 0 when none arrived). Returns
        whether the quotas were re-adapted (False before the period is over)."""
        if now - self.meter.start < self.period_s:
            return False
        rates = self.meter.rates(now)
        for a in active:
            rates.setdefault(a, 0.0)
        self.rates = rates
        self.quotas = quota_shares(self.total_blocks, rates)
        self.meter.restart(now)
        return True

    def admit(self, adapter: AdapterName, blocks: int, used: Mapping[AdapterName, int]) -> Admission:
        return admit(adapter, blocks, used, self.quotas, self.total_blocks)

    def fairness_gap(self, used: Mapping[AdapterName, int]) -> float:
        return fairness_gap(used, self.rates)
