"""Run a PuLP model under a hard wall-clock deadline, with CBC or HiGHS.

Why not just `prob.solve(PULP_CBC_CMD(timeLimit=...))`:
- CBC runs as a subprocess and can overrun its own `-sec` limit by 15-71 s on large co-migration
  models (its root LP cannot be interrupted). Here the subprocess is started by us and killed at the deadline. The
  spawn itself cannot be interrupted and took up to 0.37 s on a loaded 2-vCPU box, which is
  why HiGHS, in process, is the default whenever `highspy` is installed.
- HiGHS runs in process and honours `time_limit`, but the deadline is also checked from our
  side: an interrupt callback stops simplex / MIP / IPM once the wall clock passes it.
- PuLP reports "Optimal" when a solver stops at its time limit; the status returned here comes
  from `sol_status`, so a time-limited LP (whose point may be infeasible) is a "timeout".
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import pulp
from pulp.apis.coin_api import pulp_cbc_path

Clock = Callable[[], float]

_CBC_EXIT_MARGIN = 0.8  # CBC's own limit, as a share of the time left, so it can write a solution


@dataclass(frozen=True, slots=True)
class SolveResult:
    solver: str  # "highs" | "cbc"
    status: str  # "optimal" | "feasible" | "timeout" | "infeasible" | "error: ..."

    @property
    def usable(self) -> bool:
        return self.status in ("optimal", "feasible")


def highs_available() -> bool:
    return bool(pulp.HiGHS().available())


def resolve_solver(name: str) -> str:
    if name == "auto":
        return "highs" if highs_available() else "cbc"
    if name not in ("highs", "cbc"):
        raise ValueError(f"unknown LP solver {name!r}: supported are auto, highs, cbc")
    return name


def _status(prob: pulp.LpProblem, mip: bool) -> str:
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        # A MIP incumbent is a valid point; a time-limited LP's is not necessarily feasible.
        return "feasible" if mip else "timeout"
    if prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible"
    return "timeout" if prob.sol_status == pulp.LpSolutionNoSolutionFound else f"error: sol_status {prob.sol_status}"


def solve(
    prob: pulp.LpProblem,
    solver: str,
    deadline: float,
    *,
    mip: bool,
    gap: float = 0.05,
    clock: Clock = time.perf_counter,
) -> SolveResult:
    """Solve `prob` in place, giving up at `deadline` (a `clock()` value)."""
    solver = resolve_solver(solver)
    if deadline - clock() <= 0:
        return SolveResult(solver, "timeout")
    try:
        if solver == "highs":
            return SolveResult(solver, _solve_highs(prob, deadline, mip, gap, clock))
        return SolveResult(solver, _solve_cbc(prob, deadline, mip, gap, clock))
    except subprocess.TimeoutExpired:
        return SolveResult(solver, "timeout")
    except Exception as e:  # noqa: BLE001 - a solver failure must never stop the balancer
        return SolveResult(solver, f"error: {type(e).__name__}: {e}")


class BatchedHiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS interface, with the model handed over in one `passModel` call.

    Why: PuLP's own `buildSolverModel` adds every column and row through a separate Python call
    and re-collects the variable list three times per solve; at a few hundred variables that
    was 2-3x the time HiGHS itself spent solving. Same model, same options, same statuses.
    """

    def actualSolve(self, lp: pulp.LpProblem, callback=None):  # noqa: ARG002 - PuLP's signature
        import highspy

        self.createAndConfigureSolver(lp)
        columns = _pass_model(lp, self.mip)
        self.callSolver(lp)
        h = lp.solverModel
        model_status = h.getModelStatus()
        values = list(h.getSolution().col_value)
        for i, v in enumerate(columns):
            v.varValue = values[i] if i < len(values) else None
        lp.assignStatus(*_pulp_status(highspy, model_status, h.getInfo().primal_solution_status))
        return lp.status


def _pass_model(lp: pulp.LpProblem, mip: bool) -> list[pulp.LpVariable]:
    import highspy
    import numpy as np

    index: dict[pulp.LpVariable, int] = {}
    columns: list[pulp.LpVariable] = []

    def col(v: pulp.LpVariable) -> int:
        i = index.get(v)
        if i is None:
            i = index[v] = len(columns)
            columns.append(v)
        return i

    cost = {col(v): a for v, a in lp.objective.items()}
    starts, cols, vals, lower, upper = [0], [], [], [], []
    inf = highspy.kHighsInf
    for c in lp._constraints.values():
        for v, a in c.items():
            if a:
                cols.append(col(v))
                vals.append(a)
        starts.append(len(cols))
        lb, ub = c.getLb(), c.getUb()
        lower.append(-inf if lb is None else lb)
        upper.append(inf if ub is None else ub)
    model = highspy.HighsLp()
    model.num_col_, model.num_row_ = len(columns), len(lower)
    model.col_cost_ = np.array([cost.get(i, 0.0) for i in range(len(columns))], dtype=float)
    model.col_lower_ = np.array([-inf if v.lowBound is None else v.lowBound for v in columns], dtype=float)
    model.col_upper_ = np.array([inf if v.upBound is None else v.upBound for v in columns], dtype=float)
    model.row_lower_, model.row_upper_ = np.array(lower, dtype=float), np.array(upper, dtype=float)
    model.offset_ = float(lp.objective.constant)
    a = model.a_matrix_
    a.format_ = highspy.MatrixFormat.kRowwise
    a.num_col_, a.num_row_ = len(columns), len(lower)
    a.start_, a.index_ = np.array(starts, dtype=np.int32), np.array(cols, dtype=np.int32)
    a.value_ = np.array(vals, dtype=float)
    if mip and any(v.cat == pulp.LpInteger for v in columns):
        kinds = highspy.HighsVarType
        model.integrality_ = [kinds.kInteger if v.cat == pulp.LpInteger else kinds.kContinuous for v in columns]
    lp.solverModel.passModel(model)
    return columns


def _pulp_status(highspy, status, primal_status: int) -> tuple[int, int]:
    s = highspy.HighsModelStatus
    if status == s.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if status in (s.kInfeasible, s.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    stopped = (s.kTimeLimit, s.kInterrupt, s.kIterationLimit, s.kObjectiveBound, s.kObjectiveTarget)
    if status in stopped and primal_status == 2:  # kSolutionStatusFeasible: an incumbent exists
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible  # PuLP's convention
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


def _solve_highs(prob: pulp.LpProblem, deadline: float, mip: bool, gap: float, clock: Clock) -> str:
    import highspy

    def interrupt(_type, _msg, _out, data_in, _user) -> None:
        if clock() >= deadline:
            data_in.user_interrupt = True

    kinds = highspy.cb.HighsCallbackType
    cmd = BatchedHiGHS(
        mip=mip,
        msg=False,
        gapRel=gap,
        threads=1,
        timeLimit=max(1e-3, deadline - clock()),
        callbackTuple=(interrupt, None),
        callbacksToActivate=[kinds.kCallbackSimplexInterrupt, kinds.kCallbackMipInterrupt, kinds.kCallbackIpmInterrupt],
    )
    prob.solve(cmd)
    return _status(prob, mip)


def _run_until(args: list[str], deadline: float, clock: Clock) -> None:
    """Run CBC, killing it at `deadline` (measured after the spawn, which may itself be slow)."""
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=max(0.0, deadline - clock()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _solve_cbc(prob: pulp.LpProblem, deadline: float, mip: bool, gap: float, clock: Clock) -> str:
    # The CBC binary bundled with PuLP, through COIN_CMD (PULP_CBC_CMD is deprecated in 3.3).
    cmd = pulp.COIN_CMD(path=pulp_cbc_path, msg=False)
    if not cmd.available():
        return f"error: no CBC executable at {pulp_cbc_path}"
    with tempfile.TemporaryDirectory(prefix="dlora-cbc-") as tmp:
        mps, sol = os.path.join(tmp, "model.mps"), os.path.join(tmp, "model.sol")
        variables, var_names, con_names, _ = prob.writeMPS(mps, rename=1)
        left = deadline - clock()
        if left <= 0:
            return "timeout"
        args = [
            cmd.path,
            mps,
            "-sec",
            f"{max(0.001, left * _CBC_EXIT_MARGIN):.3f}",
            "-timeMode",
            "elapsed",
            "-ratio",
            str(gap),
            "-threads",
            "1",
            "-solve" if mip else "-initialSolve",
            "-printingOptions",
            "all",
            "-solution",
            sol,
        ]
        _run_until(args, deadline, clock)
        if not os.path.exists(sol):
            return "error: CBC wrote no solution"
        status, values, _, _, _, sol_status = cmd.readsol_MPS(sol, prob, variables, var_names, con_names)
    prob.assignVarsVals(values)
    prob.assignStatus(status, sol_status)
    return _status(prob, mip)
