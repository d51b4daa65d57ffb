"""Archer's MIP lower bounds (Sec. 3.2, 3.3), generalised to any split: proven, and ordered."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.milp import bounds, maxload
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import problems

TOL = 1e-9


def _feasible_objectives(problem: Problem, rng) -> list[float]:
    """Objectives of a few feasible placements: the DP's, and random ones that fit."""
    out = []
    try:
        out.append(dp.solve(problem).objective)
    except InfeasibleError:
        pass
    g, devices = problem.graph, problem.cluster.devices
    for _ in range(20):
        color: dict[str, Device] = {}
        assign = {}
        for v in g.topological_order():
            r = g.record(v)
            assign[v] = color.setdefault(r.colocation, rng.choice(devices)) if r.colocation else rng.choice(devices)
        held = {d.name: [v for v in g if assign[v] is d] for d in devices}
        if any(math.isinf(problem.node_time(v, d)) for v, d in assign.items()) or any(
            d.memory_bytes is not None and costmodel.memory(problem, held[d.name]) > d.memory_bytes for d in devices
        ):
            continue
        out.append(costmodel.evaluate_stages(problem, [Stage(n, tuple(vs)) for n, vs in held.items() if vs])[0])
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=7), st.randoms(use_true_random=False))
def test_bounds_are_ordered_and_below_every_placement(problem, rng):
    try:
        exact = maxload.solve(problem, contiguous=False)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            bounds.guess_the_bottleneck_bound(problem)
        return
    simple = simple_lower_bound(problem)
    three = bounds.three_superblock_bound(problem)
    guess = bounds.guess_the_bottleneck_bound(problem)
    assert simple <= three * (1 + TOL) <= guess * (1 + TOL) ** 2
    assert guess <= exact.objective * (1 + TOL) + TOL
    for objective in _feasible_objectives(problem, rng):
        assert guess <= objective * (1 + TOL) + TOL


def test_one_device_guess_is_exact():
    g = OpGraph()
    for i, t in enumerate([1.0, 2.0, 3.0]):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": t}, transfer_time=1.0))
        if i:
            g.add_edge(str(i - 1), str(i))
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel"),)))
    assert bounds.guess_the_bottleneck_bound(problem) == pytest.approx(6.0)


def test_guess_counts_the_transfers_of_identical_accelerators():
    """A chain of 4 unit-time nodes, each output 0.5 s, on 2 accelerators: any split with both
    devices busy pays a transfer on each side; the simple bound (2.0) cannot see it."""
    g = OpGraph()
    for i in range(4):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": 1.0}, transfer_time=0.5))
        if i:
            g.add_edge(str(i - 1), str(i))
    problem = Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel") for i in range(2))))
    assert simple_lower_bound(problem) == pytest.approx(2.0)
    assert bounds.three_superblock_bound(problem) == pytest.approx(2.5)
    assert bounds.guess_the_bottleneck_bound(problem) == pytest.approx(2.5)
    assert maxload.solve(problem, contiguous=False).objective == pytest.approx(2.5)


def test_bounds_on_a_published_layer_graph(workloads_dir):
    problem = read_dnn_partitioning(DNN / "LayerGraphs/bert24_inference.json")
    simple = simple_lower_bound(problem)
    three = bounds.three_superblock_bound(problem, time_limit=20)
    guess = bounds.guess_the_bottleneck_bound(problem, time_limit=20)
    assert simple <= three <= guess <= 17.7148  # the non-contiguous optimum 17.71472 (max-load IP)
    assert guess > simple * 1.1


def test_a_stopped_mip_still_gives_a_valid_bound(workloads_dir):
    problem = replace(read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-3_inference.json"), contiguous=False)
    quick = bounds.guess_the_bottleneck_bound(problem, time_limit=0.05)
    assert simple_lower_bound(problem) <= quick <= 21.9085  # the non-contiguous optimum 21.9084


def test_infeasible_problem_raises():
    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"accel": 1.0}, param_bytes=10))
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel", 5),)))
    with pytest.raises(InfeasibleError):
        bounds.three_superblock_bound(problem)


def test_auto_with_mip_bounds_proves_a_contiguous_plan_against_every_split(workloads_dir):
    """bert24 inference: the DP's contiguous optimum 17.7899; auto's bounds="mip" runs
    guess-the-bottleneck and the non-contiguous IP (from the DP's plan) for a bound over any
    split, which the non-contiguous optimum 17.71472 caps; the plan stays the contiguous one. The
    cut bound's pigeonhole count (25 layer-sized groups on 6 accelerators: one holds 5) already
    gives 17.695, so the MIPs' bound can only match or pass it."""
    from torchplace.solvers.auto import solve_auto

    problem = read_dnn_partitioning(DNN / "LayerGraphs/bert24_inference.json")
    plain = solve_auto(problem, time_limit=15)
    mip = solve_auto(problem, time_limit=15, bounds="mip")
    assert mip.objective == plain.objective == pytest.approx(17.7899, abs=1e-4)
    assert mip.meta["contiguous"] is not False and mip.solver == plain.solver
    mip.validate(problem)
    assert {"guess_the_bottleneck_bound", "ip"} <= set(mip.meta["auto"])
    assert plain.lower_bound <= mip.lower_bound <= 17.71473
    assert plain.lower_bound == pytest.approx(plain.meta["auto"]["cut_bound"]) == pytest.approx(17.695, abs=1e-6)
    assert mip.lower_bound >= max(mip.meta["auto"]["guess_the_bottleneck_bound"], mip.meta["auto"]["cut_bound"]) - 1e-9


def test_auto_with_mip_bounds_holds_its_time_limit(workloads_dir):
    import time

    from torchplace.solvers.auto import solve_auto

    problem = read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-6_inference.json")
    t0 = time.perf_counter()
    plan = solve_auto(problem, time_limit=4, bounds="mip")
    assert time.perf_counter() - t0 < 4 * 1.1 + 1.5
    plan.validate(problem)
    assert simple_lower_bound(problem) <= plan.lower_bound <= plan.objective


def test_auto_skips_the_ip_once_guess_the_bottleneck_meets_the_plan(workloads_dir, monkeypatch):
    """A bound equal to the plan proves it optimal over any split: the IP has nothing to add."""
    from torchplace.solvers.auto import solve_auto
    from torchplace.solvers.milp import bounds as mip_bounds

    problem = read_dnn_partitioning(DNN / "LayerGraphs/bert24_inference.json")
    dp = solve_auto(problem, time_limit=15)  # the cut bound (17.695) stays below the DP's 17.7899
    assert dp.lower_bound < dp.objective
    monkeypatch.setattr(mip_bounds, "guess_the_bottleneck_bound", lambda problem, time_limit: dp.objective)
    plan = solve_auto(problem, time_limit=15, bounds="mip")
    assert "ip" not in plan.meta["auto"]
    assert plan.lower_bound == pytest.approx(plan.objective) and plan.status == "optimal"
