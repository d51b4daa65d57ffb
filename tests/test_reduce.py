"""Safe contractions before the ideals DP (torchplace/solvers/reduce.py, issue 16 item 1).

Certificates, not numbers: the DP with the rules equals the DP without them and brute force on
random graphs rich in zero-cost nodes; each plan maps back to every original node and passes
validation; and for every condition of every rule an instance where dropping it changes the
optimum (or breaks the plan), so these tests fail if a condition is dropped.
"""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings

from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import dp, reduce
from torchplace.solvers.contract import contract

from .graphs import brute_force_contiguous, zero_rich_problems


def _solve(problem: Problem, **opts) -> float:
    try:
        plan = dp.solve(problem, **opts)
    except Exception as e:  # noqa: BLE001 - infeasible either way
        if type(e).__name__ == "InfeasibleError":
            return math.inf
        raise
    plan.validate(problem)
    assert set(plan.assignment) == set(problem.graph)
    return plan.objective


@settings(max_examples=120, deadline=None)
@given(zero_rich_problems())
def test_reduced_dp_equals_unreduced_dp_and_brute_force(problem):
    reduced = _solve(problem)
    assert reduced == pytest.approx(_solve(problem, reduce=False), rel=1e-9)
    assert reduced == pytest.approx(brute_force_contiguous(problem), rel=1e-9)


@settings(max_examples=100, deadline=None)
@given(zero_rich_problems(max_nodes=7))
def test_reduced_contraction_maps_back_to_the_original(problem):
    con = contract(problem.graph)
    r = reduce.reduce_contraction(problem, con)
    held = [j for group in r.groups for j in group] + [j for group, _, _ in r.freed for j in group]
    assert sorted(held) == list(range(len(con.nodes)))
    assert all(u < v for u, v in r.con.edges)  # still in topological order
    pieces = r.expand([list(range(len(r.con.nodes)))])  # everything on one device
    assert pieces == [list(range(len(con.nodes)))]


def _node(name: str, accel: float | None, cpu: float | None, size: int = 0, cost: float = 0.0) -> NodeRecord:
    times = {k: t for k, t in (("accel", accel), ("cpu", cpu)) if t is not None}
    return NodeRecord(name, times=times, param_bytes=size, transfer_time=cost)


def _problem(nodes: list[NodeRecord], edges: list[tuple[str, str]], accels: int, cpus: int, memory: int = 100) -> Problem:
    g = OpGraph()
    for r in nodes:
        g.add_node(r.name, r)
    for u, v in edges:
        g.add_edge(u, v)
    devices = [Device(f"acc{i}", "meta", "accel", memory) for i in range(accels)]
    devices += [Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)]
    return Problem(g, Cluster(tuple(devices)))


def _weightless_leaf() -> Problem:
    """M -> N, N free of time but 5 bytes: M and N together overflow an accelerator (6 bytes)."""
    return _problem([_node("M", 1, 10, size=5), _node("N", 0, 0, size=5)], [("M", "N")], accels=2, cpus=1, memory=6)


def _zero_time_leaf() -> Problem:
    """M (CPU only) -> N, N free on the accelerator but slow on the CPU: N belongs on the accelerator."""
    return _problem([_node("M", None, 1), _node("N", 0, 5)], [("M", "N")], accels=1, cpus=1)


def _unsupported_leaf() -> Problem:
    """M (accelerator only) -> N (CPU only, free): the leaf cannot follow M."""
    return _problem([_node("M", 1, None, cost=0.5), _node("N", None, 0)], [("M", "N")], accels=1, cpus=1)


def _training(nodes: list[NodeRecord], edges: list[tuple[str, str]]) -> Problem:
    import dataclasses

    return dataclasses.replace(_problem(nodes, edges, accels=2, cpus=0), mode="training")


def _class(r: NodeRecord, colocation: str, backward: bool = False) -> NodeRecord:
    import dataclasses

    return dataclasses.replace(r, colocation=colocation, backward=backward)


def _touching_leaf() -> Problem:
    """Training: A -> N in the DAG, but N's output (cost 5) also feeds X's backward node, an
    edge the forward DAG does not show. N is A's leaf only in the DAG: its output belongs with X."""
    nodes = [_class(_node("fA", 10, None, cost=1), "A"), _class(_node("bA", 0, None), "A", True),
             _class(_node("fX", 10, None), "X"), _class(_node("bX", 0, None), "X", True),
             _node("fN", 0, None, cost=5)]
    return _training(nodes, [("fA", "fX"), ("fA", "fN"), ("fN", "bX"), ("fX", "bX"), ("bX", "bA"), ("fA", "bA")])


def _costly_chain() -> Problem:
    """U -> V -> W, V free but its output costly (100) while U's is cheap (1): cut before V."""
    return _problem([_node("U", 10, 100, cost=1), _node("V", 0, 0, cost=100), _node("W", 10, 100, cost=1)],
                    [("U", "V"), ("V", "W")], accels=2, cpus=0)


def _chain_with_side_input() -> Problem:
    """Training: U -> V is a chain of the forward DAG, but V's backward node also reads X's
    stashed output (cost 5), an edge the forward DAG does not show: V belongs with X."""
    nodes = [_node("fU", 10, None, cost=1), _class(_node("fX", 10, None, cost=5), "X"),
             _class(_node("fV", 0, None), "V"), _class(_node("bV", 0, None), "V", True)]
    return _training(nodes, [("fU", "fV"), ("fV", "bV"), ("fX", "bV")])


def _free_with_costly_output() -> Problem:
    """A -> N -> B with N free in time and bytes but its output costly: N is not free."""
    return _problem([_node("A", 4, 40, cost=0), _node("N", 0, 0, cost=3), _node("B", 4, 40, cost=0)],
                    [("A", "N"), ("N", "B")], accels=2, cpus=0)


def _free_but_slow_on_cpu() -> Problem:
    """A -> N -> B, N free on accelerators but slow on the CPU: where N lands matters."""
    return _problem([_node("A", 4, 40), _node("N", 0, 30), _node("B", None, 1)],
                    [("A", "N"), ("N", "B")], accels=1, cpus=1)


def _drop(monkeypatch, name: str) -> None:
    """Make one condition of the rules always hold."""
    if name in ("weightless", "zero_time_on"):
        monkeypatch.setattr(reduce._State, name, lambda self, *a: True)
    else:
        monkeypatch.setattr(reduce, name, lambda *a: True)


CASES = [
    ("weightless", _weightless_leaf, 1.0),  # unsafe: 10 (both on the CPU)
    ("zero_time_on", _zero_time_leaf, 1.0),  # unsafe: 6
    ("zero_time_on", _unsupported_leaf, 1.5),  # unsafe: infeasible
    ("_touches_only", _touching_leaf, 11.0),  # unsafe: 16
    ("_chain_pays_off", _costly_chain, 11.0),  # unsafe: 20
    ("_feeds_only", _chain_with_side_input, 11.0),  # unsafe: 15
    ("_crossing_is_free", _free_with_costly_output, 4.0),  # unsafe: the DP loses N's transfer (KeyError)
    ("zero_time_on", _free_but_slow_on_cpu, 4.0),  # unsafe: 71 (N put on the CPU)
]


@pytest.mark.parametrize("condition, build, optimum", CASES, ids=[f"{c}-{b.__name__}" for c, b, _ in CASES])
def test_every_condition_is_needed(monkeypatch, condition, build, optimum):
    problem = build()
    assert _solve(problem) == pytest.approx(optimum) == pytest.approx(brute_force_contiguous(problem))
    _drop(monkeypatch, condition)
    try:
        unsafe = _solve(problem)
    except (AssertionError, KeyError):
        return  # the unsafe rule gave a plan the cost model disagrees with, or lost a node
    assert unsafe != pytest.approx(optimum), "dropping the condition changed nothing: the case shows nothing"


def test_rules_shrink_zero_cost_structure():
    """A chain of heavy nodes, each with a free leaf and a free node between it and the next:
    only the heavy nodes remain, and the optimum is unchanged."""
    nodes, edges = [], []
    for i in range(6):
        nodes += [_node(f"h{i}", 3 + i, 50, cost=1), _node(f"leaf{i}", 0, 0), _node(f"z{i}", 0, 0)]
        edges += [(f"h{i}", f"leaf{i}"), (f"h{i}", f"z{i}")]
        if i:
            edges.append((f"z{i - 1}", f"h{i}"))
    problem = _problem(nodes, edges, accels=3, cpus=1)
    plan = dp.solve(problem)
    assert plan.meta["supernodes_before"] == 18 and plan.meta["supernodes"] == 6
    assert plan.objective == pytest.approx(dp.solve(problem, reduce=False).objective)


def test_free_leaves_on_every_layer_are_all_removed():
    """An Inception-like graph with a free leaf on every layer: the contractions remove every
    leaf, leaving the graph without them, with the same optimum (and plan cost)."""
    from torchplace.workloads.synthetic import inception_like

    with_leaves, without = inception_like(3, [2, 3, 3], free_leaves=True), inception_like(3, [2, 3, 3])
    plan = dp.solve(with_leaves)
    plain = dp.solve(without)
    assert plan.meta["supernodes_before"] == 2 * plain.meta["supernodes"] == 2 * plan.meta["supernodes"]
    assert plan.meta["ideals"] == plain.meta["ideals"]
    assert plan.objective == pytest.approx(plain.objective, rel=1e-12)


@pytest.mark.parametrize("with_cpu", [False, True])
def test_an_eliminated_group_with_a_costly_inner_edge(with_cpu):
    """Found by hypothesis: f0 -> f1 is merged, then the pair is free (its only crossing edge has
    a zero-cost producer) and eliminated, while f0's own output costs 1: the DP's transfer count
    must leave the eliminated producer out (it raised KeyError)."""
    g = OpGraph()
    g.add_node("f0", NodeRecord("f0", times={"cpu": 0.0, "accel": 0.0}, transfer_time=1.0, colocation="k0"))
    g.add_node("f1", NodeRecord("f1", times={"cpu": 1.0, "accel": 0.0}, colocation="k1"))
    g.add_node("b0", NodeRecord("b0", times={"cpu": 1.0}, backward=True))
    g.add_edge("f0", "f1")
    g.add_edge("f1", "b0")
    devices = (Device("acc0", "meta", "accel", 2),) + ((Device("cpu0", "cpu", "cpu", None),) if with_cpu else ())
    problem = Problem(g, Cluster(devices), mode="training")
    reduced = _solve(problem)
    assert reduced == pytest.approx(_solve(problem, reduce=False), rel=1e-9)
    assert reduced == pytest.approx(_solve(problem, stream=True), rel=1e-9)  # the streamed DP too
    assert reduced == pytest.approx(brute_force_contiguous(problem), rel=1e-9)
    assert (reduced == math.inf) != with_cpu  # b0 runs only on a CPU
