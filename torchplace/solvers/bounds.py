"""Combinatorial lower bounds on the optimal max-load (valid for any split, contiguous or not)."""
from __future__ import annotations

import math
from collections import defaultdict

from torchplace.problem import Problem

__all__ = ["simple_lower_bound"]


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
