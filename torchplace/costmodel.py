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
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torchplace.devices import Device
from torchplace.problem import Problem

__all__ = ["StageCost", "StageLike", "device_cost", "evaluate", "evaluate_stages", "memory", "transfers"]


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
    """Max device load of ``stages`` and the per-device breakdown (devices in first-use order)."""
    if problem.objective != "throughput":
        raise ValueError(
            f"objective {problem.objective!r} has no evaluator yet; use objective='throughput'"
        )
    costs = [
        device_cost(problem, set(nodes), problem.cluster.device(name))
        for name, nodes in _nodes_by_device(stages).items()
    ]
    return max((c.load for c in costs), default=0.0), costs


def evaluate(problem: Problem, plan: object) -> float:
    """The objective of a plan (anything with ``.stages``) under ``problem``'s cost model."""
    return evaluate_stages(problem, plan.stages)[0]  # type: ignore[attr-defined]
