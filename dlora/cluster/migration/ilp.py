"""Reactive adapter-request co-migration (dLoRA §5.2): the relaxed ILP, its rounding, the plan.

NOTE on the algorithm (the selective, aggregated, relaxed form of the paper's ILP):
  Sets. S = the top-K overloaded replicas (senders), R = the top-K underloaded (receivers), both
    picked in `migration.problem`; G = groups g = (sender src(g), adapter a(g)) of n_g requests.
  Variables.
    x[g,j] in [0,1], j in R: share of group g's requests moved from src(g) to j (relaxed, as in
      the paper; 1 - sum_j x[g,j] stays). Absent when a(g) is not resident on j and j has no
      free adapter slot.
    y[a,j] in [0,1] (or {0,1} with `binary_adapters`), j in R, a not resident on j: a is loaded.
    T >= floor: the makespan; floor = the largest load outside S and R (those replicas keep it).
    o[j] >= 0: KV tokens above replica j's capacity (only where an overflow is possible).
  Objective. min T + migration_s * sum_{g,j} n_g x[g,j] + sum_j overflow_s_j * o[j]
  Constraints.
    sum_j x[g,j] <= 1                                                  (each request placed once)
    load_s - sum_{g: src=s} W[g,s] sum_j x[g,j] <= T                          for s in S
    load_j + sum_g (W[g,j] + P[g,j]) x[g,j] + sum_a L_j y[a,j] <= T           for j in R
    x[g,j] <= y[a(g),j]                      (a request may only go where its adapter will be)
    sum_a y[a,j] <= free adapter slots of j                                   for j in R
    mem_s - sum_{g: src=s} M_g sum_j x[g,j] - o[s] <= cap_s;  mem_j + sum_g M_g x[g,j]
      + sum_a size_a y[a,j] - o[j] <= cap_j
  where W[g,j] is the group's remaining work if run on j (cost model, merged discount on the
  sender), P[g,j] its re-prefill on j, L_j the adapter load time, M_g its KV tokens.
  Rounding. Per group, the requests (cheapest to move first: queued, then short contexts) are
  split by work so each receiver gets about x[g,j] * W[g,src] of it; adapter loads follow from
  the moves, and receivers over their slot budget drop the adapters with the fewest moves.
  The rounded plan is scored by `evaluate` and replaced by the empty plan if it gains nothing.
  A solver timeout or failure runs `greedy_moves` on the same problem instead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from dlora.cluster.estimators.replica_cost import CostParams
from dlora.cluster.migration.greedy import greedy_moves
from dlora.cluster.migration.lp_solve import Clock, resolve_solver, solve
from dlora.cluster.migration.problem import MigrationConfig, MigrationProblem, build_problem, evaluate
from dlora.cluster.policy_views import AdapterName, ClusterView

Move = tuple[int, int, int]  # (group index, request index in the group, receiver index)


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    """What the migration controller executes: load the adapters, then abort + resubmit moves."""

    moves: tuple[tuple[str, int, int], ...]  # (request_id, src replica_id, dst replica_id)
    loads: tuple[tuple[str, int], ...]  # (adapter, replica_id) to load before the moves
    # "highs" | "cbc" | "greedy" | "none"; "queued" or "rebalance" for a round of queued-request
    # moves (balancer)
    solver: str
    status: str  # solver status, or why the fallback ran / nothing was planned
    solve_ms: float  # wall time of the whole planning call: problem + model + solve + rounding
    solver_ms: float = 0.0  # of which PuLP model building and the solver call (0 for greedy)
    objective_before: float = 0.0
    objective_after: float = 0.0
    makespan_before: float = 0.0
    makespan_after: float = 0.0


@dataclass(slots=True)
class _Model:
    prob: pulp.LpProblem
    x: dict[tuple[int, int], pulp.LpVariable]
    y: dict[tuple[AdapterName, int], pulp.LpVariable]


def _can_receive(p: MigrationProblem, a: AdapterName, j: int) -> bool:
    return not p.batch_blocked(a, j) and (not p.needs_load(a, j) or p.free_slots(j) > 0)


def _affine(terms: list[tuple[pulp.LpVariable, float]], constant: float = 0.0) -> pulp.LpAffineExpression:
    return pulp.LpAffineExpression(terms, constant=constant)


def build_model(p: MigrationProblem, binary_adapters: bool) -> _Model:
    """The LP/MILP of the NOTE above, built term by term (lpSum of products is slower)."""
    prob = pulp.LpProblem("comigration", pulp.LpMinimize)
    t = prob.add_variable("T", lowBound=p.floor)
    cat = pulp.LpBinary if binary_adapters else pulp.LpContinuous
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    y: dict[tuple[AdapterName, int], pulp.LpVariable] = {}
    adapter_ids: dict[AdapterName, int] = {}
    for gi, g in enumerate(p.groups):
        for j in p.receivers:
            if not _can_receive(p, g.adapter, j):
                continue
            x[gi, j] = prob.add_variable(f"x_{gi}_{j}", 0, 1)
            if p.needs_load(g.adapter, j) and (g.adapter, j) not in y:
                ai = adapter_ids.setdefault(g.adapter, len(adapter_ids))
                y[g.adapter, j] = prob.add_variable(f"y_{ai}_{j}", 0, 1, cat)
    obj = [(t, 1.0)] + [(v, p.migration_s * len(p.groups[gi].requests)) for (gi, _), v in x.items()]
    overflow = _add_memory_rows(prob, p, x, y)
    obj += [(v, p.overflow_s[j]) for j, v in overflow.items()]
    prob += _affine(obj)
    _add_placement_rows(prob, p, x)
    _add_load_rows(prob, p, t, x, y)
    for (gi, j), v in x.items():
        key = (p.groups[gi].adapter, j)
        if key in y:
            prob += _affine([(v, 1.0), (y[key], -1.0)]) <= 0
    for j in p.receivers:
        ys = [v for (_, jj), v in y.items() if jj == j]
        if len(ys) > p.free_slots(j):
            prob += _affine([(v, 1.0) for v in ys]) <= p.free_slots(j)
    return _Model(prob, x, y)


def _add_placement_rows(prob: pulp.LpProblem, p: MigrationProblem, x: dict) -> None:
    rows: dict[int, list] = {}
    for (gi, _), v in x.items():
        rows.setdefault(gi, []).append((v, 1.0))
    for terms in rows.values():
        if len(terms) > 1:  # a single x is already bounded by 1
            prob += _affine(terms) <= 1


def _add_load_rows(prob: pulp.LpProblem, p: MigrationProblem, t: pulp.LpVariable, x: dict, y: dict) -> None:
    rows: dict[int, list] = {j: [(t, -1.0)] for j in p.senders + p.receivers}
    for (gi, j), v in x.items():
        g = p.groups[gi]
        rows[g.src].append((v, -sum(g.work[g.src])))
        rows[j].append((v, sum(g.work[j]) + sum(g.recompute[j])))
    for (_, j), v in y.items():
        rows[j].append((v, p.params[j].adapter_load_s))
    for j, terms in rows.items():
        prob += _affine(terms) <= -p.load[j]


def _add_memory_rows(prob: pulp.LpProblem, p: MigrationProblem, x: dict, y: dict) -> dict[int, pulp.LpVariable]:
    """KV rows only where an overflow can happen; returns the overflow variables."""
    rows: dict[int, list] = {j: [] for j in p.senders + p.receivers}
    worst = list(p.mem)
    for (gi, j), v in x.items():
        g = p.groups[gi]
        m = float(sum(g.mem))
        rows[g.src].append((v, -m))
        rows[j].append((v, m))
        worst[j] += m
    for (a, j), v in y.items():
        rows[j].append((v, float(p.adapter_size(a))))
        worst[j] += p.adapter_size(a)
    overflow = {}
    for j, terms in rows.items():
        cap = p.replicas[j].kv_capacity_tokens
        if terms and worst[j] > cap and p.overflow_s[j] > 0:
            overflow[j] = prob.add_variable(f"o_{j}", lowBound=0)
            prob += _affine(terms + [(overflow[j], -1.0)]) <= cap - p.mem[j]
    return overflow


def round_moves(p: MigrationProblem, x: Mapping[tuple[int, int], float]) -> list[Move]:
    """Integral moves from a fractional x (see the NOTE), within each receiver's adapter slots."""
    moves: list[Move] = []
    for gi, g in enumerate(p.groups):
        work = g.work[g.src]
        targets = sorted(((x.get((gi, j), 0.0) * sum(work), j) for j in p.receivers), reverse=True)
        ri = 0
        for share, j in targets:
            moved = 0.0
            while ri < len(work) and share > 0 and moved + work[ri] / 2 <= share:
                moves.append((gi, ri, j))
                moved += work[ri]
                ri += 1
    return _fit_slots(p, moves)


def _fit_slots(p: MigrationProblem, moves: list[Move]) -> list[Move]:
    """Drop the moves of the least-moved new adapters on a receiver with too few slots."""
    count: dict[tuple[AdapterName, int], int] = {}
    for gi, _, j in moves:
        a = p.groups[gi].adapter
        if p.needs_load(a, j):
            count[a, j] = count.get((a, j), 0) + 1
    dropped: set[tuple[AdapterName, int]] = set()
    for j in p.receivers:
        new = sorted(((n, str(a)), a) for (a, jj), n in count.items() if jj == j)
        excess = len(new) - p.free_slots(j)
        dropped.update((a, j) for _, a in new[: max(0, excess)])
    return [m for m in moves if (p.groups[m[0]].adapter, m[2]) not in dropped]


def _solve_moves(
    p: MigrationProblem, cfg: MigrationConfig, deadline: float, clock: Clock
) -> tuple[list[Move], str, str, float]:
    """(moves, solver used, status, ms spent in model building + solver)."""
    if cfg.solver == "greedy":  # the greedy alone, as the planner, within the same deadline
        return greedy_moves(p, deadline, clock), "greedy", "greedy", 0.0
    solver = resolve_solver(cfg.solver)
    t0 = clock()
    model = build_model(p, cfg.binary_adapters)
    result = solve(model.prob, solver, deadline, mip=cfg.binary_adapters, gap=cfg.mip_gap, clock=clock)
    solver_ms = (clock() - t0) * 1e3
    if not result.usable:
        moves = greedy_moves(p, clock() + cfg.fallback_limit_s, clock)
        return moves, "greedy", f"fallback: {solver} {result.status}", solver_ms
    x = {k: v.varValue or 0.0 for k, v in model.x.items()}
    return round_moves(p, x), solver, result.status, solver_ms


def plan_migration(
    cluster: ClusterView,
    params: Mapping[int, CostParams],
    cfg: MigrationConfig | None = None,
    clock: Clock = time.perf_counter,
) -> MigrationPlan:
    """Plan one co-migration round within about `time_limit_s` + `fallback_limit_s` of wall time.

    `params` maps replica_id to its fitted cost coefficients (missing ones use the priors).
    The solver is stopped at `time_limit_s` from the start of the call; if it did not produce a
    usable solution, the greedy runs for at most `fallback_limit_s` more.
    """
    cfg = cfg or MigrationConfig()
    t0 = clock()
    p = build_problem(cluster, params, cfg)
    if p is None:
        why = "nothing to balance (fewer than two replicas, or no requests on the busiest)"
        return MigrationPlan((), (), "none", why, (clock() - t0) * 1e3)
    before, _ = evaluate(p, [])
    moves, solver, status, solver_ms = _solve_moves(p, cfg, t0 + cfg.time_limit_s, clock)
    after, loads = evaluate(p, moves)
    if after.objective >= before.objective - 1e-9:
        moves, loads, after = [], [], before
        status += " (no gain: empty plan)"
    ids = [r.replica_id for r in p.replicas]
    return MigrationPlan(
        moves=tuple((p.groups[gi].requests[ri].request_id, ids[p.groups[gi].src], ids[j]) for gi, ri, j in moves),
        loads=tuple((a, ids[j]) for a, j in loads if a is not None),
        solver=solver,
        status=status,
        solve_ms=(clock() - t0) * 1e3,
        solver_ms=solver_ms,
        objective_before=before.objective,
        objective_after=after.objective,
        makespan_before=before.makespan,
        makespan_after=after.makespan,
    )
