"""Combinatorial lower bounds: on the optimal max-load and on the optimal latency (any split)."""
from __future__ import annotations

import math
from collections import defaultdict

from torchplace.graph import NodeRecord
from torchplace.problem import Problem

__all__ = ["combinatorial_lower_bound", "integral_objective", "latency_lower_bound", "round_up_bound", "simple_lower_bound"]


def simple_lower_bound(problem: Problem) -> float:
    """Archer et al. 2024, Lemma 3.3, for devices of several kinds: ``max(max work, total work / n)``.

    The work of a colocation group is its cheapest time over the device kinds that can run all of
    it; every device's load is at least the work placed on it (transfers only add), so the max load
    is at least the largest group's work and at least the total work divided by the device count.
    """
    kinds = {d.kind for d in problem.cluster.devices}
    groups: dict[str | None, list[NodeRecord]] = defaultdict(list)  # colocation group -> records
    work = []  # (records are read once: this runs on graphs of 10^5 nodes within a time limit)
    for _, r in problem.graph.records():
        if r.colocation is None:
            work.append(min(r.time_on(k) for k in kinds))
        else:
            groups[r.colocation].append(r)
    work += [min(math.fsum(r.time_on(k) for r in members) for k in kinds) for members in groups.values()]
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


def combinatorial_lower_bound(problem: Problem, time_limit: float | None = 5.0) -> float:
    """The combinatorial bound for ``problem``'s objective: the latency bound, or for max-load the
    better of the simple bound and the cut bound (:mod:`torchplace.solvers.cut_bound`, whose exact
    cuts take at most ``time_limit`` seconds)."""
    if problem.objective == "latency":
        return latency_lower_bound(problem)
    from torchplace.solvers.cut_bound import cut_lower_bound

    return max(simple_lower_bound(problem), cut_lower_bound(problem, time_limit))


def _integer(x: float) -> bool:
    return math.isinf(x) or float(x).is_integer()


def integral_objective(problem: Problem) -> bool:
    """Whether every plan's objective is an integer: all the durations the cost model adds are.

    Node times, per-side transfer times and per-pair link times must be integers (or ``inf``),
    and no output may be priced by the cluster's links (a node with successors and output bytes
    but neither ``transfer_time`` nor ``link_times``). Max-load is then a sum of integers, and the
    simulated makespan a max of sums of integers.
    """
    g = problem.graph
    for v, r in g.records():
        if not all(_integer(t) for t in r.times.values()) or not all(_integer(t) for t in r.link_times.values()):
            return False
        if r.transfer_time is not None:
            if not _integer(r.transfer_time):
                return False
        elif r.output_bytes > 0 and next(iter(g.successors(v)), None) is not None:
            return False
    return True


def round_up_bound(problem: Problem, bound: float) -> float:
    """``bound`` rounded up to an integer when every objective is an integer (:func:`integral_objective`).

    A MILP's bound carries the solver's feasibility tolerance (29.9999991 for a proven 30); every
    plan's objective is an integer at least ``bound``, hence at least ``ceil(bound - 1e-6)``. The
    1e-6 keeps a bound that is itself an integer plus round-off from jumping to the next integer.
    """
    if math.isfinite(bound) and integral_objective(problem):
        return float(math.ceil(bound - 1e-6))
    return bound
