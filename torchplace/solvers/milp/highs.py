"""Solve a Pyomo model with HiGHS through the appsi interface, with a time limit that holds.

``SolverFactory('appsi_highs').config.time_limit`` is silently ignored, so every MILP in torchplace
goes through :func:`solve_model`, which sets the limit and the relative gap on an
``appsi.solvers.Highs`` instance, checks the termination condition, and returns the incumbent's
value and the proven bound as plain floats.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib import appsi

from torchplace.errors import InfeasibleError, SolverLimitError

__all__ = ["MilpResult", "solve_model"]

_TC = appsi.base.TerminationCondition


@dataclass(frozen=True)
class MilpResult:
    """What HiGHS proved about a model.

    Attributes:
        status: ``"optimal"`` (within ``mip_gap``) or ``"time_limit"`` (incumbent, not proven).
        objective: value of the incumbent loaded into the model's variables.
        bound: best proven lower bound (minimisation).
        seconds: wall time of the solve (model build excluded).
    """

    status: str
    objective: float
    bound: float
    seconds: float


def solve_model(
    model: pyo.ConcreteModel,
    *,
    name: str,
    time_limit: float | None = None,
    mip_gap: float = 1e-6,
    verbose: bool = False,
    warm_start: bool = False,
    presolve: bool = True,
) -> MilpResult:
    """Minimise ``model`` with HiGHS and load the incumbent into its variables.

    Args:
        name: what the model is, for error messages (e.g. ``"max-load IP"``).
        time_limit: seconds HiGHS may run (``None``: no limit).
        mip_gap: relative gap at which the incumbent counts as optimal.
        verbose: stream HiGHS's log.
        warm_start: start from the values already in the model's variables (an incumbent).
        presolve: run HiGHS's presolve. A model whose bound must hold where presolve has been
            seen to cut off the optimum turns it off (see :mod:`torchplace.solvers.milp.moirai`).

    Raises:
        InfeasibleError: if HiGHS proves the model infeasible.
        SolverLimitError: if the limit stopped HiGHS before it found any feasible solution.
    """
    solver = appsi.solvers.Highs()
    if not solver.available():
        raise RuntimeError("HiGHS is not available: pip install highspy")
    solver.config.load_solution = False
    solver.config.mip_gap = mip_gap
    solver.config.stream_solver = verbose
    solver.config.warmstart = warm_start
    if not presolve:
        solver.highs_options = {"presolve": "off"}
    if time_limit is not None:
        solver.config.time_limit = float(time_limit)
    t0 = time.perf_counter()
    res = solver.solve(model)
    seconds = time.perf_counter() - t0
    tc = res.termination_condition
    if tc in (_TC.infeasible, _TC.infeasibleOrUnbounded):
        raise InfeasibleError(f"{name}: HiGHS proved that no placement satisfies the constraints")
    bound = res.best_objective_bound
    bound = None if bound is None or not math.isfinite(bound) else float(bound)
    incumbent = res.best_feasible_objective
    if incumbent is None or not math.isfinite(incumbent):
        if tc == _TC.maxTimeLimit:
            raise SolverLimitError(
                f"{name}: no feasible placement found within the {time_limit} s time limit "
                f"(proven lower bound {bound}); raise the time limit or use a heuristic method",
                time_limit, bound,
            )
        raise RuntimeError(f"{name}: HiGHS stopped with {tc.name} and no solution")
    if tc not in (_TC.optimal, _TC.maxTimeLimit):
        raise RuntimeError(f"{name}: HiGHS stopped with {tc.name}")
    res.solution_loader.load_vars()
    status = "optimal" if tc == _TC.optimal else "time_limit"
    if bound is None:
        bound = float(incumbent) if status == "optimal" else 0.0
    return MilpResult(status, float(incumbent), bound, seconds)
