"""Solve a Pyomo model with HiGHS through the appsi interface, with a time limit that holds.

``SolverFactory('appsi_highs').config.time_limit`` is silently ignored, so every MILP in torchplace
goes through :func:`solve_model`, which sets the limit and the relative gap on an
``appsi.solvers.Highs`` instance, checks the termination condition, and returns the incumbent's
value and the proven bound as plain floats.

With a :class:`~torchplace.solvers.limits.Budget` the limit covers the hand-over too: appsi
translates the model constraint by constraint in Python (often longer than building it), so the
constraints go over in chunks with the budget checked between them, and HiGHS gets the time left
minus a reserve for reading the solution back and building the plan. HiGHS's MIP presolve looks at
its clock rarely (a 39k-row latency IP ran 4 s past a 1 s limit in presolve), so when the time
left is shorter than presolve may take, HiGHS runs without it and stops on time.

Ctrl-C stops HiGHS: a ``KeyboardInterrupt`` raised inside its interrupt callback would be dropped
there (the solve ran on to its time limit and returned a plan, or ended as a "solve error"), so
the signal is held while HiGHS runs, asks it to stop, and is raised once it has.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pyomo.environ as pyo
from pyomo.contrib import appsi

from torchplace.errors import InfeasibleError, MissingDependencyError, SolverError, SolverLimitError
from torchplace.interrupts import held_interrupt
from torchplace.solvers.limits import Budget

__all__ = ["MilpResult", "solve_model"]

_TC = appsi.base.TerminationCondition
_CHUNK = 2048  # constraints handed to HiGHS between two looks at the budget
# Time kept back from HiGHS for reading the solution and building the plan, as a share of the
# hand-over time (both scale with the model; measured below a fifth), at most a tenth of the limit.
_RESERVE_SHARE = 0.25
# HiGHS 1.15's presolve took 7-77 us per nonzero on the shared workloads' models (the most on
# big-M latency IPs), checking its time limit only between some of its passes.
_PRESOLVE_SECONDS_PER_NONZERO = 80e-6
# appsi re-scans the whole model before a solve unless told nothing changed since set_instance
_NO_UPDATES = ("check_for_new_or_removed_constraints", "check_for_new_or_removed_vars",
               "check_for_new_or_removed_params", "check_for_new_objective", "update_constraints",
               "update_vars", "update_params", "update_named_expressions", "update_objective")


_APPSI_LOG = logging.getLogger("pyomo.contrib.appsi.solvers.highs")


class _QuietStop(logging.Filter):
    """Drops appsi's warning about HiGHS's "interrupted" status (Ctrl-C, raised once HiGHS stops)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kInterrupt" not in record.getMessage()


class _BudgetedHighs(appsi.solvers.Highs):
    """appsi's HiGHS interface handing the constraints over in chunks, checking a budget between them."""

    budget: Budget | None = None

    def add_constraints(self, cons: Sequence[object]) -> None:
        for start in range(0, len(cons), _CHUNK):
            if self.budget is not None:
                self.budget.check("handing the model to HiGHS")
            super().add_constraints(list(cons[start:start + _CHUNK]))

    def nonzeros(self) -> int:
        """Nonzeros of the model handed over."""
        return int(self._solver_model.getNumNz())

    def stop_soon(self) -> None:
        """Ask a running HiGHS to stop at its next interrupt check (appsi registers that callback)."""
        highs = self._solver_model  # None until set_instance
        if highs is not None and hasattr(highs, "cancelSolve"):
            highs.cancelSolve()

    def solve_stoppable(self, model: pyo.ConcreteModel) -> appsi.base.Results:
        """``solve(model)`` that Ctrl-C stops (module docstring).

        Raises:
            KeyboardInterrupt: SIGINT arrived while HiGHS ran (raised once it has stopped).
        """
        quiet = _QuietStop()
        _APPSI_LOG.addFilter(quiet)
        try:
            with held_interrupt(self.stop_soon):
                return self.solve(model)
        finally:
            _APPSI_LOG.removeFilter(quiet)


def _highs_seconds(budget: Budget, handover: float) -> float:
    """Seconds HiGHS may run: what is left of the budget after a reserve for the plan, which
    grows with the model as the hand-over time does (``handover`` seconds).

    Raises:
        SolverLimitError: if nothing is left.
    """
    left = budget.remaining()
    assert left is not None and budget.time_limit is not None
    reserve = min(0.1 * budget.time_limit, _RESERVE_SHARE * handover)
    if left - reserve <= 0:
        raise budget.time_error("handing the model to HiGHS", ", leaving HiGHS no time")
    return left - reserve


@dataclass(frozen=True)
class MilpResult:
    """What HiGHS proved about a model.

    Attributes:
        status: ``"optimal"`` (within ``mip_gap``) or ``"time_limit"`` (incumbent, not proven).
        objective: value of the incumbent loaded into the model's variables.
        bound: best proven lower bound (minimisation).
        seconds: wall time of the hand-over to HiGHS and the solve (model build excluded).
    """

    status: str
    objective: float
    bound: float
    seconds: float

    def scaled(self, unit: float) -> MilpResult:
        """The result with objective and bound in seconds, for a model whose time unit is ``unit``
        seconds (the MILPs scale times, :func:`torchplace.solvers.milp.maxload.unit_for`)."""
        return replace(self, objective=self.objective * unit, bound=self.bound * unit)


def _objective(model: pyo.ConcreteModel) -> pyo.Objective:
    return next(model.component_data_objects(pyo.Objective, active=True))


def _stale(model: pyo.ConcreteModel, res: appsi.base.Results) -> bool:
    """Load HiGHS's incumbent into ``model`` and say whether its values are not worth the objective
    HiGHS reported for it (HiGHS 1.16 with a MIP start and presolve handed back the start's values
    with the optimum's objective on a 5-node max-load IP)."""
    incumbent = res.best_feasible_objective
    if (res.termination_condition not in (_TC.optimal, _TC.maxTimeLimit) or incumbent is None
            or not math.isfinite(incumbent)):
        return False
    res.solution_loader.load_vars()
    return not math.isclose(pyo.value(_objective(model)), incumbent, rel_tol=1e-6, abs_tol=1e-6)


def _failed(name: str, tc: _TC, solver: appsi.solvers.Highs, retried: bool, what: str = "") -> SolverError:
    tried = "with presolve and without" if retried else "once"
    version = ".".join(map(str, solver.version()))
    return SolverError(
        f"{name}: HiGHS {version} stopped with {tc.name} ({tried}) and no answer it could vouch for"
        f"{' (' + what + ')' if what else ''}; "
        "use method='auto' (it goes on with the other methods) or 'dp', or another highspy version "
        "(torchplace is tested with 1.15 and 1.16)"
    )


def solve_model(
    model: pyo.ConcreteModel,
    *,
    name: str,
    time_limit: float | None = None,
    mip_gap: float = 1e-6,
    verbose: bool = False,
    warm_start: bool = False,
    presolve: bool = True,
    budget: Budget | None = None,
    unit: float = 1.0,
    known_bound: float = 0.0,
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
        budget: the solver's budget (instead of ``time_limit``): the hand-over checks it, and
            HiGHS gets what is left of it.
        unit: seconds per unit of the model's objective. The result is in model units; the bound
            a :class:`~torchplace.errors.SolverLimitError` carries (and its message) is in seconds,
            as every caller of a solver reads it.
        known_bound: a lower bound in seconds the caller has proven otherwise (a combinatorial
            one): the bound a SolverLimitError carries is at least it, and its message names one
            only where one is proven (HiGHS's or this).

    Raises:
        InfeasibleError: if HiGHS proves the model infeasible.
        SolverLimitError: if the limit stopped HiGHS before it found any feasible solution, or
            passed while the model was handed over.
        ModelTooLargeError: if the hand-over outgrew the budget's memory.
        SolverError: if HiGHS ended with no answer it could vouch for (a solve error, run once more
            without presolve first).
        MissingDependencyError: if highspy is not installed.
    """
    solver = _BudgetedHighs()
    if not solver.available():
        raise MissingDependencyError("HiGHS is not available: pip install highspy")
    solver.config.load_solution = False
    solver.config.mip_gap = mip_gap
    solver.config.stream_solver = verbose
    solver.config.warmstart = warm_start
    if not presolve:
        solver.highs_options = {"presolve": "off"}
    t0 = time.perf_counter()
    if budget is not None:
        solver.budget = budget
        solver.set_instance(model)
        for flag in _NO_UPDATES:
            setattr(solver.update_config, flag, False)
        if budget.deadline is not None:
            time_limit = _highs_seconds(budget, time.perf_counter() - t0)
            if time_limit < _PRESOLVE_SECONDS_PER_NONZERO * solver.nonzeros():
                solver.highs_options = {"presolve": "off"}  # it would run past the deadline
    if time_limit is not None:
        solver.config.time_limit = float(time_limit)
    started, retried = time.perf_counter(), False
    res = solver.solve_stoppable(model)
    stale = warm_start and _stale(model, res)
    if (res.termination_condition == _TC.error or stale) and solver.highs_options.get("presolve") != "off":
        # HiGHS sets "solve error" when the answer fails its own check ("MIP solver claims
        # optimality, but with primal infeasibilities": ERGO-Code/HiGHS #2782, #2808), usually
        # after presolve; and 1.16, started from a MIP start, was seen to report a better optimum
        # than the start while handing back the start's values (``_stale``): once more without
        # presolve, in the time the first run left.
        solver.highs_options = {**solver.highs_options, "presolve": "off"}
        if time_limit is not None:
            solver.config.time_limit = max(0.0, float(time_limit) - (time.perf_counter() - started))
        res, retried = solver.solve_stoppable(model), True
    seconds = time.perf_counter() - t0
    if budget is not None and budget.time_limit is not None:
        time_limit = budget.time_limit  # what the user asked for, in messages
    tc = res.termination_condition
    if tc in (_TC.infeasible, _TC.infeasibleOrUnbounded):
        raise InfeasibleError(f"{name}: HiGHS proved that no placement satisfies the constraints")
    bound = res.best_objective_bound
    bound = None if bound is None or not math.isfinite(bound) else float(bound)
    incumbent = res.best_feasible_objective
    if incumbent is None or not math.isfinite(incumbent):
        if tc == _TC.maxTimeLimit:
            seconds_bound = max(bound * unit, known_bound) if bound is not None else known_bound or None
            proven = "" if seconds_bound is None else f" (proven lower bound {seconds_bound:.6g} s)"
            raise SolverLimitError(
                f"{name}: no feasible placement found within the {time_limit} s time limit{proven}; raise the "
                "time limit or use a heuristic method",
                time_limit, seconds_bound,
            )
        raise _failed(name, tc, solver, retried)
    if tc not in (_TC.optimal, _TC.maxTimeLimit):
        raise _failed(name, tc, solver, retried)
    if _stale(model, res):  # (loads the values)
        raise _failed(name, tc, solver, retried, f"values worth {pyo.value(_objective(model)):.6g}, not the "
                      f"{float(incumbent):.6g} it reported")
    status = "optimal" if tc == _TC.optimal else "time_limit"
    if bound is None:
        bound = float(incumbent) if status == "optimal" else 0.0
    return MilpResult(status, float(incumbent), bound, seconds)
