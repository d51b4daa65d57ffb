"""HiGHS ending with no answer it vouches for: one more run without presolve, then a typed error
that every caller with other ways to a plan or a bound gets past (``solve_model``'s contract)."""
from __future__ import annotations

import pyomo.environ as pyo
import pytest
from pyomo.contrib import appsi

from torchplace import costmodel
from torchplace.errors import SolverError
from torchplace.solvers import solve
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.milp import bounds, highs, maxload

from .graphs import diamond


_TC = appsi.base.TerminationCondition


def _knapsack() -> pyo.ConcreteModel:
    """max 3a + 2b + 4c with 2a + b + 3c <= 4 over binaries (as a minimisation): a + c weighs 5,
    so the optimum is b + c, -6."""
    m = pyo.ConcreteModel()
    m.I = pyo.Set(initialize="abc")
    m.x = pyo.Var(m.I, domain=pyo.Binary)
    m.cap = pyo.Constraint(expr=2 * m.x["a"] + m.x["b"] + 3 * m.x["c"] <= 4)
    m.obj = pyo.Objective(expr=-(3 * m.x["a"] + 2 * m.x["b"] + 4 * m.x["c"]))
    return m


def _solve_errors(monkeypatch, runs: int) -> list[dict]:
    """Make HiGHS's first ``runs`` solves end in a solve error; return the options of every run."""
    options: list[dict] = []
    postsolve = appsi.solvers.Highs._postsolve

    def failing(self, timer):
        options.append(dict(self.highs_options))
        res = postsolve(self, timer)
        if len(options) <= runs:
            res.termination_condition = _TC.error
            res.best_feasible_objective = None
        return res

    monkeypatch.setattr(appsi.solvers.Highs, "_postsolve", failing)
    return options


def test_a_solve_error_is_run_again_without_presolve(monkeypatch):
    options = _solve_errors(monkeypatch, runs=1)
    m = _knapsack()
    res = highs.solve_model(m, name="test model", time_limit=30)
    assert (res.status, res.objective) == ("optimal", pytest.approx(-6.0))
    assert [pyo.value(m.x[i]) for i in "abc"] == pytest.approx([0, 1, 1])
    assert [o.get("presolve") for o in options] == [None, "off"]


def test_a_second_solve_error_is_a_typed_error_naming_the_way_out(monkeypatch):
    _solve_errors(monkeypatch, runs=2)
    with pytest.raises(SolverError, match=r"test model: HiGHS \d+\.\d+\.\d+ stopped with error \(with presolve "
                                          r"and without\).*method='auto'"):
        highs.solve_model(_knapsack(), name="test model", time_limit=30)


def test_a_model_solved_without_presolve_is_not_run_twice(monkeypatch):
    options = _solve_errors(monkeypatch, runs=1)
    with pytest.raises(SolverError, match=r"stopped with error \(once\)"):
        highs.solve_model(_knapsack(), name="test model", time_limit=30, presolve=False)
    assert len(options) == 1


def test_auto_goes_on_when_the_ip_fails_and_bounds_keep_their_floor(monkeypatch):
    """The IP's failure leaves auto with the contiguous plan (tried says why), and a bound MIP's
    failure leaves the bound at the simple bound, which still holds."""
    _solve_errors(monkeypatch, runs=10**6)
    problem = diamond(3.0, 0.5, contiguous=False)  # a -> (b, c) -> d, any split allowed
    plan = solve(problem, "auto", time_limit=30)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.meta["auto"]["ip"].startswith("failed: max-load IP: HiGHS")
    assert bounds.three_superblock_bound(problem, time_limit=10) == simple_lower_bound(problem)
    with pytest.raises(SolverError):
        maxload.solve(problem, time_limit=30)
