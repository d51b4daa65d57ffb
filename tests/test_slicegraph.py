"""SliceGraph and BRKGA: equal to the DP over all orders, exact pruning, published workloads, limits, errors."""
from __future__ import annotations

import itertools
import math
import random
import time

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel, solvers
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import brkga, dp, slicegraph
from torchplace.solvers.contract import finest_contraction
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import problems
from .graphs import training_problems as random_training_problems
from .test_dp import PUBLISHED


def _all_orders(problem: Problem) -> list[list[str]]:
    """Every topological order of the contracted graph SliceGraph slices, as node orders."""
    _, con = finest_contraction(problem.graph)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(con.nodes)))
    dag.add_edges_from(con.edges)
    return [[v for i in order for v in con.nodes[i].members] for order in nx.all_topological_sorts(dag)]


def _layered(n: int, seed: int, k: int = 4, cpu: bool = False, memory: int | None = None) -> Problem:
    """A layered branching DAG (width 8, edges to the next 1-3 layers) with random costs."""
    rnd = random.Random(seed)
    g = OpGraph()
    for v in range(n):
        t = rnd.uniform(1, 10)
        g.add_node(str(v), NodeRecord(str(v), param_bytes=rnd.randint(1, 10), times={"accel": t, "cpu": 4 * t},
                                      transfer_time=rnd.uniform(0, 3)))
    for v in range(n - 8):
        for _ in range(rnd.randint(1, 3)):
            g.add_edge(str(v), str(min(n - 1, (v // 8 + rnd.randint(1, 3)) * 8 + rnd.randrange(8))))
    devices = [Device(f"acc{i}", "meta", "accel", memory) for i in range(k)]
    return Problem(g, Cluster(tuple(devices + ([Device("cpu0", "cpu", "cpu")] if cpu else []))))


# Every contiguous split is a segmentation of some topological order of the contracted graph (lay
# the pieces out in chain order), so the best over all orders is the ideals DP's optimum. A training
# graph may have two contractions (one per orientation of the backward pieces); SliceGraph slices
# one (finest_contraction) and reaches the DP's optimum when the DP's best split has its
# orientation, and otherwise finds a split no better (or none).
def _check_all_orders_reach_the_dp_optimum(problem: Problem) -> None:
    try:
        best = dp.solve(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            slicegraph.solve(problem, orders=_all_orders(problem), random_orders=0)
        return
    if best.meta["backward_order"] != finest_contraction(problem.graph)[0]:
        try:
            other = slicegraph.solve(problem, orders=_all_orders(problem), random_orders=0)
        except InfeasibleError:
            return
        assert other.objective >= best.objective - 1e-9
        return
    exact = best.objective
    plan = slicegraph.solve(problem, orders=_all_orders(problem), random_orders=0)
    assert plan.objective == pytest.approx(exact, rel=1e-9, abs=1e-12)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective + 1e-9
    assert plan.status == ("optimal" if plan.objective <= plan.lower_bound * (1 + 1e-9) else "feasible")


@settings(max_examples=100, deadline=None)
@given(problems())
def test_all_orders_reach_the_dp_optimum(problem):
    _check_all_orders_reach_the_dp_optimum(problem)


@st.composite
def training_problems(draw, max_forward: int = 4) -> Problem:
    """A random forward DAG, mirrored backward nodes colocated with their forward node (some orphaned)."""
    n = draw(st.integers(1, max_forward))
    g = OpGraph()

    def node(name: str, backward: bool, color: str | None) -> None:
        times = {"cpu": float(draw(st.integers(1, 20)))}
        if draw(st.integers(0, 5)) > 0:
            times["accel"] = float(draw(st.integers(0, 10)))
        g.add_node(name, NodeRecord(name, param_bytes=draw(st.integers(0, 3)), times=times, backward=backward,
                                    transfer_time=float(draw(st.integers(0, 6))), colocation=color))

    for i in range(n):
        node(f"f{i}", False, f"c{i}")
    for i in range(n):
        node(f"b{i}", True, None if draw(st.integers(0, 3)) == 0 else f"c{i}")
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(f"f{u}", f"f{v}")
            g.add_edge(f"b{v}", f"b{u}")
    for i in range(n):
        if i == n - 1 or draw(st.booleans()):
            g.add_edge(f"f{i}", f"b{i}")  # stashed activation / loss
    k, cpus = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    devices = [Device(f"acc{i}", "meta", "accel", draw(st.integers(2, 12))) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus if k + cpus else 1)]
    return Problem(g, Cluster(tuple(devices)), mode="training")


@settings(max_examples=60, deadline=None)
@given(training_problems())
def test_all_orders_reach_the_dp_optimum_in_training(problem):
    _check_all_orders_reach_the_dp_optimum(problem)


@settings(max_examples=60, deadline=None)
@given(random_training_problems())
def test_heuristics_give_contiguous_plans_with_backward_edges_between_classes(problem):
    """SliceGraph, BRKGA and ``auto`` past the ideal limit (which runs them) search one contraction
    (one orientation of the backward pieces): their plans validate as contiguous (``Plan.build``)
    and are never better than the DP's; they find none only where the DP finds none either or
    their orders miss it."""
    try:
        exact = dp.solve(problem).objective
    except InfeasibleError:
        exact = math.inf
    runs = [lambda: slicegraph.solve(problem, random_orders=4), lambda: brkga.solve(problem, population=6, generations=2),
            lambda: solvers.solve(problem, ideal_limit=1, time_limit=5)]
    for run in runs:
        try:
            plan = run()
        except InfeasibleError:
            continue
        assert plan.meta["contiguous"] and plan.objective == costmodel.evaluate(problem, plan)
        assert plan.objective >= exact - 1e-9


@settings(max_examples=60, deadline=None)
@given(problems())
def test_one_order_is_a_valid_split_no_better_than_dp(problem):
    order = problem.graph.topological_order()
    try:
        plan = slicegraph.slice_graph(problem, order)
    except InfeasibleError:
        return
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.objective >= dp.solve(problem).objective - 1e-9


@pytest.mark.parametrize(("seed", "k", "cpu", "memory"), [(0, 3, False, None), (1, 3, True, None), (2, 3, True, 300),
                                                     (3, 4, True, 200)])
def test_pruned_slicing_is_exact(seed, k, cpu, memory):
    """Scanning only starts with compute <= T loses nothing at or below T (module docstring)."""
    problem = _layered(300, seed, k=k, cpu=cpu, memory=memory)
    inst = slicegraph._prepare(problem)
    order = slicegraph._kahn(inst, np.random.default_rng(seed).random(inst.n).tolist())
    full = slicegraph._slice(inst, order)  # window bound grown from 0: no pruning
    grown = slicegraph._slice(inst, order, guess=slicegraph.simple_lower_bound(problem))
    at = slicegraph._slice(inst, order, bound=full.value)
    below = slicegraph._slice(inst, order, bound=0.9 * full.value)
    assert math.isfinite(full.value) and full.exact
    assert grown.value == pytest.approx(full.value, rel=1e-12) and grown.exact
    assert at.value == pytest.approx(full.value, rel=1e-12) and at.exact
    assert not below.exact and below.value >= full.value * (1 - 1e-12)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_workloads_near_optimum(name, workloads_dir):
    """Measured: 8 random orders and BRKGA 8x4 reach the published optimum on all 12 (worst 1.0002)."""
    problem = read_dnn_partitioning(DNN / name)
    optimum = PUBLISHED[name][0]
    for plan in (slicegraph.solve(problem, random_orders=8), brkga.solve(problem, population=8, generations=4)):
        assert optimum * (1 - 1e-4) <= plan.objective <= optimum * 1.001
        assert plan.objective == costmodel.evaluate(problem, plan)


@pytest.mark.parametrize("seed", range(3))
def test_brkga_never_worse_than_the_first_random_order(seed):
    problem = _layered(400, seed, k=4, cpu=True)
    first = slicegraph.solve(problem, seed=seed, random_orders=1)
    plan = brkga.solve(problem, seed=seed, population=8, generations=3)
    assert plan.objective <= first.objective
    assert plan.meta["history"][0][2] == pytest.approx(first.objective)
    values = [h[2] for h in plan.meta["history"]]
    assert values == sorted(values, reverse=True) and plan.meta["generations"] == 3


def _one_heavy_node(n: int = 80) -> Problem:
    """A layered DAG on two devices, transfers free, whose last node (a sink) is heavier than all
    the others together: its time is the lower bound, met by the split that gives it a device of
    its own (the orders that put it last)."""
    problem = _layered(n, 3, k=2)
    g = problem.graph
    for v, r in list(g.records()):
        times = {"accel": 10_000.0, "cpu": 40_000.0} if v == str(n - 1) else r.times
        g.replace_record(v, NodeRecord(r.name, param_bytes=r.param_bytes, times=times, transfer_time=0.0))
    return problem


@pytest.mark.parametrize("method", ["slicegraph", "brkga"])
def test_the_search_stops_at_a_split_that_meets_the_lower_bound(method):
    problem = _one_heavy_node()
    opts = {"random_orders": 500} if method == "slicegraph" else {"population": 20, "generations": 500}
    plan = {"slicegraph": slicegraph.solve, "brkga": brkga.solve}[method](problem, **opts)
    assert plan.status == "optimal" and plan.objective == pytest.approx(plan.lower_bound) == 10_000.0
    assert plan.meta["orders"] < 100  # stopped once it met the bound, not after thousands of orders


def test_brkga_stops_after_generations_without_improvement():
    problem = _layered(200, 0, k=3, cpu=True)
    full = brkga.solve(problem, population=8, generations=60)
    short = brkga.solve(problem, population=8, generations=60, patience=2)
    last = max(h[0] for h in short.meta["history"])  # orders sliced at the last improvement
    assert short.meta["generations"] < 60 and short.meta["orders"] <= last + 3 * 8
    assert short.objective >= full.objective  # the same search, cut short
    with pytest.raises(ValueError, match="patience"):
        brkga.solve(problem, patience=0)


def test_auto_skips_brkga_when_slicegraph_meets_the_bound():
    problem = _one_heavy_node(200)
    plan = solvers.solve(problem, method="auto", ideal_limit=10)  # too many ideals for the DP here
    assert plan.status == "optimal"
    assert "skipped" in plan.meta["auto"]["brkga"], plan.meta["auto"]


def test_search_is_deterministic():
    problem = _layered(200, 0, k=3, cpu=True)
    assert slicegraph.solve(problem, random_orders=4).stages == slicegraph.solve(problem, random_orders=4).stages
    a, b = (brkga.solve(problem, population=6, generations=2) for _ in range(2))
    assert a.stages == b.stages


@pytest.mark.parametrize("method", ["slicegraph", "brkga"])
def test_time_limit_is_honoured(method):
    problem = _layered(600, 1, k=8)  # one order takes well under the limit, even on a busy machine
    opts = {"random_orders": 10**6} if method == "slicegraph" else {"population": 50, "generations": 10**4}
    plan = {"slicegraph": slicegraph.solve, "brkga": brkga.solve}[method](problem, time_limit=1.0, **opts)
    assert plan.meta["timed_out"], plan.meta
    assert plan.status == "time_limit"
    assert plan.seconds <= 1.0 * 1.1 + 0.5
    assert plan.objective == costmodel.evaluate(problem, plan)


def test_a_deadline_passed_between_two_orders_still_says_time_limit():
    """The clock can cross the deadline after an order is sliced and before the loop asks to stop
    (a busy machine preempts right there): the plan must still say the limit cut the search short."""
    problem = _layered(60, 1, k=3)
    search = slicegraph.Search(problem, time_limit=60.0)
    search.evaluate(search.order([0.5] * search.n))
    assert not search.timed_out
    search.deadline = time.monotonic() - 1.0  # as if the deadline passed just after that order
    assert search.done()
    plan = search.plan("slicegraph", False, {})
    assert plan.status == "time_limit" and plan.meta["timed_out"]


def _ctrl_c_at_the_third_order(monkeypatch) -> None:
    """SliceGraph slices two orders, then Ctrl-C arrives while it slices the third."""
    calls, real = [0], slicegraph._slice

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(slicegraph, "_slice", interrupted)


def test_interrupt_returns_the_best_plan_so_far(monkeypatch):
    problem = _layered(100, 2, k=2)
    _ctrl_c_at_the_third_order(monkeypatch)
    plan = slicegraph.solve(problem, random_orders=10)
    assert plan.meta["interrupted"] and plan.meta["orders"] == 2


def test_auto_stops_at_a_ctrl_c_that_ends_its_search(monkeypatch):
    """SliceGraph alone returns its best plan on Ctrl-C; inside auto (and so place()) that plan went
    on to BRKGA, the bounds and the MILP, and a second Ctrl-C was needed (found by fuzzing)."""
    from torchplace import solvers

    problem = _layered(100, 2, k=2)
    _ctrl_c_at_the_third_order(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        solvers.solve(problem, method="auto", time_limit=30, ideal_limit=1)  # the DP skipped: SliceGraph runs


def test_infeasible_memory_raises_with_the_memory_that_fits():
    g = OpGraph()
    for i in range(5):
        g.add_node(str(i), NodeRecord(str(i), param_bytes=1, times={"accel": 1.0}, transfer_time=0.5))
        if i:
            g.add_edge(str(i - 1), str(i))
    problem = Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel", 2) for i in range(2))))
    for solve in (slicegraph.solve, brkga.solve):
        with pytest.raises(InfeasibleError, match="fits once every device has 3 bytes"):
            solve(problem)
    with pytest.raises(InfeasibleError):
        slicegraph.slice_graph(problem, [str(i) for i in range(5)])


def test_operator_no_device_can_run_raises():
    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"cpu": 1.0}))
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel", None),)))
    with pytest.raises(InfeasibleError, match=r"\['a'\].*cannot run on any device kind"):
        slicegraph.solve(problem)


def test_bad_arguments_raise():
    problem = _layered(20, 0)
    with pytest.raises(ValueError, match="every node"):
        slicegraph.slice_graph(problem, ["0", "1"])
    with pytest.raises(ValueError, match="elite"):
        brkga.solve(problem, elite=0.6, mutants=0.5)


@pytest.mark.parametrize("method, opts, match", [
    ("brkga", {"elite": 0.6, "mutants": 0.5}, "elite"),
    ("brkga", {"patience": 0}, "patience"),
    ("auto", {"bounds": "lp"}, "bounds"),
    ("ip", {"symmetry": "rows"}, "symmetry"),
    ("dp", {"generations": 3}, "does not take"),
    ("mtpp", {}, "inference"),
])
def test_bad_options_of_throughput_methods_are_usage_errors(method, opts, match):
    """DESIGN 5: bad input gets a typed error (torchplace.errors), here UsageError (still a
    ValueError); these were plain ValueErrors that ``except TorchplaceError`` missed."""
    from torchplace.errors import UsageError

    problem = _layered(6, 0)
    if method == "mtpp":  # a training graph
        g = OpGraph()
        g.add_node("f", NodeRecord("f", times={"cpu": 1.0}, colocation="k"))
        g.add_node("b", NodeRecord("b", times={"cpu": 1.0}, colocation="k", backward=True))
        g.add_edge("f", "b")
        problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"),)), mode="training")
    with pytest.raises(UsageError, match=match):
        solvers.solve(problem, method, **opts)


def test_chain_has_one_order_and_matches_dp():
    g = OpGraph()
    for i, t in enumerate([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": t, "cpu": 3 * t}, transfer_time=0.5))
        if i:
            g.add_edge(str(i - 1), str(i))
    problem = Problem(g, Cluster((Device("a0", "meta", "accel"), Device("a1", "meta", "accel"), Device("c", "cpu", "cpu"))))
    plan = slicegraph.slice_graph(problem, [str(i) for i in range(8)])
    assert plan.objective == pytest.approx(dp.solve(problem).objective)
    assert math.isfinite(plan.lower_bound) and plan.solver == "slicegraph"
