"""Tarnawski's latency IP: brute force of his model, plans, bounds, and where it meets the simulation."""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import defaultdict

import networkx as nx
import pyomo.environ as pyo
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, SolverLimitError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import is_contiguous
from torchplace.problem import Problem
from torchplace.solvers.bounds import latency_lower_bound
from torchplace.solvers.milp import latency
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import diamond, problems, scaled_chain

# -- an independent evaluator of Tarnawski's model (App. A) and a brute force over it ------------


def tarnawski_latency(problem: Problem, place: dict[str, tuple[str, int] | None]) -> float:
    """Latency of one sample when ``place[v]`` is ``None`` (the CPU pool) or (accelerator, slot).

    The least solution of: a CPU node ends ``p_cpu`` after its last input; a slot starts when
    every input from outside it is in DRAM and its accelerator's earlier slots have finished, and
    ends after moving its inputs in, running all its nodes and moving its outputs out; each of its
    nodes ends then. Found by raising all times from 0 until nothing changes; ``inf`` if slots
    keep waiting on each other (a cycle).
    """
    g = problem.graph
    slots: dict[tuple[str, int], set[str]] = defaultdict(set)
    for v, s in place.items():
        if s is not None:
            slots[s].add(v)
    lat = dict.fromkeys(g, 0.0)
    finish = dict.fromkeys(slots, 0.0)
    for _ in range(len(g) + len(slots) + 2):
        before = (dict(lat), dict(finish))
        for v in g.topological_order():
            if place[v] is None:
                lat[v] = g.record(v).times["cpu"] + max((lat[u] for u in g.predecessors(v)), default=0.0)
        for (dev, r), nodes in sorted(slots.items()):
            inputs = {u for v in nodes for u in g.predecessors(v)} - nodes
            outputs = {u for u in nodes if any(w not in nodes for w in g.successors(u))}
            earlier = [finish[s] for s in slots if s[0] == dev and s[1] < r]
            start = max([lat[u] for u in inputs] + earlier, default=0.0)
            kind = problem.cluster.device(dev).kind
            finish[(dev, r)] = start + sum(problem.transfer_time(u) for u in inputs | outputs) + sum(
                g.record(v).times[kind] for v in nodes)
            for v in nodes:
                lat[v] = finish[(dev, r)]
        if (lat, finish) == before:
            return max(lat.values(), default=0.0)
    return math.inf


def _admissible(problem: Problem, place: dict[str, tuple[str, int] | None]) -> bool:
    g, cluster = problem.graph, problem.cluster
    device = {v: None if s is None else s[0] for v, s in place.items()}
    for v, r in g.records():
        kind = "cpu" if device[v] is None else cluster.device(device[v]).kind
        if kind not in r.times:
            return False
    groups: dict[str, set] = defaultdict(set)
    for v, r in g.records():
        if r.colocation is not None:
            groups[r.colocation].add(device[v])
    if any(len(d) > 1 for d in groups.values()):
        return False
    for d in cluster.devices:
        on = [v for v in g if device[v] == d.name]
        if d.memory_bytes is not None and d.pays_transfer and costmodel.memory(problem, on) > d.memory_bytes:
            return False
    slot_sets: dict[tuple[str, int], set[str]] = defaultdict(set)
    for v, s in place.items():
        if s is not None:
            slot_sets[s].add(v)
    return all(is_contiguous(g, nodes) for nodes in slot_sets.values())


def brute_force(problem: Problem, q: int) -> float:
    """Least Tarnawski latency over every placement onto the CPU pool or ``q`` slots per accelerator."""
    nodes = list(problem.graph)
    options: list[tuple[str, int] | None] = [None] if any(not d.pays_transfer for d in problem.cluster.devices) else []
    options += [(d.name, r) for d in problem.cluster.devices if d.pays_transfer for r in range(q)]
    best = math.inf
    for choice in itertools.product(options, repeat=len(nodes)):
        place = dict(zip(nodes, choice))
        if _admissible(problem, place):
            best = min(best, tarnawski_latency(problem, place))
    return best


# -- problems --------------------------------------------------------------------------------


@st.composite
def latency_problems(draw, max_nodes: int) -> Problem:
    """tests.graphs.problems as latency problems; sometimes with CPUs 4x slower (so accelerators and
    their transfers matter), sometimes with the second accelerator a slower "gpu"."""
    p = draw(problems(max_nodes=max_nodes).filter(lambda p: len(p.graph) >= 3))
    devices = list(p.cluster.devices)
    if draw(st.booleans()):
        for v, r in list(p.graph.records()):
            p.graph.replace_record(v, dataclasses.replace(r, times={**r.times, "cpu": 4 * r.times["cpu"]}))
    if len([d for d in devices if d.pays_transfer]) == 2 and draw(st.booleans()):
        for v, r in list(p.graph.records()):
            if "accel" in r.times:
                p.graph.replace_record(v, dataclasses.replace(r, times={**r.times, "gpu": 2 * r.times["accel"] + 1}))
        devices[1] = dataclasses.replace(devices[1], kind="gpu", memory_bytes=devices[1].memory_bytes + 1)
    return Problem(p.graph, Cluster(tuple(devices)), objective="latency", contiguous=False)


def _check_plan(problem: Problem, plan) -> None:
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound == latency_lower_bound(problem) <= plan.objective + 1e-9
    assert plan.meta["ip_status"] == "optimal"
    assert plan.status == ("optimal" if plan.objective <= plan.lower_bound * (1 + 1e-9) else "feasible")


@settings(max_examples=40, deadline=None)
@given(latency_problems(max_nodes=6))
def test_ip_equals_brute_force_of_tarnawskis_model(problem):
    expected = brute_force(problem, q=1)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            latency.solve(problem)
        return
    plan = latency.solve(problem)
    assert plan.meta["ip_latency"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    _check_plan(problem, plan)


@settings(max_examples=20, deadline=None)
@given(latency_problems(max_nodes=4))
def test_ip_with_two_slots_equals_brute_force_and_never_loses_to_one(problem):
    expected = brute_force(problem, q=2)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            latency.solve(problem, q=2)
        return
    plan = latency.solve(problem, q=2)
    assert plan.meta["ip_latency"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert expected <= brute_force(problem, q=1) + 1e-9
    _check_plan(problem, plan)


def _diamond(q_problem: bool = True) -> Problem:
    """a -> (b, c) -> d on two accelerators, no CPU: b and c take 10 s, a and d 1 s, transfers 1 s."""
    return diamond(10.0, 1.0, objective="latency", contiguous=not q_problem)


def test_diamond_needs_two_subgraphs_per_accelerator_to_run_branches_in_parallel():
    # q = 1: {a, c, d} is not contiguous, so the best is all on one device, 1 + 10 + 10 + 1.
    one = latency.solve(_diamond(q_problem=False))
    assert one.meta["ip_latency"] == pytest.approx(22.0)
    assert [s.nodes for s in one.stages] == [("a", "b", "c", "d")]
    # q = 2: {a} ends at 2 (1 + out 1); b and c on two devices end at 2 + 1 + 10 + 1 = 14;
    # d after the branch in its own slot: 14 + in 2 + 1 = 17.
    two = latency.solve(_diamond(), q=2)
    assert two.meta["ip_latency"] == pytest.approx(17.0)
    # Optimal plans differ only in which accelerator takes a and d (HiGHS returns either, by
    # machine): the branches always run on two devices.
    device = {v: s.device for s in two.stages for v in s.nodes}
    assert device["b"] != device["c"]
    # The simulation moves a's output at once (2 s acc -> acc) while the other branch runs on a's
    # device: a 0..1, its branch 1..11, the far branch 3..13, the near branch's output reaches the
    # far device (or d's) by 13, d 13..14.
    assert two.objective == pytest.approx(14.0)
    assert two.lower_bound == latency_lower_bound(_diamond()) == 12.0  # path a, b, d


@pytest.mark.parametrize("scale", [1e-5, 1e9, 1e15])
def test_ip_equals_brute_force_at_microsecond_and_nanosecond_counts(scale):
    # Unscaled, times of 1e9 beside the 0/1 rows led HiGHS to prove 6e9 (all on one accelerator,
    # as "optimal" and as ip_bound) for this chain whose best split takes 5e9 in Tarnawski's model.
    problem = scaled_chain(scale, objective="latency", contiguous=False)
    expected = brute_force(problem, q=1)
    plan = latency.solve(problem)
    assert plan.meta["ip_latency"] == pytest.approx(expected, rel=1e-6)
    assert plan.meta["ip_bound"] <= expected * (1 + 1e-9)
    assert plan.objective == costmodel.evaluate(problem, plan)


# -- the IP against the simulation -----------------------------------------------------------


def width(g: OpGraph) -> int:
    """Largest antichain (Dilworth: nodes minus a maximum matching of the reachability relation)."""
    closure = nx.transitive_closure_dag(g.nx)
    b = nx.Graph()
    b.add_nodes_from(("L", v) for v in g)
    b.add_nodes_from(("R", v) for v in g)
    b.add_edges_from((("L", u), ("R", v)) for u, v in closure.edges)
    matching = nx.bipartite.hopcroft_karp_matching(b, top_nodes=[("L", v) for v in g])
    return len(g) - len(matching) // 2


@settings(max_examples=30, deadline=None)
@given(problems(max_nodes=6), st.booleans(), st.sampled_from([1, 2]))
def test_simulation_is_no_slower_than_the_ip_when_no_port_waits(base, free_moves, q):
    """Enough CPUs for the width, no colocation, per-side transfer times: the IP's times are a
    schedule the simulation may run, so its makespan is at most TotalLatency unless a transfer had
    to wait for a port (which Tarnawski's DRAM hub never does). With free moves no port is used."""
    g = OpGraph()
    for v, r in base.graph.records():
        g.add_node(v, dataclasses.replace(r, colocation=None, transfer_time=0.0 if free_moves else r.transfer_time))
    for u, v in base.graph.edges:
        g.add_edge(u, v)
    accels = tuple(d for d in base.cluster.devices if d.pays_transfer)
    cpus = tuple(Device(f"cpu{i}", "cpu", "cpu", None) for i in range(width(g)))
    problem = Problem(g, Cluster(accels + cpus), objective="latency", contiguous=False)
    try:
        plan = latency.solve(problem, q=q)
    except InfeasibleError:
        return
    sched = costmodel.simulate(problem, plan.stages)
    waited = any(t.start > sched.finish[t.node] + 1e-9 for t in sched.transfers)
    note(f"port wait: {waited}; simulated {plan.objective}, IP {plan.meta['ip_latency']}, kept {plan.meta['kept']}")
    if plan.meta["kept"] == "start":
        # the IP's own plan simulated slower (a tensor the IP sends once to host memory is sent
        # once per destination device by the simulation, on the sender's ports): its start won
        assert plan.objective < plan.meta["ip_simulated"]
        return
    assert plan.objective == plan.meta["ip_simulated"]
    assert not (free_moves and waited)
    if not waited:
        assert plan.objective <= plan.meta["ip_latency"] * (1 + 1e-6) + 1e-6


def test_simulation_can_be_slower_than_the_ip_where_ports_serialize():
    """One accelerator output read by two CPU nodes on two CPUs. Tarnawski: u ends at 1, is in DRAM
    at 3, both readers run 3..4 (latency 4). Simulation: two transfers out of the accelerator, one
    after the other (1..3, 3..5), so the second reader runs 5..6. Not a bug of either model: the
    simulation has ports that serialize, Tarnawski's DRAM serves every reader at once."""
    g = OpGraph()
    g.add_node("u", NodeRecord("u", times={"accel": 1.0}, transfer_time=2.0))
    for w in ("w1", "w2"):
        g.add_node(w, NodeRecord(w, times={"cpu": 1.0}))
        g.add_edge("u", w)
    devs = (Device("acc0", "meta", "accel", None), Device("cpu0", "cpu", "cpu", None), Device("cpu1", "cpu", "cpu", None))
    problem = Problem(g, Cluster(devs), objective="latency", contiguous=False)
    assert width(g) == 2
    plan = latency.solve(problem)
    assert plan.meta["ip_latency"] == pytest.approx(4.0)
    assert [(s.device, s.nodes) for s in plan.stages] == [("acc0", ("u",)), ("cpu0", ("w1",)), ("cpu1", ("w2",))]
    assert plan.objective == pytest.approx(6.0)


# -- bounds, limits, errors ------------------------------------------------------------------


def test_latency_lower_bound_is_the_larger_of_path_and_average_work():
    g = OpGraph()
    for v, times in (("a", {"cpu": 4.0, "accel": 1.0}), ("b", {"cpu": 3.0}), ("c", {"cpu": 8.0, "accel": 2.0})):
        g.add_node(v, NodeRecord(v, times=times))
    g.add_edge("a", "b")
    one_cpu = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"),)), objective="latency")
    both = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("acc0", "meta", "accel"))), objective="latency")
    assert latency_lower_bound(one_cpu) == 15.0  # all work on one device: 4 + 3 + 8
    assert latency_lower_bound(both) == 4.0  # path a (1 on accel) -> b (3); work (1 + 3 + 2) / 2 = 3


def test_time_limit_returns_a_valid_plan(workloads_dir):
    problem = dataclasses.replace(read_dnn_partitioning(DNN / "LayerGraphs/resnet50_inference.json"),
                                  objective="latency", contiguous=False)
    t0 = time.perf_counter()
    latency.build(problem)  # a limit that leaves HiGHS some time, on a busy machine too
    plan = latency.solve(problem, time_limit=3 + 8 * (time.perf_counter() - t0))
    assert plan.status == "time_limit" and plan.meta["ip_status"] == "time_limit"
    _check_limited(problem, plan)
    if plan.meta["ip_latency"] is not None:  # HiGHS had an incumbent (at worst the start)
        assert plan.meta["ip_bound"] <= plan.meta["ip_latency"]


def test_a_limit_before_highs_first_incumbent_returns_the_start(monkeypatch):
    """HiGHS stopped by the limit with no incumbent of its own (a loaded machine): the single-place
    start is feasible, so it is the answer at this limit, not an error."""
    problem = dataclasses.replace(read_dnn_partitioning(DNN / "LayerGraphs/resnet50_inference.json"),
                                  objective="latency", contiguous=False)

    def stopped(*args, **kwargs):
        assert kwargs["warm_start"] is True
        raise SolverLimitError("latency IP: no feasible placement found within the 5 s time limit", 5.0, 180.0)

    monkeypatch.setattr(latency, "solve_model", stopped)
    plan = latency.solve(problem, time_limit=60)
    assert plan.status == "time_limit" and "time limit" in plan.meta["stopped"]
    assert plan.meta["ip_bound"] == 180.0 and plan.meta["ip_latency"] is None
    _check_limited(problem, plan)
    start = latency.single_place_start(problem)
    assert start is not None and len(set(start.values())) == 1  # every node on one place
    assert plan.objective == costmodel.evaluate_stages(problem, latency._start_stages(problem, 1, start))[0]


def test_without_a_place_for_everything_a_stopped_ip_still_raises(monkeypatch):
    p = _diamond()  # 4 bytes of nodes on two accelerators of 3 bytes: no one place holds them
    problem = dataclasses.replace(p, cluster=Cluster(tuple(dataclasses.replace(d, memory_bytes=3)
                                                           for d in p.cluster.devices)))
    assert latency.single_place_start(problem, q=2) is None
    monkeypatch.setattr(latency, "solve_model", lambda *a, **k: (_ for _ in ()).throw(
        SolverLimitError("latency IP: no feasible placement found within the 1 s time limit", 1.0, None)))
    with pytest.raises(SolverLimitError, match="no feasible placement"):
        latency.solve(problem, q=2, time_limit=60)


def _check_limited(problem: Problem, plan) -> None:
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective


def _tarnawski_place(problem: Problem, q: int, place: dict) -> dict:
    accels = [d.name for d in problem.cluster.devices if d.pays_transfer]
    return {v: None if j is None else (accels[j // q], j % q) for v, j in place.items()}


@settings(max_examples=40, deadline=None)
@given(latency_problems(max_nodes=6), st.sampled_from([1, 2]))
def test_the_single_place_start_is_a_feasible_point_of_the_ip(problem, q):
    """The MIP start meets every row, and its TotalLatency is Tarnawski's latency of its placement."""
    try:
        start = latency.single_place_start(problem, q)
    except InfeasibleError:  # a node no device can run: the IP refuses the problem the same way
        with pytest.raises(InfeasibleError):
            latency.solve(problem, q=q)
        return
    if start is None:  # no one place can run and hold every node
        return
    model = latency.build(problem, q=q)
    latency.initialize(model, problem, start)
    bad = [c.name for c in model.component_data_objects(pyo.Constraint, active=True)
           if (c.lower is not None and pyo.value(c.body) < pyo.value(c.lower) - 1e-9)
           or (c.upper is not None and pyo.value(c.body) > pyo.value(c.upper) + 1e-9)]
    assert bad == []
    assert pyo.value(model.total) == pytest.approx(tarnawski_latency(problem, _tarnawski_place(problem, q, start)),
                                                   rel=1e-9, abs=1e-12)
    assert pyo.value(model.total) >= latency.solve(problem, q=q).meta["ip_latency"] - 1e-6


def test_too_little_memory_is_infeasible():
    g = OpGraph()
    for i in range(3):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": 1.0}, param_bytes=5))
        if i:
            g.add_edge(str(i - 1), str(i))
    devs = (Device("acc0", "meta", "accel", 6), Device("acc1", "meta", "accel", 6), Device("cpu0", "cpu", "cpu"))
    with pytest.raises(InfeasibleError, match="15 bytes"):
        latency.solve(Problem(g, Cluster(devs), objective="latency", contiguous=False), q=2)


@pytest.mark.parametrize("caps", [(3, 10), (3, None), (10, 3)])
def test_cpu_nodes_fit_the_largest_capped_cpu_and_are_packed_where_there_is_room(caps):
    # four independent 2-byte CPU nodes (8 bytes): the pool had to fit the smallest CPU (3 bytes),
    # so this raised InfeasibleError; list-scheduled by free time alone they overflowed a CPU
    g = OpGraph()
    for i in range(4):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": 1.0}, param_bytes=2,
                                      colocation="pair" if i < 2 else None))
    g.add_node("x", NodeRecord("x", times={"cpu": 1.0}, param_bytes=1))
    p = Problem(g, Cluster(tuple(Device(f"c{i}", "meta", "cpu", c) for i, c in enumerate(caps))),
                objective="latency", contiguous=False)
    plan = latency.solve(p)
    plan.validate(p)  # memory of each CPU device
    assert plan.objective == costmodel.evaluate(p, plan)
    small = Problem(g, Cluster(tuple(Device(f"c{i}", "meta", "cpu", 4) for i in range(2))),
                    objective="latency", contiguous=False)  # 9 bytes fit only across both: not in this IP
    with pytest.raises(InfeasibleError, match="at most 4 bytes.*method 'moirai'"):
        latency.solve(small)


def test_a_contiguous_problem_with_cpus_is_a_usage_error_through_solve():
    from torchplace.errors import UsageError
    from torchplace.solvers import solve

    p = _diamond(q_problem=False)
    cpu = Cluster(p.cluster.devices + (Device("cpu0", "cpu", "cpu"),))
    with pytest.raises(UsageError, match="contiguous=False"):  # was a plain ValueError
        solve(dataclasses.replace(p, cluster=cpu), method="latency-ip")


def test_wrong_objective_and_contiguity_are_refused_with_a_hint():
    p = _diamond(q_problem=False)
    with pytest.raises(ValueError, match="objective='latency'"):
        latency.solve(dataclasses.replace(p, objective="throughput"))
    with pytest.raises(ValueError, match="contiguous=False"):
        latency.solve(p, q=2)
    cpu = Cluster(p.cluster.devices + (Device("cpu0", "cpu", "cpu"),))
    with pytest.raises(ValueError, match="contiguous=False"):
        latency.solve(dataclasses.replace(p, cluster=cpu))


def test_latency_ip_and_moirai_hold_at_petabyte_memories():
    # HiGHS reads a coefficient of 1e15 or more as infinite: unscaled, the latency IP put 6e15
    # bytes on a CPU of 2e15 (InvalidPlanError) and MOIRAI read back no placement (KeyError).
    # Memory only matters through ratios, so each plan is worth what it is at 1e6 bytes.
    from torchplace.solvers.milp import moirai

    from .test_milp_maxload import _petabyte_chain

    for solve in (latency.solve, moirai.solve):
        small, huge = (solve(_petabyte_chain(scale, "latency")) for scale in (1e6, 1e15))
        assert huge.objective == pytest.approx(small.objective, rel=1e-9)


def test_q1_on_a_training_graph_says_to_raise_q_before_memory():
    # f0 and b0 run only on kind A, f1 and b1 only on B: with q=1 A's one subgraph {f0, b0} is
    # not contiguous (f0 -> f1 -> b1 -> b0), whatever the memory (unlimited here). The message
    # blamed memory ("accelerators hold [None, None] bytes; raise max_memory").
    g = OpGraph()
    for name, kind, color in (("f0", "A", "c0"), ("f1", "B", "c1"), ("b1", "B", "c1"), ("b0", "A", "c0")):
        g.add_node(name, NodeRecord(name, times={kind: 1.0}, transfer_time=0.5, colocation=color,
                                    backward=name.startswith("b")))
    for u, v in (("f0", "f1"), ("f1", "b1"), ("b1", "b0")):
        g.add_edge(u, v)
    p = Problem(g, Cluster((Device("a", "meta", "A"), Device("b", "meta", "B"))), objective="latency",
                mode="training", contiguous=False)
    with pytest.raises(InfeasibleError, match=r"with q=1 an accelerator holds one contiguous subgraph.*raise q to 2") as e:
        latency.solve(p, q=1)
    assert "['unlimited', 'unlimited']" in str(e.value) and "None" not in str(e.value)
    assert latency.solve(p, q=2).objective > 0
