"""Solvers under a training Pipeline: the ideals DP exact over contiguous splits and recomputation,
every other solver's plans fitting, and infeasible problems saying what would fit (issue 10,
items 3 and 7)."""
from __future__ import annotations

import dataclasses
import math

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from torchplace import costmodel, solvers
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Pipeline, Problem
from torchplace.solvers import dp
from torchplace.solvers.contract import contractions
from torchplace.solvers.milp import bounds
from torchplace.solvers.slicegraph import Search

from .graphs import brute_force_pipelined, pipelined_problems

QUICK = {"brkga": {"population": 6, "generations": 3}, "slicegraph": {"random_orders": 4}}


def _solve_or_none(problem: Problem, method: str, **opts):
    try:
        return solvers.solve(problem, method, time_limit=30, **opts)
    except InfeasibleError:
        return None


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelined_problems())
def test_dp_is_the_brute_force_optimum_over_splits_and_recomputation(problem):
    """Every contiguous assignment, every pipeline order of its devices and every recomputation
    choice per device, costed by the cost model: the DP finds the least max-load that fits, its
    objective is the cost model's, and it raises exactly when nothing fits."""
    best = brute_force_pipelined(problem)
    if math.isinf(best):
        with pytest.raises(InfeasibleError):
            dp.solve(problem)
        return
    plan = dp.solve(problem)
    assert plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.status == "optimal" and plan.lower_bound <= plan.objective + 1e-9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelined_problems())
def test_every_other_solver_plans_fit_and_never_beat_the_brute_force(problem):
    """Plans validate under the pipeline's memory (``solvers.solve`` builds them on the true
    problem), contiguous ones are never better than the best contiguous split, an "optimal" one is
    that split, and every lower bound holds below it."""
    best = brute_force_pipelined(problem)
    for method in ("dpl", "slicegraph", "brkga", "ip", "auto"):
        plan = _solve_or_none(problem, method, **QUICK.get(method, {}))
        if plan is None:
            continue
        assert plan.objective == costmodel.evaluate(problem, plan)
        assert plan.objective >= best - 1e-9, method
        assert plan.lower_bound <= best + 1e-9, method
        if plan.status == "optimal":
            assert plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12), method
    loose = _solve_or_none(dataclasses.replace(problem, contiguous=False), "ip")
    if loose is not None:
        assert loose.lower_bound <= min(best, loose.objective) + 1e-9


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelined_problems(max_forward=2, max_backward=2))
def test_mip_bounds_hold_under_a_pipeline(problem):
    """Archer's MIP bounds, computed on the per-node memory relaxation, stay below the best split."""
    best = brute_force_pipelined(problem)
    if math.isinf(best):
        return
    assert bounds.three_superblock_bound(problem, time_limit=10) <= best + 1e-6
    assert bounds.guess_the_bottleneck_bound(problem, time_limit=10) <= best + 1e-6


# -- hand-worked cases ---------------------------------------------------------------------------


def _layers(saved: int | list[int], output: int, n: int, fw: float = 1.0, bw: float = 2.0,
            cpu: float | None = None) -> OpGraph:
    """f0 -> ... -> f(n-1) -> b(n-1) -> ... -> b0, fi colocated with bi: each forward node keeps
    ``saved`` bytes for backward (or ``saved[i]``) and outputs ``output`` bytes (for the whole
    batch); no parameters, no working memory, no transfer cost. With ``cpu``, a forward node takes
    that long on a CPU."""
    g = OpGraph()
    for i in range(n):
        fw_times, bw_times = {"accel": fw}, {"accel": bw}
        if cpu is not None:
            fw_times, bw_times = {**fw_times, "cpu": cpu}, {**bw_times, "cpu": bw}
        keeps = saved[i] if isinstance(saved, list) else saved
        g.add_node(f"f{i}", NodeRecord(f"f{i}", output_bytes=output, saved_bytes=keeps, times=fw_times,
                                       colocation=f"c{i}", transfer_time=0.0))
        g.add_node(f"b{i}", NodeRecord(f"b{i}", times=bw_times, colocation=f"c{i}", backward=True,
                                       transfer_time=0.0))
        g.add_edge(f"f{i}", f"b{i}")
        if i:
            g.add_edge(f"f{i - 1}", f"f{i}")
            g.add_edge(f"b{i}", f"b{i - 1}")
    return g


def _problem(g: OpGraph, devices: int, cap: int, pipeline: Pipeline) -> Problem:
    cluster = Cluster(tuple(Device(f"d{i}", "meta", "accel", cap) for i in range(devices)))
    return Problem(g, cluster, mode="training", pipeline=pipeline)


def test_1f1b_fits_where_gpipe_does_not():
    """Three layers saving 120 bytes each, m = 4 (30 bytes a micro-batch), three devices of 100
    bytes. One layer per device: 1F1B holds min(4, 3 - j) = 3, 2, 1 micro-batches (90, 60, 30
    bytes: fits) and the load is 1 + 2 = 3 on each, the total 9 over 3 devices: optimal. GPipe
    holds 4 everywhere (120 bytes on any device with a layer): nothing fits."""
    g = _layers(saved=120, output=40, n=3)
    plan = dp.solve(_problem(g, 3, 100, Pipeline(4, "1f1b", recompute=False)))
    assert plan.objective == 3.0
    assert sorted(c.memory for c in plan.costs) == [30, 60, 90]
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_problem(g, 3, 100, Pipeline(4, "gpipe", recompute=False)))
    assert e.value.min_memory_bytes == 120
    message = str(e.value)
    assert "at least 120 bytes" in message and "schedule='1f1b'" in message
    # recomputing d1 keeps f0's output, 4 x 10, and one micro-batch's 30 bytes: 70 <= 100, and d0
    # (no forward inputs) 30 bytes, d2 4 x 10 + 30 = 70: recomputation would fit too
    assert "recompute=True" in message
    assert "microbatches=" not in message  # 1F1B at the same m already fits: no need to say more
    assert "one more device" not in message  # any device with a layer still holds 120 bytes


def test_only_recomputation_fits():
    """Two layers saving 200 bytes each, m = 2, 1F1B, two devices of 150 bytes. The first device
    holds min(2, 2) = 2 micro-batches of 100 bytes: 200 > 150, unless it recomputes (it has no
    forward inputs: 0 x 2 + 100 = 100); the second holds 1 (100 bytes). One device for both holds
    200 either way. So the only plans recompute on the first device: its load is f0 twice + b0 =
    1 + 1 + 2 = 4, the second's 1 + 2 = 3."""
    g = _layers(saved=200, output=20, n=2)
    problem = _problem(g, 2, 150, Pipeline(2, "1f1b", recompute=True))
    plan = dp.solve(problem)
    assert plan.objective == 4.0
    first = next(s.device for s in plan.stages if "f0" in s.nodes)
    assert {s.device: s.recompute for s in plan.stages} == {first: True, ({"d0", "d1"} - {first}).pop(): False}
    assert brute_force_pipelined(problem) == 4.0


def test_without_recomputation_the_error_names_it_and_the_micro_batches_that_fit():
    """The case above without recomputation: the least memory is 200 (the first device's two
    micro-batches); recomputation fits; with m = 3 the first device holds 2 x ceil(200 / 3) = 134
    <= 150 and the second 67, so 3 micro-batches fit (m = 2 is the problem's own)."""
    g = _layers(saved=200, output=20, n=2)
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_problem(g, 2, 150, Pipeline(2, "1f1b", recompute=False)))
    assert e.value.min_memory_bytes == 200
    message = str(e.value)
    assert "recompute=True" in message and "microbatches=3 " in message
    assert "schedule=" not in message and "one more device" not in message
    assert "\n" not in message


@pytest.mark.parametrize("schedule, more", [("1f1b", "microbatches=2 "),
                                            ("gpipe", "microbatches=2 with schedule='1f1b'")])
def test_the_fewest_micro_batches_may_be_fewer_than_the_devices(schedule, more):
    """Layers saving 10, 10 and 150 bytes, one micro-batch, three devices of 100 bytes: the last
    layer's device holds 150 (so at least 150 is needed). Under 1F1B with m = 2 the last device
    holds 1 x 75 and the others 2 x 5: it fits, with m below the device count (where memory is not
    monotone in m, so each m is tried). Recomputing with one micro-batch in flight saves nothing,
    and a fourth device leaves the last layer's 150 bytes where they are."""
    g = _layers(saved=[10, 10, 150], output=10, n=3)
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_problem(g, 3, 100, Pipeline(1, schedule, recompute=False)))
    assert e.value.min_memory_bytes == 150
    message = str(e.value)
    assert more in message
    assert "recompute=True" not in message and "one more device" not in message


def test_the_error_names_another_device_when_one_more_fits():
    """Three layers of 100 saved bytes, GPipe with m = 1, two devices of 150 bytes: a device holds
    one layer (100), two do not fit (200). Three layers need three devices."""
    g = _layers(saved=100, output=10, n=3)
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_problem(g, 2, 150, Pipeline(1, "gpipe", recompute=False)))
    assert e.value.min_memory_bytes == 200
    message = str(e.value)
    assert "one more device like 'd0'" in message
    assert "50 bytes more than the largest limit" in message
    # 1F1B with m = 2: f0 alone first holds 2 x 50, f1 and f2 last hold 1 x 100: both fit
    assert "microbatches=2 with schedule='1f1b'" in message
    # recomputing keeps inputs plus one micro-batch's 200 bytes on a two-layer device: no help
    assert "recompute=True" not in message


def test_the_ip_falls_back_to_all_micro_batches_in_flight():
    """GPipe, m = 4, no recomputation, three layers saving 120 bytes each, an accelerator of 130
    bytes and a CPU ten times slower. The relaxation counts one micro-batch per node (30 bytes a
    layer) and puts all three on the accelerator (load 3), where GPipe holds 4 x 90 = 360 bytes:
    its plan does not fit. The restriction counts 4 x 30 = 120 bytes a layer, so the accelerator
    takes one layer and the CPU two (load 20), the optimum (the DP's, and SliceGraph's)."""
    g = _layers(saved=120, output=40, n=3, bw=0.0, cpu=10.0)
    cluster = Cluster((Device("acc", "meta", "accel", 130), Device("cpu", "cpu", "cpu")))
    problem = Problem(g, cluster, mode="training", pipeline=Pipeline(4, "gpipe", recompute=False))
    plan = solvers.solve(problem, "ip")
    assert plan.meta["pipeline_memory"] == "conservative"
    assert plan.objective == 20.0 == dp.solve(problem).objective == solvers.solve(problem, "slicegraph").objective
    assert plan.lower_bound <= 3.0 and plan.status == "feasible"  # the relaxation's optimum bounds the true one


def test_the_ip_s_plan_recomputes_where_its_position_needs_it():
    """The recomputation case above: the relaxation (100 bytes a layer) splits the layers one per
    device; at its pipeline position the first device holds 200 bytes, so it recomputes (load 4).
    The restriction (2 x 100 bytes a layer) has no plan. The IP's plan is the optimum, but the
    relaxation's bound (3) cannot prove it, so it is not called optimal."""
    problem = _problem(_layers(saved=200, output=20, n=2), 2, 150, Pipeline(2, "1f1b", recompute=True))
    plan = solvers.solve(problem, "ip")
    assert plan.objective == 4.0 and plan.meta["pipeline_memory"] == "relaxed"
    assert [s.recompute for s in plan.stages if "f0" in s.nodes] == [True]
    assert plan.status == "feasible" and plan.lower_bound <= 3.0


@pytest.mark.parametrize("method", ["slicegraph", "brkga"])
def test_slicegraph_slices_at_pipeline_positions(method):
    """The hand-worked cases, solved by SliceGraph's own DP over the order: 1F1B's positions (3 on
    three devices of 100 bytes) and the first device recomputing (4)."""
    layers3 = _problem(_layers(saved=120, output=40, n=3), 3, 100, Pipeline(4, "1f1b", recompute=False))
    assert solvers.solve(layers3, method).objective == 3.0
    layers2 = _problem(_layers(saved=200, output=20, n=2), 2, 150, Pipeline(2, "1f1b", recompute=True))
    plan = solvers.solve(layers2, method)
    assert plan.objective == 4.0
    assert [s.recompute for s in plan.stages if "f0" in s.nodes] == [True]
    with pytest.raises(InfeasibleError, match="method 'dp'"):
        solvers.solve(_problem(_layers(saved=120, output=40, n=3), 3, 100, Pipeline(4, "gpipe", recompute=False)),
                      method)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelined_problems())
def test_slicegraph_over_every_order_is_the_brute_force_optimum(problem):
    """A split is contiguous iff it segments some topological order of the contracted graph
    (Archer Sec. 4), so SliceGraph over all of them, each sliced at its pieces' pipeline
    positions with recomputation, finds the best split that fits (one contraction: the DP's)."""
    cons = contractions(problem.graph)
    assume(len(cons) == 1)
    best = brute_force_pipelined(problem)
    search = Search(problem, None)
    con = next(iter(cons.values()))
    dag = nx.DiGraph(list(con.edges))
    dag.add_nodes_from(range(len(con.nodes)))
    for order in nx.all_topological_sorts(dag):
        search.evaluate(np.array(order))
    if math.isinf(best):
        with pytest.raises(InfeasibleError):
            search.plan("slicegraph", False, {})
        return
    plan = search.plan("slicegraph", False, {})
    assert plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("method", ["dp", "slicegraph"])
def test_an_orphaned_backward_group_takes_no_pipeline_position(method):
    """f0 -> f1, b1 -> bo -> b0 with bo orphaned (no forward sibling; its forward image lies
    between layers 0 and 1, Tarnawski App. E.1), 1F1B with m = 4, three devices of 70 bytes and a
    fourth left unused. Layer 0 alone holds min(4, 2) = 2 micro-batches of 30 bytes (60): the
    cost model ranks only devices running a forward stage, so neither bo's device nor the unused
    one counts. bo alone takes 10, so the optimum is 10; counting bo's device as a position would
    make layer 0 hold 3 (90 > 70) and push bo onto a layer's device (12)."""
    g = OpGraph()
    for name, t, saved, group, back in [("f0", 1.0, 120, "c0", False), ("f1", 1.0, 120, "c1", False),
                                        ("b0", 1.0, 0, "c0", True), ("b1", 1.0, 0, "c1", True),
                                        ("bo", 10.0, 0, None, True)]:
        g.add_node(name, NodeRecord(name, saved_bytes=saved, times={"accel": t}, colocation=group, backward=back,
                                    transfer_time=0.0))
    for u, v in [("f0", "f1"), ("f0", "b0"), ("f1", "b1"), ("b1", "bo"), ("bo", "b0")]:
        g.add_edge(u, v)
    problem = _problem(g, 4, 70, Pipeline(4, "1f1b", recompute=False))
    plan = solvers.solve(problem, method)
    assert plan.objective == 10.0 == brute_force_pipelined(problem)
    assert costmodel.in_flight(problem, plan.stages)[plan.assignment["f0"]] == 2


@st.composite
def _tied_pipelined(draw):
    """A pipelined problem with one tensor of 1-16 bytes read by two of its nodes (a tied weight):
    every device that runs a reader holds a copy (:func:`costmodel.memory`)."""
    problem = draw(pipelined_problems())
    nodes = list(problem.graph)
    owner, reader = draw(st.sampled_from(nodes)), draw(st.sampled_from(nodes))
    assume(owner != reader)
    nbytes = draw(st.integers(1, 16))
    g = OpGraph(meta={"state": {"w": {"bytes": nbytes, "names": ["w"], "owner": owner, "readers": [owner, reader]}}})
    for v, r in problem.graph.records():
        g.add_node(v, dataclasses.replace(r, param_bytes=r.param_bytes + (nbytes if v == owner else 0)))
    for u, v in problem.graph.edges:
        g.add_edge(u, v)
    return dataclasses.replace(problem, graph=g)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_tied_pipelined())
def test_a_tied_weight_under_a_pipeline_is_placed_optimally(problem):
    """Shared tensors (solvers/shared.py) and a pipeline together: the copy's bytes count on each
    device holding a reader, never per micro-batch; keeping the readers together or copying the
    tensor are both exact, so the plan is the brute-force optimum (costed with the copies)."""
    best = brute_force_pipelined(problem)
    if math.isinf(best):
        with pytest.raises(InfeasibleError):
            solvers.solve(problem, "dp")
        return
    plan = solvers.solve(problem, "dp")
    assert plan.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.lower_bound <= best + 1e-9


def test_a_tied_copy_that_forces_recomputation_does_not_stop_the_search():
    """f0 (4 s, saves 100 bytes) -> f1 (1 s, owns a 40-byte tensor f0 also reads), 1F1B, m = 2,
    two devices of 100 bytes. Without the copy (the shared-tensor relaxation) the layers go one per
    device (load 4; f0's device holds 2 x 50 = 100). With it f0's device needs 140, and fits only
    recomputing (40 + 0 inputs + 50 = 90), at load 4 + 4 = 8; both layers on one device hold one
    micro-batch (40 + 50 = 90) at load 5, the optimum, which the colocated variant finds."""
    g = OpGraph(meta={"state": {"w": {"bytes": 40, "names": ["w"], "owner": "f1", "readers": ["f0", "f1"]}}})
    for name, t, saved, params, group, back in [("f0", 4.0, 100, 0, "c0", False), ("f1", 1.0, 0, 40, "c1", False),
                                                ("b0", 0.0, 0, 0, "c0", True), ("b1", 0.0, 0, 0, "c1", True)]:
        g.add_node(name, NodeRecord(name, param_bytes=params, saved_bytes=saved, times={"accel": t}, colocation=group,
                                    backward=back, transfer_time=0.0))
    for u, v in [("f0", "f1"), ("f0", "b0"), ("f1", "b1"), ("b1", "b0")]:
        g.add_edge(u, v)
    problem = _problem(g, 2, 100, Pipeline(2, "1f1b", recompute=True))
    plan = solvers.solve(problem, "dp")
    assert plan.objective == 5.0 == brute_force_pipelined(problem)
    assert len({s.device for s in plan.stages}) == 1
