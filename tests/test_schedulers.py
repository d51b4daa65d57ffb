"""Baechi's list schedulers (m-TOPO, m-ETF, m-SCT) and the dynamic memory simulator."""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers import solve
from torchplace.solvers.baechi import m_etf, m_sct, m_topo, simulate_memory
from torchplace.solvers.baechi.memsim import _sweep

SCHEDULERS = {"m-topo": m_topo, "m-etf": m_etf, "m-sct": m_sct}
KINDS = ("accel", "gpu", "cpu")


@st.composite
def latency_problems(draw, max_nodes: int = 8) -> Problem:
    """A random latency DAG on 2-4 devices of up to three kinds.

    Times per device kind (every node runs on ``cpu``; other kinds may be missing), transfers as
    per-pair ``link_times``, per-side ``transfer_time`` or output bytes over the cluster's link,
    static and output memory, capped accelerators, and colocation groups. ``cpu0`` has unlimited
    memory, so every instance has a placement the schedulers can always find.
    """
    n_dev = draw(st.integers(2, 4))
    devices = [Device("cpu0", "cpu", "cpu", None)]
    for i in range(1, n_dev):
        kind = draw(st.sampled_from(KINDS))
        cap = draw(st.one_of(st.none(), st.integers(2, 14)))
        devices.append(Device(f"{kind}{i}", "meta", kind, cap))
    names = [d.name for d in devices]
    n = draw(st.integers(1, max_nodes))
    n_groups = draw(st.integers(0, 2))
    g = OpGraph()
    for i in range(n):
        times = {"cpu": float(draw(st.integers(1, 20)))}
        for kind in ("accel", "gpu"):
            if draw(st.integers(0, 4)):
                times[kind] = float(draw(st.integers(0, 10)))
        transfer = draw(st.sampled_from(["pairs", "side", "bytes"]))
        links = {}
        if transfer == "pairs":
            links = {f"{a}->{b}": float(draw(st.integers(0, 6))) for a, b in itertools.permutations(names, 2)
                     if draw(st.booleans())}
        color = draw(st.integers(0, n_groups)) if n_groups else 0
        g.add_node(str(i), NodeRecord(
            str(i), param_bytes=draw(st.integers(0, 4)), temp_bytes=draw(st.integers(0, 3)),
            output_bytes=draw(st.integers(0, 5)), times=times, link_times=links,
            transfer_time=float(draw(st.integers(0, 4))) if transfer == "side" else None,
            colocation=f"k{color}" if color else None,
        ))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(str(u), str(v))
    return Problem(g, Cluster(tuple(devices), bandwidth=2.0, latency=0.5), objective="latency")


def _check_plan(problem: Problem, plan: Plan) -> None:
    """The certificates every scheduler's plan must carry."""
    flat = dataclasses.replace(problem, contiguous=False)
    plan.validate(flat)
    assert plan.objective == costmodel.evaluate(flat, plan)
    assert plan.status == "feasible"
    assert 0.0 <= plan.lower_bound <= plan.objective
    assign = plan.assignment
    for name, nodes in _by_device(assign).items():
        cap = problem.cluster.device(name).memory_bytes
        assert cap is None or costmodel.memory(problem, nodes) <= cap
    groups = defaultdict(set)
    for v, r in problem.graph.records():
        if r.colocation is not None:
            groups[r.colocation].add(assign[v])
    assert all(len(devs) == 1 for devs in groups.values())
    _check_memory_certificate(problem, plan)
    devices = problem.cluster.devices
    if all(problem.link_time(u, a, b) == 0 for u in problem.graph for a in devices for b in devices):
        assert plan.objective == plan.meta["scheduler_makespan"]  # no transfers: the same schedule


def _by_device(assign: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for v, d in assign.items():
        out[d].append(v)
    return out


def _check_memory_certificate(problem: Problem, plan: Plan) -> None:
    """Dynamic peak <= static + own outputs + received outputs (memsim module docstring)."""
    g, assign = problem.graph, plan.assignment
    peak = plan.meta["peak_memory"]
    for name, nodes in _by_device(assign).items():
        received = {u for v in nodes for u in g.predecessors(v) if assign[u] != name}
        bound = (costmodel.memory(problem, nodes) + sum(g.record(v).output_bytes for v in nodes)
                 + sum(g.record(u).output_bytes for u in received))
        assert peak.get(name, 0) <= bound


@settings(max_examples=60, deadline=None)
@given(latency_problems(), st.booleans())
def test_schedulers_give_valid_plans(problem, sequential):
    for name, scheduler in SCHEDULERS.items():
        plan = scheduler(problem, sequential_comm=sequential)
        assert plan.solver == name
        _check_plan(problem, plan)
        assert plan.meta["scheduler_makespan"] >= 0
        again = scheduler(problem, sequential_comm=sequential)
        assert again.stages == plan.stages  # deterministic


# -- exact small cases ---------------------------------------------------------------------------
def _chain(n: int = 5, mem: int | None = None) -> Problem:
    g = OpGraph()
    for i in range(n):
        g.add_node(f"n{i}", NodeRecord(f"n{i}", param_bytes=10, output_bytes=1, transfer_time=1.0,
                                       times={"cpu": 9.0, "gpu": 5.0, "accel": 2.0 + i}))
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}")
    devices = (Device("cpu0", "cpu", "cpu", mem), Device("gpu0", "meta", "gpu", mem), Device("acc0", "meta", "accel", mem))
    return Problem(g, Cluster(devices), objective="latency")


@pytest.mark.parametrize("scheduler", [m_etf, m_sct, lambda p: m_topo(p, share="capacity")])
def test_chain_goes_to_the_fastest_device(scheduler):
    problem = _chain()
    plan = scheduler(problem)
    assert set(plan.assignment.values()) == {"acc0"}
    assert plan.objective == plan.meta["scheduler_makespan"] == 2 + 3 + 4 + 5 + 6
    assert plan.lower_bound == 2 + 3 + 4 + 5 + 5  # critical path at each node's least time (n4: gpu)


def test_m_topo_fills_fastest_first_up_to_the_share():
    plan = m_topo(_chain())  # share = 50 / 3 + 10 bytes: two nodes per device
    assert plan.meta["device_order"] == ["acc0", "gpu0", "cpu0"]
    assert plan.assignment == {"n0": "acc0", "n1": "acc0", "n2": "gpu0", "n3": "gpu0", "n4": "cpu0"}
    # acc0 2 + 3, link 2 (both sides pay), gpu 5 + 5, link 1 (the CPU side pays nothing), cpu 9
    assert plan.objective == plan.meta["scheduler_makespan"] == 5 + 2 + 10 + 1 + 9


def _branches() -> Problem:
    g = OpGraph()
    for b in "ab":
        for i in (1, 2):
            g.add_node(f"{b}{i}", NodeRecord(f"{b}{i}", times={"accel": 3.0}, transfer_time=0.5))
        g.add_edge(f"{b}1", f"{b}2")
    devices = (Device("acc0", "meta", "accel"), Device("acc1", "meta", "accel"))
    return Problem(g, Cluster(devices), objective="latency")


@pytest.mark.parametrize("scheduler", [m_etf, m_sct])
def test_independent_branches_use_two_devices(scheduler):
    problem = _branches()
    plan = scheduler(problem)
    assert plan.assignment == {"a1": "acc0", "a2": "acc0", "b1": "acc1", "b2": "acc1"}
    assert plan.objective == plan.meta["scheduler_makespan"] == 6.0
    one = [Stage("acc0", ("a1", "a2", "b1", "b2"))]
    assert costmodel.evaluate_stages(problem, one)[0] == 12.0


def test_m_sct_solves_its_lp():
    plan = m_sct(_branches())
    # each chain keeps its favourite child: makespan 3 + 3, no communication
    assert plan.meta["lp_status"] == "optimal"
    assert plan.meta["lp_objective"] == pytest.approx(6.0)
    assert plan.meta["favourite_children"] == 2
    assert plan.meta["lp_cols"] == 4 + 1 + 2  # t, w, x
    assert plan.meta["lp_rows"] == 4 + 2 + 2 + 2  # ends, precedence, one child, one parent


def test_m_sct_lp_is_a_relaxation_of_favourite_children():
    # i -> j, i -> k, unit times, accelerator-to-accelerator link 1: the LP splits x = 1/2, 1/2
    g = OpGraph()
    for v in "ijk":
        g.add_node(v, NodeRecord(v, times={"accel": 1.0}, transfer_time=0.5))
    g.add_edge("i", "j")
    g.add_edge("i", "k")
    problem = Problem(g, Cluster((Device("a0", "meta", "accel"), Device("a1", "meta", "accel"))), objective="latency")
    plan = m_sct(problem)
    assert plan.meta["lp_objective"] == pytest.approx(2.5)
    assert plan.meta["favourite_children"] == 0  # neither x is below 1/2
    _check_plan(problem, plan)


def test_device_rule_finish_avoids_a_slow_idle_device():
    g = OpGraph()
    for v in "xy":
        g.add_node(v, NodeRecord(v, times={"accel": 1.0, "cpu": 100.0}))
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel"), Device("cpu0", "cpu", "cpu"))), objective="latency")
    assert m_etf(problem).objective == 2.0
    assert m_etf(problem, device_rule="start").objective == 100.0  # Baechi's rule: earliest start


def test_sequential_comm_queues_transfers_into_one_device():
    # x1 (k1 only) and x2 (k2 only) both feed y (k3 only): two transfers of 2 s into one port
    g = OpGraph()
    for v, kind in (("x1", "k1"), ("x2", "k2"), ("y", "k3")):
        g.add_node(v, NodeRecord(v, times={kind: 1.0}, transfer_time=1.0))
    g.add_edge("x1", "y")
    g.add_edge("x2", "y")
    devices = tuple(Device(f"d{k}", "meta", f"k{k}") for k in (1, 2, 3))
    problem = Problem(g, Cluster(devices), objective="latency")
    parallel, queued = m_etf(problem), m_etf(problem, sequential_comm=True)
    assert parallel.meta["scheduler_makespan"] == 1 + 2 + 1
    assert queued.meta["scheduler_makespan"] == 1 + 2 + 2 + 1
    assert parallel.objective == queued.objective == 6.0  # the simulation always serializes ports


def test_colocation_group_placed_with_its_first_member():
    g = OpGraph()
    for v in "abc":
        g.add_node(v, NodeRecord(v, param_bytes=3, times={"accel": 1.0}, colocation="w" if v != "b" else None))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    devices = (Device("acc0", "meta", "accel", 4), Device("acc1", "meta", "accel", 6))
    problem = Problem(g, Cluster(devices), objective="latency")
    for scheduler in SCHEDULERS.values():
        plan = scheduler(problem)  # the group {a, c} needs 6 bytes: only acc1 holds it, then b fits only acc0
        assert plan.assignment == {"a": "acc1", "b": "acc0", "c": "acc1"}
        _check_plan(problem, plan)


# -- errors ----------------------------------------------------------------------------------------
def test_too_little_memory_raises():
    g = OpGraph()
    g.add_node("small", NodeRecord("small", param_bytes=2, times={"accel": 1.0}))
    g.add_node("big", NodeRecord("big", param_bytes=10, temp_bytes=2, times={"accel": 1.0}))
    g.add_edge("small", "big")
    devices = (Device("acc0", "meta", "accel", 8), Device("acc1", "meta", "accel", 8))
    problem = Problem(g, Cluster(devices), objective="latency")
    for scheduler in SCHEDULERS.values():
        with pytest.raises(InfeasibleError, match=r"node 'big' needs 12 bytes .* acc0 [68], acc1 [68] bytes free"):
            scheduler(problem)


def test_a_greedy_miss_points_to_the_exact_method():
    # a fits the accelerator first, then b (which only it runs) finds it full; a on the host fits
    g = OpGraph()
    g.add_node("a", NodeRecord("a", param_bytes=2, times={"fast": 1.0, "cpu": 10.0}))
    g.add_node("b", NodeRecord("b", param_bytes=1, times={"fast": 1.0}))
    g.add_edge("a", "b")
    devices = (Device("acc", "meta", "fast", 2), Device("host", "meta", "cpu"))
    problem = Problem(g, Cluster(devices), objective="latency", contiguous=False)
    for scheduler in SCHEDULERS.values():  # the message said only "raise their memory or add devices"
        with pytest.raises(InfeasibleError, match=r"after the nodes placed before it.*method 'moirai'"):
            scheduler(problem)
    assert solve(problem, method="moirai").assignment == {"a": "host", "b": "acc"}


def test_throughput_problem_is_rejected():
    problem = dataclasses.replace(_branches(), objective="throughput")
    for scheduler in SCHEDULERS.values():
        with pytest.raises(ValueError, match="objective='latency'"):
            scheduler(problem)


# -- dynamic memory ------------------------------------------------------------------------------
def test_dynamic_memory_by_hand():
    # a (acc0) -> b (acc0), a -> c (acc1), b -> d (acc1), c -> d
    spec = {  # time, param, temp, output
        "a": (2.0, 10, 4, 3), "b": (1.0, 0, 2, 5), "c": (3.0, 7, 1, 6), "d": (1.0, 0, 8, 2),
    }
    links = {"a": {"acc0->acc1": 1.0}, "b": {"acc0->acc1": 2.0}}
    g = OpGraph()
    for v, (t, p, tmp, out) in spec.items():
        g.add_node(v, NodeRecord(v, param_bytes=p, temp_bytes=tmp, output_bytes=out, times={"accel": t},
                                 link_times=links.get(v, {})))
    for u, v in ("ab", "ac", "bd", "cd"):
        g.add_edge(u, v)
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel"), Device("acc1", "meta", "accel"))),
                      objective="latency", contiguous=False)
    plan = Plan.build(problem, [Stage("acc0", ("a", "b")), Stage("acc1", ("c", "d"))],
                      solver="hand", seconds=0.0, lower_bound=0.0)
    # a [0,2) b [2,3) on acc0; a->acc1 [2,3), b->acc1 [3,5); c [3,6), d [6,7) on acc1
    assert plan.objective == 7.0
    trace = simulate_memory(problem, plan)
    # acc0: [0,2) 10 + 4 + 3 = 17; [2,3) 10 + 2 + out a 3 + out b 5 = 20; [3,5) 10 + out b 5; then 10
    assert trace.timeline["acc0"] == [(0.0, 17), (2.0, 20), (3.0, 15), (5.0, 10)]
    # acc1: 7; [2,3) +a 3; [3,6) +b 5 +temp c 1 +out c 6 = 22; at 6: -a -temp c +temp d 8 +out d 2 = 28; 7: 9
    assert trace.timeline["acc1"] == [(0.0, 7), (2.0, 10), (3.0, 22), (6.0, 28), (7.0, 9)]
    assert trace.peak == {"acc0": 20, "acc1": 28}
    # the static model (16 on each) does not bound the dynamic peak
    assert costmodel.memory(problem, "ab") == costmodel.memory(problem, "cd") == 16


def test_sweep_counts_zero_length_buffers_at_their_instant():
    assert _sweep([(0.0, 2.0, 3), (1.0, 1.0, 5), (2.0, 4.0, 1)]) == (8, [(0.0, 3), (1.0, 8), (1.0, 3), (2.0, 1), (4.0, 0)])


# -- scale -----------------------------------------------------------------------------------------
def layered_problem(n: int = 1000, layers: int = 50, seed: int = 0) -> Problem:
    """A random layered DAG: ``n / layers`` nodes per layer, 1-3 inputs from the layer before; three
    accelerators sharing a third of the total static memory each, and an unlimited CPU."""
    rng = random.Random(seed)
    g, prev = OpGraph(), []
    for layer in range(layers):
        cur = []
        for i in range(n // layers):
            v = f"{layer}_{i}"
            g.add_node(v, NodeRecord(v, param_bytes=rng.randint(0, 100), temp_bytes=rng.randint(0, 50),
                                     output_bytes=rng.randint(1, 100), transfer_time=rng.uniform(0.1, 3.0),
                                     times={"accel": rng.uniform(1, 10), "cpu": rng.uniform(5, 50)}))
            for u in rng.sample(prev, min(len(prev), rng.randint(1, 3))):
                g.add_edge(u, v)
            cur.append(v)
        prev = cur
    total = sum(r.param_bytes + r.temp_bytes for _, r in g.records())
    devices = tuple(Device(f"acc{i}", "meta", "accel", total // 3) for i in range(3))
    return Problem(g, Cluster((*devices, Device("cpu0", "cpu", "cpu"))), objective="latency")


@pytest.mark.slow
def test_schedulers_on_1000_nodes():
    problem = layered_problem()
    for name, scheduler in SCHEDULERS.items():
        t0 = time.perf_counter()
        plan = scheduler(problem)
        seconds = time.perf_counter() - t0
        _check_plan(problem, plan)
        print(f"{name}: {seconds:.2f} s, makespan {plan.objective:.1f} "
              f"(scheduler {plan.meta['scheduler_makespan']:.1f}), {len(plan.stages)} stages")
        assert seconds < 30
