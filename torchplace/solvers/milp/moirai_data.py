"""The index sets and constants of the MOIRAI latency MILP, derived from a Problem.

:mod:`torchplace.solvers.milp.moirai` builds the model (Zhang et al., "MOIRAI", Sec. III-D,
Table II) on these: which devices can run each node and for how long, the positive transfer
channels, the node pairs that may share a device, the transfer pairs that may share a port, memory,
colocation and the big-M horizon. Times are scaled by the largest duration (see the model's
module docstring).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

import networkx as nx

from torchplace.errors import InfeasibleError
from torchplace.problem import Problem

__all__ = ["MoiraiData", "derive", "port_pairs"]


@dataclass(frozen=True)
class MoiraiData:
    """The model's index sets and constants, derived from a Problem (times in scaled units)."""

    nodes: list[str]  # topological order
    devices: list[str]
    unit: float  # seconds per model time unit
    p: dict[tuple[str, str], float]  # (v, k): time of v on k, only where v can run
    link: dict[tuple[str, str, str], float]  # (u, k', d): positive transfer time of u from k' to d
    transfers: list[tuple[str, str]]  # (u, d): u may have to send its output to d
    longest: dict[tuple[str, str], float]  # (u, d): its longest transfer time over sources k'
    need: list[tuple[str, str, str]]  # (u, v, d): edge u -> v with v possibly on d
    pairs: list[tuple[str, str, str]]  # (i, j, k): unordered nodes i, j may overlap on k
    memory: dict[str, int]  # v: bytes
    capacity: dict[str, int]  # k: bytes, devices with a limit
    colocated: list[tuple[str, str, str]]  # (v, rep, k): v must be on k iff its group's rep is
    horizon: float
    below: dict[str, set[str]]  # v: its descendants


def _allowed(problem: Problem) -> dict[tuple[str, str], float]:
    """(v, k) -> seconds for every node and device that can run it; raises if a node has none."""
    p = {}
    for v in problem.graph.topological_order():
        times = {d.name: problem.node_time(v, d) for d in problem.cluster.devices}
        finite = {k: t for k, t in times.items() if math.isfinite(t)}
        if not finite:
            kinds = sorted({d.kind for d in problem.cluster.devices})
            raise InfeasibleError(f"node {v!r} cannot run on any device (kinds {kinds}); it has times for "
                                  f"{sorted(problem.graph.record(v).times)}")
        p.update({(v, k): t for k, t in finite.items()})
    return p


def _links(problem: Problem, p: Mapping[tuple[str, str], float]) -> dict[tuple[str, str, str], float]:
    """(u, k', d) -> seconds of every positive transfer a producer ``u`` on ``k'`` may make to ``d``."""
    g, devs = problem.graph, problem.cluster.devices
    out = {}
    for u in g.topological_order():
        dests = {d.name for v in g.successors(u) for d in devs if (v, d.name) in p}
        for src in devs:
            for dst in devs:
                if (u, src.name) in p and dst.name in dests and src.name != dst.name:
                    t = problem.link_time(u, src, dst)
                    if t > 0:
                        out[(u, src.name, dst.name)] = t
    return out


def _unordered_pairs(problem: Problem, p: Mapping[tuple[str, str], float],
                     below: Mapping[str, set[str]]) -> list[tuple[str, str, str]]:
    """(i, j, k): nodes no path orders that can both run on k (0-s nodes too: the device serves
    them in plan order, so one whose inputs arrive late holds up the other)."""
    order = problem.graph.topological_order()
    return [(i, j, d.name) for i, j in combinations(order, 2) if j not in below[i]
            for d in problem.cluster.devices if (i, d.name) in p and (j, d.name) in p]


def _colocated(problem: Problem, devices: Sequence[str]) -> list[tuple[str, str, str]]:
    rep: dict[str, str] = {}
    out = []
    for v in problem.graph.topological_order():
        group = problem.graph.record(v).colocation
        if group is not None:
            if group in rep:
                out += [(v, rep[group], k) for k in devices]
            rep.setdefault(group, v)
    return out


def derive(problem: Problem) -> MoiraiData:
    g, devices = problem.graph, problem.cluster.names
    nodes = g.topological_order()
    topo = {v: i for i, v in enumerate(nodes)}
    p = _allowed(problem)
    link = _links(problem, p)
    unit = max([t for t in (*p.values(), *link.values()) if t > 0], default=1.0)
    transfers = sorted({(u, d) for u, v in g.edges for d in devices
                        if (v, d) in p and any((u, k) in p for k in devices if k != d)},
                       key=lambda t: (topo[t[0]], t[1]))
    longest = dict.fromkeys(transfers, 0.0)
    for (u, _, d), t in link.items():
        longest[(u, d)] = max(longest[(u, d)], t)
    slowest = dict.fromkeys(nodes, 0.0)
    for (v, _), t in p.items():
        slowest[v] = max(slowest[v], t)
    below = {v: nx.descendants(g.nx, v) for v in nodes}
    memory = {v: r.param_bytes + r.temp_bytes for v, r in g.records()}
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices if d.memory_bytes is not None}
    return MoiraiData(
        nodes=nodes, devices=devices, unit=unit,
        p={key: t / unit for key, t in p.items()},
        link={key: t / unit for key, t in link.items()},
        transfers=transfers, longest={key: t / unit for key, t in longest.items()},
        need=[(u, v, d) for u, v in g.edges for d in devices if (v, d) in p and (u, d) in longest],
        pairs=_unordered_pairs(problem, p, below), below=below, memory=memory,
        capacity={k: cap for k, cap in caps.items()  # only limits the nodes could exceed
                  if sum(memory[v] for v in nodes if (v, k) in p) > cap},
        colocated=_colocated(problem, devices),
        horizon=(math.fsum(slowest.values()) + math.fsum(longest.values())) / unit,
    )


def port_pairs(data: MoiraiData) -> tuple[list[tuple], list[tuple], list[tuple]]:
    """Pairs of transfers that may hold one port: (u, d, v, d) into ``d`` and (u, d, v, e, k) out
    of ``k``, ``u`` no later than ``v`` in topological order; and the producer pairs (u, v) whose
    order the model picks (``pi``). The other pairs' order is fixed: ``u`` before a descendant
    ``v`` (plan order is topological), one producer's transfers in destination name order."""
    src = defaultdict(set)  # (u, d) -> devices k with a positive transfer u: k -> d
    for u, k, d in data.link:
        src[(u, d)].add(k)
    moving = [t for t in data.transfers if src[t]]
    into, out = [], []
    for (u, d), (v, e) in combinations(moving, 2):
        if d == e:
            into.append((u, d, v, e))
        out += [(u, d, v, e, k) for k in sorted(src[(u, d)] & src[(v, e)])]
    topo = {v: i for i, v in enumerate(data.nodes)}
    free = sorted({(q[0], q[2]) for q in into + out if q[0] != q[2] and q[2] not in data.below[q[0]]},
                  key=lambda uv: (topo[uv[0]], topo[uv[1]]))
    return into, out, free
