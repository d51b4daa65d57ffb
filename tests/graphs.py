"""Small random problems for property tests, and a brute-force optimum to check solvers against."""
from __future__ import annotations

import itertools
import math

from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Problem


@st.composite
def problems(draw, max_nodes: int = 7) -> Problem:
    """A random DAG with accelerator/CPU times, transfer times, memory, colocation and CPU-only nodes."""
    n = draw(st.integers(1, max_nodes))
    g = OpGraph()
    n_classes = draw(st.integers(0, 2))
    for i in range(n):
        color = draw(st.integers(0, n_classes)) if n_classes else 0
        g.add_node(str(i), _record(draw, str(i), colocation=f"k{color}" if color else None))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(str(u), str(v))
    return Problem(g, _cluster(draw))


def _cluster(draw) -> Cluster:
    """0-2 accelerators of one memory size and 0-2 CPUs, at least one device."""
    k, l_ = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    if k + l_ == 0:
        l_ = 1
    mem = draw(st.integers(2, 12))
    devices = [Device(f"acc{i}", "meta", "accel", mem) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(l_)]
    return Cluster(tuple(devices))


def _record(draw, name: str, *, colocation: str | None, backward: bool = False) -> NodeRecord:
    """A node that always runs on a CPU and usually on an accelerator."""
    times = {"cpu": float(draw(st.integers(1, 20)))}
    if draw(st.integers(0, 5)) > 0:
        times["accel"] = float(draw(st.integers(0, 10)))
    return NodeRecord(name, param_bytes=draw(st.integers(0, 4)), times=times, backward=backward,
                      transfer_time=float(draw(st.integers(0, 6))), colocation=colocation)


@st.composite
def training_problems(draw, max_forward: int = 3, max_backward: int = 4, cpus: int | None = None) -> Problem:
    """A random training graph (Tarnawski Sec. 5.3): forward nodes ``f_i`` on a random DAG and
    backward nodes ``b_j``, each colocated with a forward node's class or orphaned (no forward
    sibling, Tarnawski App. E.1). Edges: forward -> forward, forward -> backward (stashed
    activations), and backward -> backward along a random order of the backward nodes, so a
    backward node may feed one of any other class, in the forward direction, against it, or
    between unrelated classes. The cluster is drawn as for :func:`problems`; or it is ``cpus``
    CPUs, there are ``max_forward`` forward nodes in a chain and ``b_i`` is ``f_i``'s sibling for
    each ``i``, so that with three CPUs or more the backward edges often order the classes neither
    in the forward order nor in its reverse."""
    n_fw = draw(st.integers(1 if cpus is None else max_forward, max_forward))
    n_bw = draw(st.integers(1 if cpus is None else n_fw, max_backward))
    g = OpGraph()
    for i in range(n_fw):
        g.add_node(f"f{i}", _record(draw, f"f{i}", colocation=f"k{i}"))
    for j in range(n_bw):
        owner = j if j < n_fw and cpus is not None else draw(st.integers(-1, n_fw - 1))  # -1: orphaned
        g.add_node(f"b{j}", _record(draw, f"b{j}", colocation=f"k{owner}" if owner >= 0 else None, backward=True))
    for u, v in itertools.combinations(range(n_fw), 2):
        if (cpus is not None and v == u + 1) or draw(st.booleans()):
            g.add_edge(f"f{u}", f"f{v}")
    for i, j in itertools.product(range(n_fw), range(n_bw)):
        if draw(st.integers(0, 3)) == 0:
            g.add_edge(f"f{i}", f"b{j}")
    order = draw(st.permutations(range(n_bw)))
    for a, b in itertools.combinations(order, 2):
        if draw(st.booleans()):
            g.add_edge(f"b{a}", f"b{b}")
    cluster = _cluster(draw) if cpus is None else Cluster(tuple(Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)))
    return Problem(g, cluster, mode="training")


def _units(problem: Problem) -> list[list[str]]:
    """The colocation groups (and single nodes without one), in node order."""
    groups: dict[str, list[str]] = {}
    for v, r in problem.graph.records():
        groups.setdefault(r.colocation if r.colocation is not None else f"node {v}", []).append(v)
    return list(groups.values())


def has_pipeline_order(problem: Problem, assign: dict[str, str]) -> bool:
    """Whether some order of the devices sends every forward -> forward edge forward and every
    backward -> backward edge either all forward or all backward (the contiguous splits: Tarnawski
    Fact 5.2, Sec. 5.3; see ``torchplace.plan._check_contiguity``), tried over every order."""
    g = problem.graph
    pairs: dict[bool, set[tuple[str, str]]] = {False: set(), True: set()}
    for u, v in g.edges:
        if assign[u] != assign[v] and g.record(u).backward == g.record(v).backward:
            pairs[g.record(u).backward].add((assign[u], assign[v]))
    for order in itertools.permutations(sorted(set(assign.values()))):
        pos = {d: i for i, d in enumerate(order)}
        if all(pos[a] < pos[b] for a, b in pairs[False]) and (
            all(pos[a] < pos[b] for a, b in pairs[True]) or all(pos[a] > pos[b] for a, b in pairs[True])
        ):
            return True
    return False


def brute_force_contiguous(problem: Problem) -> float:
    """Min max-load over every assignment whose devices can run as a pipeline of stages.

    Such assignments are exactly the chains of ideal differences the DP searches: colocation kept,
    every node on a device that can run it, memory respected, and an order of the devices in which
    forward data flows forward and backward data all forward or all backward
    (:func:`has_pipeline_order`).
    """
    names = problem.cluster.names
    units = _units(problem)
    best = math.inf
    for choice in itertools.product(names, repeat=len(units)):
        assign = {v: d for unit, d in zip(units, choice) for v in unit}
        if not has_pipeline_order(problem, assign):
            continue
        stages = [Stage(d, tuple(v for v in problem.graph if assign[v] == d)) for d in names]
        stages = [s for s in stages if s.nodes]
        if any(
            (cap := problem.cluster.device(s.device).memory_bytes) is not None
            and costmodel.memory(problem, s.nodes) > cap
            for s in stages
        ):
            continue
        best = min(best, costmodel.evaluate_stages(problem, stages)[0])
    return best
