"""Small random problems for property tests, and a brute-force optimum to check solvers against."""
from __future__ import annotations

import itertools
import math

import networkx as nx
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
        times = {"cpu": float(draw(st.integers(1, 20)))}
        if draw(st.integers(0, 5)) > 0:
            times["accel"] = float(draw(st.integers(0, 10)))
        color = draw(st.integers(0, n_classes)) if n_classes else 0
        g.add_node(str(i), NodeRecord(
            str(i), param_bytes=draw(st.integers(0, 4)), times=times,
            transfer_time=float(draw(st.integers(0, 6))),
            colocation=f"k{color}" if color else None,
        ))
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(str(u), str(v))
    k, l_ = draw(st.integers(0, 2)), draw(st.integers(0, 2))
    if k + l_ == 0:
        l_ = 1
    mem = draw(st.integers(2, 12))
    devices = [Device(f"acc{i}", "meta", "accel", mem) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(l_)]
    return Problem(g, Cluster(tuple(devices)))


def brute_force_contiguous(problem: Problem) -> float:
    """Min max-load over every assignment whose device sets can run as a chain of stages.

    Such assignments are exactly the chains of ideal differences the DP searches: colocation kept,
    every node on a device that can run it, memory respected, and the device graph acyclic.
    """
    g, names = problem.graph, problem.cluster.names
    nodes = list(g)
    best = math.inf
    for choice in itertools.product(range(len(names)), repeat=len(nodes)):
        assign = {v: names[c] for v, c in zip(nodes, choice)}
        groups: dict[str, set[str]] = {}
        for v, r in g.records():
            if r.colocation is not None:
                groups.setdefault(r.colocation, set()).add(assign[v])
        if any(len(d) > 1 for d in groups.values()):
            continue
        quotient = nx.DiGraph((assign[u], assign[v]) for u, v in g.edges if assign[u] != assign[v])
        if not nx.is_directed_acyclic_graph(quotient):
            continue
        stages = [Stage(d, tuple(v for v in nodes if assign[v] == d)) for d in names]
        stages = [s for s in stages if s.nodes]
        if any(
            (cap := problem.cluster.device(s.device).memory_bytes) is not None
            and costmodel.memory(problem, s.nodes) > cap
            for s in stages
        ):
            continue
        best = min(best, costmodel.evaluate_stages(problem, stages)[0])
    return best
