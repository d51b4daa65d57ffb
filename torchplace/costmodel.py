"""The one cost model: what a stage costs, and what a whole placement costs.

Every solver's reported objective is :func:`evaluate` of its plan; nothing else in torchplace says
what a placement costs.

Throughput (Tarnawski et al. 2020, Sec. 3 and App. C, eq. (20)-(21); Archer et al. 2024, Sec. 2.2):
the load of device ``d`` holding node set ``S`` is

    load(S, d) = sum_{v in S} p_v(d)                         compute
               + sum_{u not in S, u -> v, v in S} c_u        incoming transfers
               + sum_{u in S, u -> v, v not in S} c_u        outgoing transfers

where each producer ``u`` is counted once per side however many consumers it has, and a CPU
device pays no transfer (it reads host memory directly). The objective is the max load over
devices: the time per sample of a pipeline in steady state (Tarnawski Sec. 5.1).
A device holding several stages (non-contiguous splits) is charged for the union of its nodes.

Memory of a device is ``sum_{v in S} (param_bytes_v + temp_bytes_v)``.

Latency (MOIRAI Sec. III-D, eqs. (4a)-(8); Baechi Sec. 4.2): one sample runs as an event
simulation, :func:`simulate`. Each device runs its nodes one at a time in plan order (stage by
stage; inside a stage in the graph's topological order). A node starts when its device is free and
every input has arrived. An output crossing to another device is one transfer per (producer,
destination device) of :meth:`Problem.link_time` seconds, which starts when the producer finishes
and holds the sender's out-port and the receiver's in-port (transfers out of one device serialize,
transfers into one device serialize: MOIRAI's congestion constraints (8)); ports are granted in the
order transfers become ready. The objective is the makespan.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torchplace.devices import Device
from torchplace.problem import Problem

__all__ = [
    "Schedule",
    "StageCost",
    "StageLike",
    "Transfer",
    "device_cost",
    "evaluate",
    "evaluate_stages",
    "memory",
    "simulate",
    "transfers",
]


class StageLike(Protocol):
    @property
    def device(self) -> str: ...

    @property
    def nodes(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class StageCost:
    """Cost breakdown of the node set one device holds (see the module docstring)."""

    device: str
    ops: int
    compute: float
    transfer_in: float
    transfer_out: float
    memory: int

    @property
    def load(self) -> float:
        return self.compute + self.transfer_in + self.transfer_out


def transfers(problem: Problem, nodes: Collection[str]) -> tuple[float, float]:
    """(incoming, outgoing) transfer seconds of node set ``nodes``, each producer counted once."""
    members = nodes if isinstance(nodes, (set, frozenset)) else set(nodes)
    g = problem.graph
    incoming: set[str] = set()
    outgoing = 0.0
    for v in members:
        for u in g.predecessors(v):
            if u not in members:
                incoming.add(u)
        if any(w not in members for w in g.successors(v)):
            outgoing += problem.transfer_time(v)
    return math.fsum(problem.transfer_time(u) for u in sorted(incoming)), outgoing


def memory(problem: Problem, nodes: Iterable[str]) -> int:
    """Bytes a device needs for ``nodes``: parameters plus working memory."""
    g = problem.graph
    return sum(g.record(v).param_bytes + g.record(v).temp_bytes for v in nodes)


def device_cost(problem: Problem, nodes: Collection[str], device: Device) -> StageCost:
    """Cost of placing node set ``nodes`` on ``device``."""
    compute = math.fsum(problem.node_time(v, device) for v in nodes)
    t_in, t_out = transfers(problem, nodes) if device.pays_transfer else (0.0, 0.0)
    return StageCost(device.name, len(nodes), compute, t_in, t_out, memory(problem, nodes))


def _nodes_by_device(stages: Iterable[StageLike]) -> dict[str, list[str]]:
    by_device: dict[str, list[str]] = defaultdict(list)
    for s in stages:
        by_device[s.device].extend(s.nodes)
    return by_device


def evaluate_stages(problem: Problem, stages: Sequence[StageLike]) -> tuple[float, list[StageCost]]:
    """The objective of ``stages`` and the per-device breakdown (devices in first-use order).

    Throughput: the max device load. Latency: the makespan of :func:`simulate`, with each device's
    transfer columns holding the seconds its ports were busy.
    """
    if problem.objective == "latency":
        sched = simulate(problem, stages)
        return sched.makespan, sched.costs(problem)
    costs = [
        device_cost(problem, set(nodes), problem.cluster.device(name))
        for name, nodes in _nodes_by_device(stages).items()
    ]
    return max((c.load for c in costs), default=0.0), costs


def evaluate(problem: Problem, plan: object) -> float:
    """The objective of a plan (anything with ``.stages``) under ``problem``'s cost model."""
    return evaluate_stages(problem, plan.stages)[0]  # type: ignore[attr-defined]


# -- latency ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """One tensor moving between devices in a latency schedule."""

    node: str
    src: str
    dst: str
    start: float
    finish: float


@dataclass(frozen=True)
class Schedule:
    """The event simulation of one sample (see the module docstring).

    Attributes:
        makespan: time the last node finishes (the latency objective).
        start, finish: per node.
        device_of: node -> device name.
        order: per device, its nodes in execution order.
        transfers: every cross-device transfer, in the order the ports granted them.
    """

    makespan: float
    start: dict[str, float]
    finish: dict[str, float]
    device_of: dict[str, str]
    order: dict[str, list[str]]
    transfers: list[Transfer]

    def costs(self, problem: Problem) -> list[StageCost]:
        """Per device: compute seconds, seconds its in/out ports were busy, memory."""
        t_in: dict[str, float] = defaultdict(float)
        t_out: dict[str, float] = defaultdict(float)
        for t in self.transfers:
            t_in[t.dst] += t.finish - t.start
            t_out[t.src] += t.finish - t.start
        out = []
        for dev, nodes in self.order.items():
            compute = math.fsum(self.finish[v] - self.start[v] for v in nodes)
            out.append(StageCost(dev, len(nodes), compute, t_in[dev], t_out[dev], memory(problem, nodes)))
        return out


def _device_orders(problem: Problem, stages: Sequence[StageLike]) -> dict[str, list[str]]:
    """Each device's nodes in run order: stage by stage, topological inside a stage."""
    topo = {v: i for i, v in enumerate(problem.graph.topological_order())}
    key: dict[str, tuple[int, int]] = {}
    by_device: dict[str, list[str]] = defaultdict(list)
    for i, s in enumerate(stages):
        for v in s.nodes:
            key[v] = (i, topo[v])
            by_device[s.device].append(v)
    return {d: sorted(nodes, key=key.__getitem__) for d, nodes in by_device.items()}


def simulate(problem: Problem, stages: Sequence[StageLike]) -> Schedule:
    """Run one sample of ``stages`` through the event simulation of the module docstring.

    Raises:
        ValueError: if the stage order makes a device wait for a node it runs later (a plan
            that :meth:`Plan.validate` accepts never does).
    """
    g, cluster = problem.graph, problem.cluster
    order = _device_orders(problem, stages)
    device_of = {v: d for d, nodes in order.items() for v in nodes}
    devices = {d: cluster.device(d) for d in order}
    topo = {v: i for i, v in enumerate(g.topological_order())}
    start: dict[str, float] = {}
    finish: dict[str, float] = {}
    arrival: dict[tuple[str, str], float] = {}  # (node, device) -> time its output is there
    free = dict.fromkeys(order, 0.0)
    nxt = dict.fromkeys(order, 0)
    out_port: dict[str, float] = defaultdict(float)
    in_port: dict[str, float] = defaultdict(float)
    moved: list[Transfer] = []
    events: list[tuple[float, int, str]] = []  # (finish time, topo index, node)

    def try_start(dev: str) -> None:
        """Start ``dev``'s next nodes while their inputs' arrival times are known."""
        while nxt[dev] < len(order[dev]):
            v = order[dev][nxt[dev]]
            ready = [arrival.get((u, dev)) for u in g.predecessors(v)]
            if any(t is None for t in ready):
                return
            start[v] = max([free[dev], *ready])  # type: ignore[list-item]
            finish[v] = free[dev] = start[v] + problem.node_time(v, devices[dev])
            nxt[dev] += 1
            heapq.heappush(events, (finish[v], topo[v], v))

    for dev in order:
        try_start(dev)
    while events:
        t, _, u = heapq.heappop(events)
        src = device_of[u]
        arrival[(u, src)] = t
        touched = {src}
        for dst in sorted({device_of[w] for w in g.successors(u)} - {src}):
            dur = problem.link_time(u, devices[src], devices[dst])
            begin = max(t, out_port[src], in_port[dst]) if dur > 0 else t
            if dur > 0:
                out_port[src] = in_port[dst] = begin + dur
                moved.append(Transfer(u, src, dst, begin, begin + dur))
            arrival[(u, dst)] = begin + dur
            touched.add(dst)
        for dev in sorted(touched):
            try_start(dev)
    stuck = [order[d][nxt[d]] for d in order if nxt[d] < len(order[d])]
    if stuck:
        raise ValueError(f"the stage order deadlocks: nodes {stuck} wait for inputs that run later on their device")
    return Schedule(max(finish.values(), default=0.0), start, finish, device_of, order, moved)
