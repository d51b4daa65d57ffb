"""HiGHS ending with no answer it vouches for: one more run without presolve, then a typed error
that every caller with other ways to a plan or a bound gets past (``solve_model``'s contract)."""
from __future__ import annotations

import signal

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


def _spoil_first_runs(monkeypatch, runs: int, spoil) -> list[dict]:
    """Pass the results of HiGHS's first ``runs`` solves through ``spoil``; return every run's options."""
    options: list[dict] = []
    postsolve = appsi.solvers.Highs._postsolve

    def spoiled(self, timer):
        options.append(dict(self.highs_options))
        res = postsolve(self, timer)
        if len(options) <= runs:
            spoil(res)
        return res

    monkeypatch.setattr(appsi.solvers.Highs, "_postsolve", spoiled)
    return options


def _solve_errors(monkeypatch, runs: int) -> list[dict]:
    """Make HiGHS's first ``runs`` solves end in a solve error; return the options of every run."""
    def error(res) -> None:
        res.termination_condition = _TC.error
        res.best_feasible_objective = None

    return _spoil_first_runs(monkeypatch, runs, error)


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


def _stale_answers(monkeypatch, runs: int) -> list[dict]:
    """Make HiGHS's first ``runs`` solves report an objective better than the values it hands back
    (as 1.16 did from a MIP start, handing back the start's values); return every run's options."""
    def better(res) -> None:
        res.best_feasible_objective -= 1.0

    return _spoil_first_runs(monkeypatch, runs, better)


def test_values_not_worth_the_reported_objective_are_solved_again_without_presolve(monkeypatch):
    options = _stale_answers(monkeypatch, runs=1)
    m = _knapsack()
    m.x["a"].value, m.x["b"].value, m.x["c"].value = 1, 1, 0  # a start worth -5
    res = highs.solve_model(m, name="test model", time_limit=30, warm_start=True)
    assert (res.status, res.objective) == ("optimal", pytest.approx(-6.0))
    assert pyo.value(m.obj) == pytest.approx(res.objective)
    assert [o.get("presolve") for o in options] == [None, "off"]


def test_values_never_worth_the_reported_objective_are_a_typed_error(monkeypatch):
    _stale_answers(monkeypatch, runs=2)
    with pytest.raises(SolverError, match=r"with presolve and without.*values worth -6, not the -7"):
        highs.solve_model(_knapsack(), name="test model", time_limit=30, warm_start=True)


def test_the_ip_from_a_start_returns_the_optimum_it_reports():
    """HiGHS 1.16 with presolve, started from the DP's plan (all on the CPU, 39), reported the
    optimum 19 and handed back the start: the IP raised AssertionError, and so did auto."""
    import dataclasses

    from torchplace.devices import Cluster, Device
    from torchplace.graph import NodeRecord, OpGraph
    from torchplace.problem import Problem

    g = OpGraph()
    for v, pb, tb, ob, times, tt, col in (
            ("0", 1, 2, 1, {"accel": 9.0, "fast": 7.0, "cpu": 1.0}, None, "k2"),
            ("1", 1, 1, 4, {"fast": 0.0, "cpu": 12.0}, 0.0, "k1"),
            ("2", 2, 0, 0, {"accel": 6.0, "fast": 4.0, "cpu": 5.0}, 3.0, "k2"),
            ("3", 0, 1, 2, {"accel": 8.0, "fast": 1.0, "cpu": 20.0}, 3.0, None),
            ("4", 4, 1, 0, {"accel": 5.0, "fast": 0.0, "cpu": 1.0}, 2.0, "k1")):
        g.add_node(v, NodeRecord(v, param_bytes=pb, temp_bytes=tb, output_bytes=ob, times=times, transfer_time=tt,
                                 colocation=col))
    for u, v in ("01", "02", "03", "04", "12", "14", "24", "34"):
        g.add_edge(u, v)
    devices = (Device("acc0", "meta", "accel", 6), Device("acc1", "meta", "accel", 13),
               Device("fast0", "meta", "fast", 1), Device("cpu0", "cpu", "cpu"))
    problem = Problem(g, Cluster(devices, bandwidth=2.0, latency=0.5), contiguous=False)
    start = solve(dataclasses.replace(problem, contiguous=True), "dp")
    assert start.objective == 39.0
    for plan in (maxload.solve(problem, warm_start=start), solve(problem, "auto", time_limit=30)):
        assert plan.objective == 19.0 == costmodel.evaluate(problem, plan)


def test_ctrl_c_while_highs_runs_stops_it_and_raises_keyboard_interrupt(monkeypatch):
    """Ctrl-C in HiGHS's solve arrived inside its interrupt callback, which dropped the KeyboardInterrupt:
    the solve ran on to its time limit and returned a plan, or ended as a "solve error" that auto then
    went past (found by fuzzing). The SIGINT is sent from HiGHS's first callback, while it solves."""
    solve_highs, pressed = appsi.solvers.Highs._solve, []

    def ctrl_c_while_solving(self, timer):
        def press(event):
            if not pressed:
                pressed.append(True)
                signal.raise_signal(signal.SIGINT)
        self._solver_model.cbSimplexInterrupt += press
        self._solver_model.cbMipInterrupt += press
        return solve_highs(self, timer)

    monkeypatch.setattr(appsi.solvers.Highs, "_solve", ctrl_c_while_solving)
    m = pyo.ConcreteModel()  # a knapsack of 40 items: HiGHS calls back before it ends
    m.I = pyo.RangeSet(40)
    m.x = pyo.Var(m.I, domain=pyo.Binary)
    m.cap = pyo.Constraint(expr=sum((7 * i % 13 + 3) * m.x[i] for i in m.I) <= 50)
    m.obj = pyo.Objective(expr=-sum((5 * i % 11 + 1) * m.x[i] for i in m.I))
    with pytest.raises(KeyboardInterrupt):
        highs.solve_model(m, name="knapsack", time_limit=30, presolve=False)
    assert pressed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    assert highs.solve_model(_knapsack(), name="test model", time_limit=30).status == "optimal"  # no stop left over
