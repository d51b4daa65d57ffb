"""Combinatorial lower bounds: on the optimal max-load and on the optimal latency (any split)."""
from __future__ import annotations

import math
from collections import defaultdict

from torchplace.problem import Problem

__all__ = ["combinatorial_lower_bound", "latency_lower_bound", "simple_lower_bound"]


def simple_lower_bound(problem: Problem) -> float:
    """Archer et al. 2024, Lemma 3.3, for devices of several kinds: ``max(max work, total work / n)``.

    The work of a colocation group is its cheapest time over the device kinds that can run all of
    it; every device's load is at least the work placed on it (transfers only add), so the max load
    is at least the largest group's work and at least the total work divided by the device count.
    """
    kinds = {d.kind for d in problem.cluster.devices}
    groups: dict[str, list[str]] = defaultdict(list)
    for v, r in problem.graph.records():
        groups[f"c:{r.colocation}" if r.colocation is not None else f"n:{v}"].append(v)
    work = [
        min(math.fsum(problem.graph.record(v).time_on(k) for v in members) for k in kinds)
        for members in groups.values()
    ]
    if not work:
        return 0.0
    return max(max(work), math.fsum(work) / len(problem.cluster))


def latency_lower_bound(problem: Problem) -> float:
    """A proven lower bound on the simulated latency (:func:`costmodel.simulate`) of any plan.

    ``max(critical path, total work / number of devices)`` where each node takes its least time
    over the device kinds present in the cluster, and transfers are ignored. Proof: in the
    simulation a node runs for its time on its device (at least that least time) and starts only
    after each input's producer has finished (a transfer only adds), so the finish of the last
    node of any path is at least the sum of the path's least times; and each device runs one node
    at a time, so the ``n`` devices are busy at most ``n * makespan`` in total, which is at least
    the sum of all least times. Holds for contiguous and non-contiguous plans alike; ``inf`` when
    some node can run on no device (then no plan exists).
    """
    kinds = {d.kind for d in problem.cluster.devices}
    g = problem.graph
    least = {v: min(r.time_on(k) for k in kinds) for v, r in g.records()}
    finish: dict[str, float] = {}
    for v in g.topological_order():
        finish[v] = least[v] + max((finish[u] for u in g.predecessors(v)), default=0.0)
    path = max(finish.values(), default=0.0)
    return max(path, math.fsum(least.values()) / len(problem.cluster))


def combinatorial_lower_bound(problem: Problem) -> float:
    """The combinatorial bound for ``problem``'s objective (max-load or latency)."""
    return latency_lower_bound(problem) if problem.objective == "latency" else simple_lower_bound(problem)
