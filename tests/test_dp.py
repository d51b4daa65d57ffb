"""The ideals DP: published optima, brute force on random DAGs, cost-model consistency, errors."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, TooManyIdealsError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import brute_force_contiguous, problems

# Tarnawski et al. 2020, Table 1 (contiguous optimum with the file's own k and l), and the forward
# ideal counts after contraction as printed by the authors' program.
PUBLISHED = {
    "OperatorGraphs/bert_l-3_inference.json": (27.9186, 1428),
    "OperatorGraphs/bert_l-6_inference.json": (29.5795, 1923),
    "OperatorGraphs/bert_l-12_inference.json": (147.478, 2906),
    "OperatorGraphs/resnet50_inference.json": (124.349, 241),
    "OperatorGraphs/bert_l-3_training.json": (65.3031, 2774),
    "OperatorGraphs/bert_l-6_training.json": (72.865, 3776),
    "OperatorGraphs/bert_L-12_training.json": (437.998, 2938),
    "OperatorGraphs/resnet50_training.json": (255.194, 258),
    "LayerGraphs/bert24_inference.json": (17.7899, None),  # authors merge zero-cost nodes: 30
    "LayerGraphs/bert24_training.json": (41.7458, None),
    "LayerGraphs/resnet50_inference.json": (33.7747, 242),
    "LayerGraphs/resnet50_training.json": (78.6318, 242),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dp_reproduces_published_optimum(name, workloads_dir):
    problem = read_dnn_partitioning(DNN / name)
    plan = dp.solve(problem)
    optimum, ideals = PUBLISHED[name]
    assert plan.objective == pytest.approx(optimum, rel=1e-4)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective
    if ideals is not None:
        assert plan.meta["ideals"] == ideals
    plan.validate(problem)
    assert len({s.device for s in plan.stages}) <= len(problem.cluster)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_dp_matches_brute_force(problem):
    expected = brute_force_contiguous(problem)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            dp.solve(problem)
        return
    plan = dp.solve(problem)
    assert plan.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective + 1e-9


def _chain(times, mem, params=1):
    g = OpGraph()
    for i, t in enumerate(times):
        g.add_node(str(i), NodeRecord(str(i), param_bytes=params, times={"accel": t, "cpu": 10 * t}, transfer_time=0.5))
        if i:
            g.add_edge(str(i - 1), str(i))
    return Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel", mem) for i in range(2))))


def test_dp_splits_a_chain_evenly():
    plan = dp.solve(_chain([1, 1, 1, 1], mem=10))
    # two halves of 2.0 compute, each with one 0.5 transfer out / in
    assert plan.objective == pytest.approx(2.5)
    assert [len(s.nodes) for s in plan.stages] == [2, 2]


def test_infeasible_memory_states_the_smallest_memory_that_fits():
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_chain([1, 1, 1, 1, 1], mem=2, params=1))
    assert e.value.min_memory_bytes == 3  # 5 nodes of 1 byte on 2 devices: 3 + 2
    assert "at least 3 bytes" in str(e.value)


def test_too_many_ideals_raises_a_clear_error():
    g = OpGraph()
    for i in range(16):  # no edges: 2**16 ideals
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": 1.0}))
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"),)))
    with pytest.raises(TooManyIdealsError, match="more than 1000 ideals") as e:
        dp.solve(problem, ideal_limit=1000)
    assert e.value.limit == 1000


def test_plan_is_deterministic(workloads_dir):
    problem = read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-3_inference.json")
    assert dp.solve(problem).stages == dp.solve(problem).stages


@settings(max_examples=100, deadline=None)
@given(problems())
def test_dpl_is_valid_and_never_better_than_dp(problem):
    try:
        exact = dp.solve(problem)
    except InfeasibleError:
        return  # DPL searches a subset of the same splits: infeasible too, or a valid plan
    try:
        linear = dp.solve(problem, linearize=True)
    except InfeasibleError:
        return
    assert linear.objective >= exact.objective - 1e-9
    assert linear.objective == costmodel.evaluate(problem, linear)
    assert linear.status == "feasible" and linear.solver == "dpl"
    assert linear.meta["ideals"] <= len(problem.graph) + 1  # a chain: one ideal per (super)node, plus empty


@pytest.mark.parametrize("name", ["OperatorGraphs/bert_l-3_inference.json", "OperatorGraphs/resnet50_training.json"])
def test_dpl_on_published_workloads(name, workloads_dir):
    """Tarnawski Sec. 6: DPL loses nothing on these two."""
    problem = read_dnn_partitioning(DNN / name)
    linear = dp.solve(problem, linearize=True)
    assert linear.objective == pytest.approx(PUBLISHED[name][0], rel=1e-4)


def test_auto_falls_back_to_slicegraph_past_the_ideal_limit():
    from torchplace.solvers import solve

    g = OpGraph()
    for i in range(16):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": float(i + 1)}))
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu"))))
    plan = solve(problem, ideal_limit=1000, time_limit=2)
    assert plan.solver in ("slicegraph", "brkga")
    # the heuristics prove nothing themselves; auto marks the plan optimal only when its bound meets it
    assert (plan.status == "optimal") == (plan.lower_bound >= plan.objective)
    assert plan.meta["auto"]["dp"] == "skipped: more than 1000 ideals"
    assert plan.objective == costmodel.evaluate(problem, plan) <= sum(range(1, 17))
