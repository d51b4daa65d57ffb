"""The cut bound (:mod:`torchplace.solvers.cut_bound`): each group's least load is a minimum cut,
and the bound never exceeds the best plan, contiguous or not, inference, training or pipelined."""
from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import solve
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.cut_bound import _Groups, _least_load, _packed_load, cut_lower_bound
from torchplace.workloads.dnn_partitioning import read_dnn_partitioning

from .conftest import DNN
from .graphs import brute_force_pipelined, pipelined_problems, problems, training_problems
from .test_milp_maxload import brute_force

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(problems(max_nodes=6))
def test_each_groups_least_load_is_the_minimum_cut(problem):
    """need_k(U) = min over node sets X containing U of the load of X on a device of kind k,
    every X tried."""
    groups = _Groups(problem)
    members = [[v for v in problem.graph if groups.of[v] == u] for u in range(groups.n)]
    for device in {d.kind: d for d in problem.cluster.devices if d.pays_transfer}.values():
        for u in range(groups.n):
            others = [w for w in range(groups.n) if w != u]
            least = min(
                costmodel.device_cost(problem, {v for w in (u, *extra) for v in members[w]}, device).load
                for r in range(len(others) + 1) for extra in itertools.combinations(others, r)
            )
            assert groups.need(u, device.kind, groups.alone(u, device.kind)) == pytest.approx(least, rel=1e-9, abs=1e-9)
            assert groups.one_hop(u, device.kind) <= least + 1e-9 <= groups.alone(u, device.kind) + 2e-9


@SETTINGS
@given(problems(max_nodes=6))
def test_the_bound_holds_below_every_plan(problem):
    best = brute_force(problem, contiguous=False)
    if not math.isinf(best):
        assert cut_lower_bound(problem, time_limit=None) <= best + 1e-9


@SETTINGS
@given(training_problems(max_forward=3, max_backward=3))
def test_the_bound_holds_on_training_graphs(problem):
    best = brute_force(problem, contiguous=False)
    if not math.isinf(best):
        assert cut_lower_bound(problem, time_limit=None) <= best + 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelined_problems())
def test_the_bound_holds_under_a_pipeline(problem):
    best = brute_force_pipelined(problem)
    if not math.isinf(best):
        assert cut_lower_bound(problem, time_limit=None) <= best + 1e-9


def _chain(times: list[float], transfer: float, accelerators: int, cpu_time: float | None = None) -> Problem:
    g = OpGraph()
    for i, t in enumerate(times):
        rec = {"accel": t} if cpu_time is None else {"accel": t, "cpu": cpu_time}
        g.add_node(str(i), NodeRecord(str(i), times=rec, transfer_time=transfer))
        if i:
            g.add_edge(str(i - 1), str(i))
    devices = [Device(f"acc{i}", "meta", "accel") for i in range(accelerators)]
    if cpu_time is not None:
        devices.append(Device("cpu", "cpu", "cpu"))
    return Problem(g, Cluster(tuple(devices)))


def test_a_chain_too_costly_to_cut_is_proven_to_stay_on_one_device():
    # 4 x 1 s, each tensor 10 s to move per side: any cut costs a device at least 10 s more than it
    # saves, so one device (4 s) is optimal; the simple bound sees only 4 s / 4 devices
    problem = _chain([1.0] * 4, transfer=10.0, accelerators=4)
    assert simple_lower_bound(problem) == 1.0
    assert cut_lower_bound(problem) == pytest.approx(4.0)
    plan = solve(problem, "auto", time_limit=30)
    assert plan.objective == pytest.approx(4.0) and plan.status == "optimal"
    assert plan.lower_bound == pytest.approx(4.0)


def test_the_exact_cut_sees_past_the_nearest_neighbours():
    # 5 nodes of 1 s in a chain, tensors of 3 s: one hop from the middle node, keeping each
    # neighbour (1 s) beats paying its tensor (3 s): 1 + 1 + 1 = 3. But the chain then leaves the
    # three nodes through two more 3 s tensors, unless the ends come too: the least set is the
    # whole chain, 5 s
    problem = _chain([1.0] * 5, transfer=3.0, accelerators=5)
    groups = _Groups(problem)
    middle = groups.of["2"]
    assert groups.one_hop(middle, "accel") == pytest.approx(3.0)
    assert groups.need(middle, "accel", groups.alone(middle, "accel")) == pytest.approx(5.0)
    assert cut_lower_bound(problem, time_limit=0) == 0.0  # no time to read the graph: no bound
    assert cut_lower_bound(problem, time_limit=None) == pytest.approx(5.0)


def test_groups_too_costly_for_accelerators_are_charged_to_the_cpus():
    # with a CPU that takes each node in 1.5 s and pays no transfers, the chain may go there;
    # a max-load L < 4 would force every node (each needs 4 s on an accelerator) onto the one CPU:
    # 6 s > L. The least L: 4 (all on an accelerator).
    problem = _chain([1.0] * 4, transfer=10.0, accelerators=2, cpu_time=1.5)
    assert cut_lower_bound(problem) == pytest.approx(4.0)
    # two CPUs: 2 nodes each at 3 s < 4
    two = Problem(problem.graph, Cluster((*problem.cluster.devices, Device("cpu1", "cpu", "cpu"))))
    assert cut_lower_bound(two) == pytest.approx(3.0)


def test_least_load_forces_groups_in_order_of_their_need():
    assert _least_load([5.0, 4.0, 1.0], [2.0, 2.0, 1.0], 1) == pytest.approx(4.0)  # force 5: max(4, 2, 2)
    assert _least_load([5.0, 4.0, 1.0], [2.0, 2.0, 1.0], 0) == pytest.approx(5.0)  # nowhere to force
    assert _least_load([5.0, 4.0, 1.0], [9.0, 2.0, 1.0], 1) == pytest.approx(5.0)  # too slow to force
    assert _least_load([5.0, 4.0], [2.0, 2.0], 2) == pytest.approx(2.0)
    assert _least_load([], [], 1) == 0.0


def _bag(times: list[float], accelerators: int, cpu_times: list[float] | None = None) -> Problem:
    """Independent nodes (no tensors): only how they pack onto devices matters."""
    g = OpGraph()
    for i, t in enumerate(times):
        rec = {"accel": t} if cpu_times is None else {"accel": t, "cpu": cpu_times[i]}
        g.add_node(str(i), NodeRecord(str(i), times=rec))
    devices = [Device(f"acc{i}", "meta", "accel") for i in range(accelerators)]
    if cpu_times is not None:
        devices.append(Device("cpu", "cpu", "cpu"))
    return Problem(g, Cluster(tuple(devices)))


def test_more_groups_than_devices_put_two_on_one():
    # 3 nodes of 2 s on 2 accelerators: the work is 3 s per device, but one holds two nodes: 4 s
    problem = _bag([2.0, 2.0, 2.0], accelerators=2)
    assert simple_lower_bound(problem) == pytest.approx(3.0)
    assert cut_lower_bound(problem) == pytest.approx(4.0, rel=1e-11)
    assert cut_lower_bound(problem) <= 4.0  # from below: a proof
    # 7 nodes of 1 s on 3 devices: one holds three
    assert cut_lower_bound(_bag([1.0] * 7, accelerators=3)) == pytest.approx(3.0, rel=1e-11)
    # a CPU that is as fast takes the odd one out; one 10x slower cannot
    assert cut_lower_bound(_bag([2.0] * 3, 2, cpu_times=[2.0] * 3)) == pytest.approx(2.0, rel=1e-11)
    assert cut_lower_bound(_bag([2.0] * 3, 2, cpu_times=[20.0] * 3)) == pytest.approx(4.0, rel=1e-11)


@SETTINGS
@given(st.lists(st.integers(1, 9), min_size=1, max_size=7), st.integers(1, 3),
       st.one_of(st.none(), st.integers(1, 30)))
def test_the_packed_bound_holds_below_every_packing(times, accelerators, cpu_scale):
    cpu_times = None if cpu_scale is None else [t * cpu_scale / 10 for t in times]
    problem = _bag([float(t) for t in times], accelerators, cpu_times)
    assert cut_lower_bound(problem, time_limit=None) <= brute_force(problem, contiguous=False) + 1e-9


def test_packed_load_returns_its_floor_when_the_conditions_hold_there():
    assert _packed_load([1.0, 1.0], [1.0, 1.0], [math.inf, math.inf], 2, 0, 1.0) == 1.0
    assert _packed_load([1.0], [1.0], [1.0], 0, 1, 1.0) == 1.0  # no device pays transfers


@pytest.mark.parametrize("accelerators", [4, 8, 16])
def test_transformer_layers_on_fewer_devices_are_bounded_by_the_layers_one_must_hold(accelerators):
    # BERT-24's layer graph: 24 layers of about 3.55 s; with 16 devices one holds two (7.1 s)
    # where the work per device is 5.8 s: the bound comes within 2% of the DP's contiguous plan (without counting layers: 0.81)
    problem = read_dnn_partitioning(DNN / "LayerGraphs" / "bert24_inference.json", accelerators=accelerators)
    plan = solve(problem, "dp")
    bound = cut_lower_bound(problem)
    assert bound <= plan.objective
    assert bound >= 0.98 * plan.objective
