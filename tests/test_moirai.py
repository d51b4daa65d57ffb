"""MOIRAI: the instance reader, the latency MILP on example-1, brute force on tiny random DAGs."""
from __future__ import annotations

import csv
import itertools
import math
import random
import time

import networkx as nx
import pyomo.environ as pyo
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, WorkloadFormatError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage, stages_from_order
from torchplace.problem import Problem
from torchplace.solvers.baechi import m_sct
from torchplace.solvers.milp import moirai
from torchplace.workloads import read_moirai_csv

from .conftest import WORKLOADS

EXAMPLE = WORKLOADS / "moirai" / "example-1__instances.csv"
HAND = WORKLOADS / "moirai" / "example-1__Sheet1.csv"


# -- reader --------------------------------------------------------------------------------------
def test_reader_on_example_1() -> None:
    p = read_moirai_csv(EXAMPLE)
    g = p.graph
    assert (p.objective, p.contiguous) == ("latency", False)
    # 14 tasks (source 0, sink 26) + one zero-time node per out-edge of task 14, whose two edges
    # carry different data (comm 16 to 19, comm 17 to 23)
    assert len(g) == 16 and g.nx.number_of_edges() == 21
    assert {"14>19", "14>23"} <= set(g) and len(g.meta["comm"]) == 13
    assert [d.memory_bytes for d in p.cluster.devices] == [14, 14, 16]
    assert [d.kind for d in p.cluster.devices] == ["dev0", "dev1", "dev2"]
    assert sum(r.param_bytes for _, r in g.records()) == 44
    assert dict(g.record("1").times) == {"dev0": 8, "dev1": 9, "dev2": 7}
    devs = {d.name: d for d in p.cluster.devices}
    assert p.link_time("14>19", devs["dev1"], devs["dev2"]) == 4  # comm 16
    assert p.link_time("14>23", devs["dev1"], devs["dev2"]) == 3  # comm 17
    assert p.link_time("1", devs["dev2"], devs["dev0"]) == 4
    assert p.link_time("0", devs["dev0"], devs["dev1"]) == 0  # the virtual source sends for free
    assert g.record("14").colocation == g.record("14>19").colocation is not None


@pytest.mark.parametrize(("old", "new", "message"), [
    (",7,6,8,", ",7,x,8,", r"line 4 \(task 2\), column 'p1': expected comma-separated numbers"),
    ('2,4,5,"4,5"', '2,4,9,"4,9"', r"line 4 \(task 2\), column 'dir_succ': unknown task 9"),
    ('2,4,5,"4,5"', '2,4,5,"4"', r"line 4 \(task 2\), column 'dir_succ_add'"),
    ('2,4,5,"4,5"', '2,4,2,"4,2"', r"line 4 \(task 2\), column 'dir_succ': a task cannot succeed itself"),
    (",0,1,3,1,0,2,3,2,0,2", ",0,1,3,1,0,2,3,2,1,2", r"line 4 \(task 2\), column 'pc22'"),
])
def test_reader_names_line_and_column(tmp_path, old, new, message) -> None:
    rows = EXAMPLE.read_text(encoding="utf-8").splitlines()
    assert old in rows[3]
    rows[3] = rows[3].replace(old, new)  # the row of task 2
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(rows), encoding="utf-8")
    with pytest.raises(WorkloadFormatError, match=message):
        read_moirai_csv(bad)


# -- example-1 -----------------------------------------------------------------------------------
def _hand_schedule() -> dict[str, tuple[str, float, float]]:
    """task -> (device, S, C) from the hand schedule's task table in Sheet1 (rows after 'task,,,,S,C,K')."""
    with HAND.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r[:1] == ["task"])
    return {r[0]: (f"dev{r[6]}", float(r[4]), float(r[5])) for r in rows[head + 1:] if r and r[0].isdigit()}


def test_milp_proves_30_on_example_1() -> None:
    p = read_moirai_csv(EXAMPLE)
    plan = moirai.solve(p)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(30, rel=1e-9)
    assert plan.lower_bound == pytest.approx(30, rel=1e-6)
    assert plan.objective == costmodel.evaluate(p, plan)
    assert plan.meta["milp_objective"] == pytest.approx(plan.objective, rel=1e-6)


def test_hand_schedule_simulates_within_its_31_to_the_optimum() -> None:
    p = read_moirai_csv(EXAMPLE)
    hand = _hand_schedule()
    assert len(hand) == 14
    # split nodes run on task 14's device the instant it completes
    sched = {v: hand[v] if v in hand else (hand["14"][0], hand["14"][2], hand["14"][2]) for v in p.graph}
    topo = {v: i for i, v in enumerate(p.graph.topological_order())}
    order = sorted(p.graph, key=lambda v: (sched[v][1], sched[v][2], topo[v]))
    assert all(order.index(u) < order.index(v) for u, v in p.graph.edges)
    stages = stages_from_order(p, order, {v: s[0] for v, s in sched.items()})
    plan = Plan.build(p, stages, solver="hand", seconds=0, lower_bound=0, status="feasible")
    # the hand schedule starts task 23 at 26 although its inputs are there at 25; run as early as
    # its placement and device order allow, it takes 30, the optimum
    assert plan.objective == 30


# -- random tiny problems ------------------------------------------------------------------------
@st.composite
def latency_problems(draw, min_nodes: int = 3, max_nodes: int = 5) -> Problem:
    """A random DAG on 2-3 devices of their own kinds, per-kind times, per-pair link times."""
    n = draw(st.integers(min_nodes, max_nodes))
    k = draw(st.integers(2, 3))
    kinds = [f"k{i}" for i in range(k)]
    pairs = [f"d{a}->d{b}" for a in range(k) for b in range(k) if a != b]
    g = OpGraph()
    for i in range(n):
        times = {kind: float(draw(st.integers(0, 8))) for kind in kinds if draw(st.integers(0, 4)) > 0}
        times = times or {kinds[0]: 1.0}
        g.add_node(str(i), NodeRecord(
            str(i), param_bytes=draw(st.integers(0, 3)), times=times,
            link_times={pair: float(draw(st.integers(0, 5))) for pair in pairs},
            colocation="c" if draw(st.integers(0, 5)) == 0 else None,
        ))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(str(u), str(v))
    mem = [draw(st.one_of(st.none(), st.integers(2, 8))) for _ in range(k)]
    devices = tuple(Device(f"d{i}", "meta", kinds[i], mem[i]) for i in range(k))
    return Problem(g, Cluster(devices), objective="latency", contiguous=False)


def _feasible(p: Problem, assign: dict[str, str]) -> bool:
    devs = {d.name: d for d in p.cluster.devices}
    if any(math.isinf(p.node_time(v, devs[d])) for v, d in assign.items()):
        return False
    groups = {(r.colocation, assign[v]) for v, r in p.graph.records() if r.colocation is not None}
    if len({c for c, _ in groups}) < len(groups):
        return False
    return all(devs[d].memory_bytes is None or costmodel.memory(p, [v for v in assign if assign[v] == d])
               <= devs[d].memory_bytes for d in devs)


def brute_force_latency(p: Problem) -> float:
    """Min simulated makespan over every feasible assignment and every plan order (every
    topological order of the nodes; it decides each device's and each port's order)."""
    nodes, names = list(p.graph), p.cluster.names
    orders = list(nx.all_topological_sorts(p.graph.nx))
    best = math.inf
    for choice in itertools.product(names, repeat=len(nodes)):
        assign = dict(zip(nodes, choice))
        if _feasible(p, assign):
            best = min(best, *(costmodel.simulate(p, stages_from_order(p, order, assign)).makespan
                               for order in orders))
    return best


def _check_plan(p: Problem, plan: Plan) -> None:
    assert plan.objective == costmodel.evaluate(p, plan)
    plan.validate(p)  # memory, colocation, device support, stage order
    assert plan.lower_bound <= plan.objective * (1 + 1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(latency_problems(max_nodes=6))
def test_milp_matches_brute_force(p: Problem) -> None:
    """The MILP's plan is the best plan, and its simulation reproduces the MILP's value."""
    expected = brute_force_latency(p)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            moirai.solve(p)
        return
    plan = moirai.solve(p)
    _check_plan(p, plan)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert plan.meta["milp_objective"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert plan.meta["milp_bound"] <= expected * (1 + 1e-9)


def _violated(model) -> list[str]:
    """Names of the model's constraints that its current variable values break."""
    bad = []
    for c in model.component_data_objects(pyo.Constraint, active=True):
        body = pyo.value(c.body)
        if (c.has_lb() and body < pyo.value(c.lower) - 1e-9) or (c.has_ub() and body > pyo.value(c.upper) + 1e-9):
            bad.append(c.name)
    return bad


@settings(max_examples=40, deadline=None, derandomize=True)
@given(latency_problems(max_nodes=6), st.randoms(use_true_random=False))
def test_every_plan_is_a_feasible_point_of_the_milp_with_its_makespan(p: Problem, rng) -> None:
    """The half of exactness that makes the MILP's bound a proof: any plan (random assignment,
    random plan order) initialises the model to a point meeting every constraint."""
    assign = {v: rng.choice([d.name for d in p.cluster.devices if math.isfinite(p.node_time(v, d))] or ["d0"])
              for v in p.graph}
    if not _feasible(p, assign):
        return
    order = list(nx.lexicographical_topological_sort(p.graph.nx, key=lambda v: rng.random()))
    stages = stages_from_order(p, order, assign)
    model = moirai.build(p)
    moirai.initialize(model, p, stages)
    assert _violated(model) == []
    assert pyo.value(model.makespan) * model.unit == pytest.approx(costmodel.simulate(p, stages).makespan)


def _forced(times: dict[str, tuple[str, float]], links: dict[str, dict[str, float]], edges: str) -> Problem:
    """Nodes each runnable on one device only (device gI has kind kI); ``edges`` like 'ab ac'."""
    g = OpGraph()
    for v, (dev, t) in times.items():
        g.add_node(v, NodeRecord(v, times={"k" + dev[1:]: t}, link_times=links.get(v, {})))
    for u, v in edges.split():
        g.add_edge(u, v)
    devs = tuple(Device(f"g{i}", "meta", f"k{i}", None) for i in range(3))
    return Problem(g, Cluster(devs), objective="latency", contiguous=False)


def test_one_producer_sends_in_destination_name_order() -> None:
    # s (g2) feeds a (g1, critical) and b (g0); the simulation sends s's output to g0 first
    # (name order), so a starts at 6, its output reaches b at 18: makespan 21. A free port order
    # (the paper's (8)) would send to g1 first and reach 20; the MILP models the name order.
    p = _forced({"s": ("g2", 2), "a": ("g1", 7), "b": ("g0", 3)},
                {"s": {"g2->g0": 1, "g2->g1": 3}, "a": {"g1->g0": 5}}, "sa sb ab")
    plan = moirai.solve(p)
    assert (plan.status, plan.objective, plan.meta["milp_objective"]) == ("optimal", 21, pytest.approx(21))
    assert brute_force_latency(p) == 21


def test_a_tie_at_a_port_goes_the_way_the_plan_orders_it() -> None:
    # a (g0) and b (g1) both finish at 3 and send to g2, where c needs only b and z needs all.
    # With a first in plan order: a 3..5, b 5..7, c 7..9, z 9..13. The MILP puts b first:
    # b 3..5, a 5..7, c 5..7, z 7..11, and its plan simulates to the same 11.
    p = _forced({"a": ("g0", 3), "b": ("g1", 3), "c": ("g2", 2), "z": ("g2", 4)},
                {"a": {"g0->g2": 2}, "b": {"g1->g2": 2}}, "az bc bz cz")
    a_first = [Stage("g0", ("a",)), Stage("g1", ("b",)), Stage("g2", ("c", "z"))]
    assert costmodel.simulate(p, a_first).makespan == 13
    plan = moirai.solve(p)
    assert (plan.status, plan.objective) == ("optimal", 11)
    assert plan.meta["milp_objective"] == pytest.approx(11) and plan.lower_bound == pytest.approx(11, rel=1e-6)
    assert [t.node for t in costmodel.simulate(p, plan.stages).transfers] == ["b", "a"]
    assert brute_force_latency(p) == 11


def test_a_port_waits_for_the_transfer_the_plan_puts_first() -> None:
    # a (g0) is done at 1 and sends to g2 for 10; b (g1) is done at 2 and sends to g2 for 1, where
    # c needs b and runs 20; z needs a and c. Served as they become ready: a 1..11, b 11..12,
    # c 12..32, z 32..33. With b first in plan order g2's in-port waits for it: b 2..3, a 3..13,
    # c 3..23, z 23..24. The MILP finds that order; no plan does better.
    p = _forced({"a": ("g0", 1), "b": ("g1", 2), "c": ("g2", 20), "z": ("g2", 1)},
                {"a": {"g0->g2": 10}, "b": {"g1->g2": 1}}, "az bc cz")
    a_first = [Stage("g0", ("a",)), Stage("g1", ("b",)), Stage("g2", ("c", "z"))]
    assert costmodel.simulate(p, a_first).makespan == 33
    plan = moirai.solve(p)
    assert (plan.status, plan.objective) == ("optimal", 24)
    assert brute_force_latency(p) == 24


def test_milp_proves_8_where_presolve_cut_it_off() -> None:
    # HiGHS 1.15's MIP presolve called 10 optimal here; the plan below simulates to 8.
    times = {"0": {"k0": 3, "k1": 0}, "1": {"k0": 1, "k1": 0}, "2": {"k0": 1, "k1": 3}, "3": {"k0": 1},
             "4": {"k0": 1, "k1": 3}, "5": {"k1": 2}}
    links = {"0": (0, 1), "1": (3, 3), "2": (2, 0), "3": (2, 3), "4": (0, 0), "5": (3, 2)}
    g = OpGraph()
    for v, t in times.items():
        g.add_node(v, NodeRecord(v, times={k: float(s) for k, s in t.items()},
                                 link_times={"d0->d1": float(links[v][0]), "d1->d0": float(links[v][1])}))
    for u, v in ("03", "12", "13", "14", "15", "23", "25", "34", "35"):
        g.add_edge(u, v)
    p = Problem(g, Cluster((Device("d0", "meta", "k0", None), Device("d1", "meta", "k1", None))),
                objective="latency", contiguous=False)
    eight = [Stage("d1", ("1", "2")), Stage("d0", ("0", "3")), Stage("d1", ("5",)), Stage("d0", ("4",))]
    assert costmodel.simulate(p, eight).makespan == 8
    plan = moirai.solve(p)
    assert (plan.status, plan.objective) == ("optimal", 8) and plan.lower_bound == pytest.approx(8, rel=1e-6)


def _random_problem(n: int, seed: int, k: int = 3) -> Problem:
    rng = random.Random(seed)
    g = OpGraph()
    pairs = [f"d{a}->d{b}" for a in range(k) for b in range(k) if a != b]
    for i in range(n):
        g.add_node(str(i), NodeRecord(str(i), param_bytes=rng.randint(1, 4),
                                      times={f"k{j}": float(rng.randint(1, 9)) for j in range(k)},
                                      link_times={pair: float(rng.randint(1, 4)) for pair in pairs}))
        for u in rng.sample(range(i), min(i, 2)):
            g.add_edge(str(u), str(i))
    devs = tuple(Device(f"d{j}", "meta", f"k{j}", 20) for j in range(k))
    return Problem(g, Cluster(devs), objective="latency", contiguous=False)


def _building(p) -> float:
    """Seconds to build ``p``'s MILP here and now: time limits in tests scale with it, so a busy
    machine (handing the model to HiGHS takes ~4x the build) does not starve the solve."""
    t0 = time.perf_counter()
    moirai.build(p)
    return time.perf_counter() - t0


def test_a_warm_start_is_the_first_incumbent() -> None:
    """The start HiGHS gets is a feasible point of value m-SCT's 47 (in 1 s HiGHS alone finds 52),
    so the result is never worse: HiGHS's incumbent when it took the start in time, the start
    itself when the limit ran out first (a loaded machine; ``meta["stopped"]``)."""
    p = _random_problem(16, seed=1)
    start = m_sct(p)
    model = moirai.build(p)
    moirai.initialize(model, p, start.stages)
    assert _violated(model) == []
    assert pyo.value(model.makespan) * model.unit == pytest.approx(start.objective)
    plan = moirai.solve(p, time_limit=1.0 + 6 * _building(p), warm_start=start)
    _check_plan(p, plan)
    assert plan.objective <= start.objective
    if "stopped" not in plan.meta:
        assert plan.meta["milp_objective"] <= start.objective * (1 + 1e-6)  # HiGHS took the start


def test_time_limit_returns_the_incumbent() -> None:
    """At the limit the plan is HiGHS's best incumbent, started from m-SCT's plan as ``auto``
    starts it (without a start, a loaded machine can stop HiGHS before its own first incumbent:
    SolverLimitError, by design).

    The limit is fixed: HiGHS needs ~29 s here to prove this 20-node problem (37 found in 4 s,
    m-SCT's start 45, bound 28), so neither a quiet machine nor a busy one proves it in 4 s. (A limit
    scaled with the build time let a busy machine's larger limit prove a smaller problem.)"""
    p = _random_problem(20, seed=0)
    start = m_sct(p)
    plan = moirai.solve(p, time_limit=4.0, warm_start=start)
    assert plan.status == "time_limit"
    _check_plan(p, plan)
    assert plan.lower_bound < plan.objective <= start.objective
    assert plan.seconds < 4.0 * 1.1 + 2.0


def test_infeasible_memory_raises() -> None:
    p = read_moirai_csv(EXAMPLE)
    small = Cluster(tuple(Device(d.name, d.torch_device, d.kind, 13) for d in p.cluster.devices))
    with pytest.raises(InfeasibleError, match="44 bytes"):
        moirai.solve(Problem(p.graph, small, objective="latency"))


def test_throughput_problem_is_rejected() -> None:
    p = read_moirai_csv(EXAMPLE)
    with pytest.raises(ValueError, match="latency"):
        moirai.build(Problem(p.graph, p.cluster, objective="throughput"))
