"""Greedy co-migration: the fallback when the ILP solver times out or fails, and its baseline.

Why a greedy at all: the solver runs under a hard wall-clock limit and CBC can overrun its own
limit or fail to start (migration/lp_solve.py), but a rebalancing round must still produce a valid plan.
This is longest-processing-time style load shifting on the same selective problem: repeatedly
take the most loaded sender and move the one request (the cheapest to move of some adapter
group) whose move to a receiver lowers the pair's makespan the most after paying the migration
cost, the receiver's re-prefill and adapter load, and any KV overflow change. It stops when no
move gains anything, or at `deadline`: every prefix of its moves is itself a valid plan, so a
cut-off greedy still returns something useful. It runs in O(moves × groups on the sender × K).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dlora.cluster.migration.problem import MigrationProblem

EPS = 1e-9


def _overflow(p: MigrationProblem, j: int, mem: float) -> float:
    return p.overflow_s[j] * max(0.0, mem - p.replicas[j].kv_capacity_tokens)


def _may_overflow(p: MigrationProblem) -> list[bool]:
    """Replicas whose KV can be over capacity in some plan (the others skip overflow terms)."""
    worst = list(p.mem)
    for g in p.groups:
        for j in p.receivers:
            worst[j] += sum(g.mem) + p.adapter_size(g.adapter)
    return [w > v.kv_capacity_tokens and s > 0 for w, v, s in zip(worst, p.replicas, p.overflow_s)]


def greedy_moves(
    p: MigrationProblem, deadline: float = float("inf"), clock: Callable[[], float] = time.perf_counter
) -> list[tuple[int, int, int]]:
    """(group index, request index in group, receiver index) moves, in the order chosen."""
    load, mem = list(p.load), list(p.mem)
    nxt = [0] * len(p.groups)
    absent = [{j: p.needs_load(g.adapter, j) for j in p.receivers} for g in p.groups]  # not loaded yet
    blocked = [
        {j: p.batch_blocked(g.adapter, j) for j in p.receivers} for g in p.groups
    ]  # on the snapshot, fixed per round
    slots = {j: p.free_slots(j) for j in p.receivers}
    load_s = {j: p.params[j].adapter_load_s for j in p.receivers}
    may_overflow = _may_overflow(p)
    by_src = {s: [gi for gi, g in enumerate(p.groups) if g.src == s] for s in p.senders}
    moves: list[tuple[int, int, int]] = []
    while clock() < deadline:
        s = max(p.senders, key=lambda i: (load[i], -i))
        top = max(load[s], p.floor)
        best, best_gain = None, EPS
        for gi in by_src[s]:
            g, ri = p.groups[gi], nxt[gi]
            if ri >= len(g.requests):
                continue
            left = load[s] - g.work[s][ri]
            relief = _overflow(p, s, mem[s]) - _overflow(p, s, mem[s] - g.mem[ri]) if may_overflow[s] else 0.0
            for j in p.receivers:
                need = absent[gi][j]
                if (need and slots[j] <= 0) or blocked[gi][j]:
                    continue
                arrive = load[j] + g.work[j][ri] + g.recompute[j][ri] + (load_s[j] if need else 0.0)
                gain = top - max(left, arrive, p.floor) - p.migration_s + relief
                if may_overflow[j]:
                    added = g.mem[ri] + (p.adapter_size(g.adapter) if need else 0)
                    gain += _overflow(p, j, mem[j]) - _overflow(p, j, mem[j] + added)
                if gain > best_gain:
                    best, best_gain = (gi, j), gain
        if best is None:
            return moves
        gi, j = best
        g, ri = p.groups[gi], nxt[gi]
        need = absent[gi][j]
        load[s] -= g.work[s][ri]
        load[j] += g.work[j][ri] + g.recompute[j][ri] + (load_s[j] if need else 0.0)
        mem[s] -= g.mem[ri]
        mem[j] += g.mem[ri] + (p.adapter_size(g.adapter) if need else 0)
        if need:
            for gj, other in enumerate(p.groups):  # the adapter is now on j for every group of it
                if other.adapter == g.adapter:
                    absent[gj][j] = False
            slots[j] -= 1
        nxt[gi] += 1
        moves.append((gi, ri, j))
    return moves
