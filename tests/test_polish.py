"""Local search on a non-contiguous plan (:mod:`torchplace.solvers.polish`): never worse, always
valid, priced as the cost model prices, and it finds the tied-weights plans that no contiguous
split reaches."""
from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import solve
from torchplace.solvers.polish import _Cuts, polish

from .conftest import DNN
from .graphs import problems
from .test_milp_maxload import brute_force


def _tied(accelerators: int = 3) -> Problem:
    """A chain embed -> l1 -> l2 -> head where head also reads embed's big output (a tied
    weight): 10 s to move, 1 s per other tensor, 4 s per layer, 1 s for embed and head."""
    g = OpGraph()
    times = {"embed": 1.0, "l1": 4.0, "l2": 4.0, "head": 1.0}
    for v, t in times.items():
        g.add_node(v, NodeRecord(v, times={"accel": t}, transfer_time=10.0 if v == "embed" else 1.0))
    for u, v in [("embed", "l1"), ("l1", "l2"), ("l2", "head"), ("embed", "head")]:
        g.add_edge(u, v)
    devices = tuple(Device(f"acc{i}", "meta", "accel") for i in range(accelerators))
    return Problem(g, Cluster(devices), contiguous=False)


def test_the_head_joins_the_embedding_that_a_contiguous_split_must_ship():
    problem = _tied()
    dp = solve(dataclasses.replace(problem, contiguous=True), "dp")  # the contiguous optimum
    from torchplace.solvers.auto import _rebuild

    plan = polish(problem, _rebuild(problem, dp), time_limit=None)
    plan.validate(problem)
    # contiguous: any cut before head ships embed's 10 s tensor, so all four stay on one device
    # (10 s); polished: {embed, l1, head} (6 s + l1's output out + l2's in = 8 s) and {l2} (6 s)
    assert dp.objective == pytest.approx(10.0)
    assert dp.objective > brute_force(problem, contiguous=False)
    assert plan.objective == pytest.approx(brute_force(problem, contiguous=False))
    assert plan.meta["polish_moves"] >= 1 and plan.meta["contiguous"] is False


def test_auto_polishes_a_non_contiguous_problem_and_only_those():
    problem = _tied()
    plan = solve(problem, "auto", time_limit=20)
    assert "polish" in plan.meta["auto"] and plan.objective == pytest.approx(brute_force(problem, contiguous=False))
    contiguous = solve(dataclasses.replace(problem, contiguous=True), "auto", time_limit=20)
    assert "polish" not in contiguous.meta["auto"]


def test_a_contiguous_problem_comes_back_unchanged():
    problem = dataclasses.replace(_tied(), contiguous=True)
    plan = solve(problem, "dp")
    assert polish(problem, plan) is plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=6))
def test_polish_never_worsens_and_never_beats_the_optimum(problem):
    problem = dataclasses.replace(problem, contiguous=False)
    try:
        start = solve(dataclasses.replace(problem, contiguous=True), "dp")
    except InfeasibleError:
        return
    from torchplace.solvers.auto import _rebuild

    start = _rebuild(problem, start)
    plan = polish(problem, start, time_limit=None)
    plan.validate(problem)
    assert plan.objective <= start.objective
    best = brute_force(problem, contiguous=False)
    assert not math.isinf(best) and plan.objective >= best - 1e-9


def test_bert12s_tied_output_projection_moves_next_to_the_embedding():
    # BERT-12 (operator graph) on 16 accelerators: the contiguous optimum (79.98) ships the
    # embedding matrix (48 s) to the output projection's device; polished, that device is gone
    from torchplace.solvers.auto import _rebuild
    from torchplace.workloads.dnn_partitioning import read_dnn_partitioning

    problem = dataclasses.replace(
        read_dnn_partitioning(DNN / "OperatorGraphs" / "bert_l-12_inference.json", accelerators=16), contiguous=False)
    dp = _rebuild(problem, solve(dataclasses.replace(problem, contiguous=True), "dp"))
    plan = polish(problem, dp, time_limit=30)
    assert plan.objective < 0.9 * dp.objective
    assert max(c.transfer_in for c in plan.costs) < 40  # no device receives the 48 s matrix


def test_bert12_on_8_devices_moves_layers_and_makes_room_below_the_bottleneck():
    # The contiguous optimum (108.04) holds two whole layers on each of two devices. Moving a
    # layer's operators one at a time only adds transfers, and moving work off those two devices
    # needs room that moves between the devices below them make first: without windows of units,
    # or with moves off the bottleneck alone, the search finds nothing here.
    from torchplace.solvers.auto import _rebuild
    from torchplace.workloads.dnn_partitioning import read_dnn_partitioning

    problem = dataclasses.replace(
        read_dnn_partitioning(DNN / "OperatorGraphs" / "bert_l-12_inference.json", accelerators=8), contiguous=False)
    dp = _rebuild(problem, solve(dataclasses.replace(problem, contiguous=True), "dp"))
    plan = polish(problem, dp, time_limit=60)
    plan.validate(problem)
    assert plan.objective < 0.96 * dp.objective
    assert polish(problem, dp, time_limit=60, window=1).objective == dp.objective


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=7), st.data())
def test_incremental_pricing_equals_the_cost_model(problem, data):
    # what the search prices a move at is each device's load under the cost model after it
    devices = problem.cluster.devices
    assume(len(devices) >= 2)
    nodes = sorted(problem.graph.nx)
    held = [set() for _ in devices]
    for v in nodes:
        held[data.draw(st.integers(0, len(devices) - 1))].add(v)
    d, e = data.draw(st.permutations(range(len(devices))))[:2]
    moved = data.draw(st.sets(st.sampled_from(sorted(held[d])))) if held[d] else set()
    cuts = _Cuts(problem, held)

    def transfer(nodes, device):
        return sum(costmodel.transfers(problem, nodes)) if device.pays_transfer and nodes else 0.0

    changed_d, changed_e, delta_d, delta_e = {}, {}, 0.0, 0.0
    for v in sorted(moved):
        delta_d += cuts.delta(v, cuts.count[d], changed_d, -1)
        delta_e += cuts.delta(v, cuts.count[e], changed_e, 1)
    after_d, after_e = held[d] - moved, held[e] | moved
    assert transfer(held[d], devices[d]) + (delta_d if devices[d].pays_transfer else 0.0) == pytest.approx(
        transfer(after_d, devices[d]), abs=1e-9)
    assert transfer(held[e], devices[e]) + (delta_e if devices[e].pays_transfer else 0.0) == pytest.approx(
        transfer(after_e, devices[e]), abs=1e-9)
    merged = cuts.merged(d, e)
    assert merged == pytest.approx(sum(costmodel.transfers(problem, held[d] | held[e])) if held[d] | held[e] else 0.0,
                                   abs=1e-9)
    cuts.move(moved, d, e)
    again = _Cuts(problem, [after_d if i == d else after_e if i == e else h for i, h in enumerate(held)])
    assert cuts.count == again.count


def test_auto_proves_a_contiguous_problem_over_any_split_without_the_ip_when_the_polished_plan_meets_the_bound():
    # The contiguous optimum is 10; the polished split {embed, l1, head}, {l2} is 8, which the cut
    # bound proves optimal over any split (need(l1) = 8): no MIP can raise the bound past it.
    from torchplace.solvers.auto import solve_auto

    problem = dataclasses.replace(_tied(), contiguous=True)
    plan = solve_auto(problem, time_limit=20, bounds="mip")
    tried = plan.meta["auto"]
    assert plan.objective == pytest.approx(10.0) and plan.lower_bound == pytest.approx(8.0)
    assert tried["polish"] == pytest.approx(8.0) and tried["cut_bound"] == pytest.approx(8.0)
    assert "ip" not in tried and "guess_the_bottleneck_bound" not in tried
