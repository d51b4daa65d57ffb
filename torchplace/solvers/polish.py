"""Local search that moves work between devices of a non-contiguous max-load plan, never raising its max.

The DP is exact among contiguous splits, and a contiguous split can be far from the best split:
BERT's operator graphs tie the word embedding to the output projection, so the contiguous optimum
ships the embedding matrix from the first device to the last (48 s on BERT-12 against 50 s of
compute per layer) and that device becomes the bottleneck, while putting the projection next to the
embedding costs nothing to send. The max-load MILP finds such plans, but on 16 devices and 800
nodes not within a minute (BERT-12 on 8 devices: 105.6 after 5 minutes). This search finds them in
seconds (102.5), beside the MILP.

**Moves.** Under the cost model (Tarnawski et al. 2020, App. C, Fig. 7, (18)-(21);
:func:`torchplace.costmodel.device_cost`) a device's load depends only on the node set it holds:
its compute, plus each tensor whose hyperedge (producer and consumers) it holds some but not all
of, once. Moving nodes from device ``d`` to device ``e`` therefore changes the loads of ``d`` and
``e`` only. From a device ``d``, the search tries

- each *window*: up to :data:`WINDOW` colocation units that are consecutive among ``d``'s units
  in topological order (colocated nodes move together), to every device that can run them all. A
  layer's worth of operators moves at once, where moving its first operator alone would only add
  a transfer (BERT-12 on 8 devices: windows of one unit find nothing, windows find 108.0 -> 102.5);
- all of ``d``'s nodes to every other device (merging two devices' work: the tensors between them
  stop being sent),

and takes the move whose worse side is least, if that is below the larger of the two devices'
loads before it. The other devices keep theirs, so the plan's max-load never rises, and the loads
sorted in decreasing order fall lexicographically with every move (the count at the largest of
the two values falls), so the search ends. Devices are tried from the most loaded down, and the
first with such a move makes it: moves between devices below the bottleneck make room that a
later move off the bottleneck needs. Windows are priced incrementally from per-device counts of
each hyperedge's members (:class:`_Cuts`; a target is dropped once its compute alone reaches the
limit), and the best few of a device exactly (:func:`_load`, memory included) before one is made.
It stops when no move helps, at ``time_limit``, or after ``max_moves``. The result is validated
like every plan, and the plan given is returned when nothing better is found.

Only problems whose plans may be non-contiguous, whose objective is max-load and whose memory is
a sum over a device's nodes (no training pipeline, no Piper) are searched; others are returned
unchanged. This is a steepest-descent variant of the move-based partition refinement of
Fiduccia and Mattheyses (1982), with the max-load objective in place of the cut.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from torchplace import costmodel
from torchplace.devices import Device
from torchplace.errors import InfeasibleError, InvalidPlanError
from torchplace.plan import Plan
from torchplace.problem import Problem

if TYPE_CHECKING:
    from torchplace.solvers.milp.maxload import Units

__all__ = ["polish"]

_TIE = 1e-12  # relative: loads within it of the largest count as the largest
WINDOW = 48  # the most units, consecutive among a device's units in topological order, moved at once
_CHECKED = 8  # the best candidates of a device priced exactly (memory, rounding) before giving up on it


def polish(problem: Problem, plan: Plan, *, time_limit: float | None = 1.0, max_moves: int = 1000,
           window: int = WINDOW) -> Plan:
    """``plan``, or a better non-contiguous plan found by moving work between devices (module
    docstring).

    Args:
        problem: the problem ``plan`` solves; its plans must be allowed to be non-contiguous.
        plan: a valid plan for ``problem``.
        time_limit: seconds for the search (``None``: until no move helps).
        max_moves: the most moves made.
        window: the most units moved at once (1: single units, and whole devices).

    Returns:
        A valid plan whose objective is at most ``plan``'s (``plan`` itself when no move helps or
        the problem is not one the search handles).
    """
    from torchplace.solvers.milp.contiguity import stages_from_assignment
    from torchplace.solvers.milp.maxload import assignment_units
    from torchplace.solvers.pipelined import training_pipeline

    if (problem.contiguous or problem.objective == "latency" or problem.parallel is not None
            or training_pipeline(problem) is not None or len(problem.cluster) < 2):
        return plan
    start = time.perf_counter()
    deadline = math.inf if time_limit is None else start + time_limit
    try:
        units = assignment_units(problem)
    except InfeasibleError:
        return plan
    if 2 * (time.perf_counter() - start) >= deadline - start:  # no time left to search and build a plan
        return plan
    devices = problem.cluster.devices
    index = {d.name: i for i, d in enumerate(devices)}
    held: list[set[str]] = [set() for _ in devices]
    for v, name in plan.assignment.items():
        held[index[name]].add(v)
    loads = [_load(problem, nodes, d) for nodes, d in zip(held, devices)]
    compute = [math.fsum(units.time[u][i] for u in {units.of[v] for v in nodes}) for i, nodes in enumerate(held)]
    cuts = _Cuts(problem, held)
    # Building the plan at the end walks the whole graph again, as this set-up did: keep as long for it.
    deadline -= time.perf_counter() - start
    moves = 0
    while moves < max_moves and time.perf_counter() < deadline:
        move = None
        for d in sorted(range(len(devices)), key=lambda i: -loads[i]):
            move = _best_move(problem, units, cuts, held, loads, compute, d, window, deadline)
            if move is not None or time.perf_counter() > deadline:
                break
        if move is None:
            break
        nodes, d, e, load_d, load_e = move
        held[d] -= nodes
        held[e] |= nodes
        cuts.move(nodes, d, e)
        loads[d], loads[e] = load_d, load_e
        moved = {units.of[v] for v in nodes}
        compute[d] -= math.fsum(units.time[u][d] for u in moved)
        compute[e] += math.fsum(units.time[u][e] for u in moved)
        moves += 1
    if moves == 0:
        return plan
    assignment = {v: devices[i].name for i, nodes in enumerate(held) for v in nodes}
    try:
        better = Plan.build(problem, stages_from_assignment(problem, assignment), solver=f"{plan.solver}+polish",
                            seconds=plan.seconds + time.perf_counter() - start, lower_bound=plan.lower_bound,
                            status="feasible", meta={**plan.meta, "contiguous": False, "polish_moves": moves})
    except InvalidPlanError:  # the per-device memory check missed something the plan's validation sees
        return plan
    return better if better.objective < plan.objective else plan


class _Cuts:
    """How many members of each costly tensor's hyperedge (its producer and consumers) each device
    holds: a device pays tensor ``p`` exactly when it holds some but not all of them, so the load
    change of adding or removing a node is read off the counts of the hyperedges it is in."""

    def __init__(self, problem: Problem, held: list[set[str]]):
        g = problem.graph.nx
        self.cost = {p: problem.transfer_time(p) for p in g if g.out_degree(p) and problem.transfer_time(p) > 0}
        self.size = {p: 1 + len(set(g.successors(p))) for p in self.cost}
        self.edges = {v: [p for p in (v, *g.predecessors(v)) if p in self.cost] for v in g}
        self.count: list[dict[str, int]] = [{} for _ in held]
        for count, nodes in zip(self.count, held):
            for v in nodes:
                for p in self.edges[v]:
                    count[p] = count.get(p, 0) + 1

    def delta(self, v: str, count: dict[str, int], changed: dict[str, int], step: int) -> float:
        """Transfer seconds a device gains when ``v`` joins (``step=1``) or leaves (``-1``) it;
        ``changed`` holds the counts already changed by the nodes of the same move, and is updated."""
        out = 0.0
        for p in self.edges[v]:
            old = changed[p] if p in changed else count.get(p, 0)
            new = old + step
            changed[p] = new
            size = self.size[p]
            out += self.cost[p] * ((0 < new < size) - (0 < old < size))
        return out

    def merged(self, d: int, e: int) -> float:
        """Transfer seconds of one device holding what ``d`` and ``e`` hold."""
        both = self.count[d].keys() | self.count[e].keys()
        return math.fsum(self.cost[p] for p in both
                         if self.count[d].get(p, 0) + self.count[e].get(p, 0) < self.size[p])

    def move(self, nodes: Collection[str], d: int, e: int) -> None:
        """Count ``nodes`` on device ``e`` instead of ``d``."""
        for v in nodes:
            for p in self.edges[v]:
                self.count[e][p] = self.count[e].get(p, 0) + 1
                self.count[d][p] -= 1
                if not self.count[d][p]:
                    del self.count[d][p]


def _best_move(problem: Problem, units: Units, cuts: _Cuts, held: list[set[str]], loads: list[float],
               compute: list[float], d: int, window: int,
               deadline: float) -> tuple[set[str], int, int, float, float] | None:
    """The move off device ``d`` whose worse side is least, if below the larger of the two devices'
    loads (module docstring): the nodes moved, from ``d`` to which device, and the two new loads.
    Candidates are priced incrementally (:class:`_Cuts`), the best ones then exactly."""
    devices = problem.cluster.devices
    pays = [x.pays_transfer for x in devices]
    candidates: list[tuple[float, float, int, int, int]] = []  # (worse, sum, first, last, e) over d's units
    mine = sorted({units.of[v] for v in held[d]})
    others = [e for e in range(len(devices)) if e != d]
    limit = {e: max(loads[d], loads[e]) * (1 - _TIE) for e in others}  # a move's worse side must stay below
    for i in range(len(mine)):
        if time.perf_counter() > deadline:
            break
        load_d, changed_d = loads[d], {}
        load_e = {e: loads[e] for e in others}
        work_e = {e: compute[e] for e in others}  # e's load once its transfers all vanished
        changed_e: dict[int, dict[str, int]] = {e: {} for e in others}
        for j in range(i, min(len(mine), i + window)):
            u = mine[j]
            load_d -= units.time[u][d]
            for e in list(load_e):
                work_e[e] += units.time[u][e]
                if (u, e) not in units.allowed or work_e[e] >= limit[e]:
                    del load_e[e]  # neither this window nor a longer one from i can go to e
                else:
                    load_e[e] += units.time[u][e]
            if not load_e:
                break
            for v in units.members[u]:
                if pays[d]:
                    load_d += cuts.delta(v, cuts.count[d], changed_d, -1)
                for e in load_e:
                    if pays[e]:
                        load_e[e] += cuts.delta(v, cuts.count[e], changed_e[e], 1)
            for e, new_e in load_e.items():
                worse = max(load_d, new_e)
                if worse < limit[e]:
                    candidates.append((worse, load_d + new_e, i, j, e))
    for e in others:  # all of d: the tensors between d and e stop being sent
        if all((u, e) in units.allowed for u in mine):
            merged = compute[e] + math.fsum(units.time[u][e] for u in mine) + (cuts.merged(d, e) if pays[e] else 0.0)
            if merged < limit[e]:
                candidates.append((merged, merged, 0, len(mine) - 1, e))
    for _, _, i, j, e in heapq.nsmallest(_CHECKED, candidates):
        if time.perf_counter() > deadline:
            break
        nodes = {v for u in mine[i:j + 1] for v in units.members[u]}
        exact_d = _load(problem, held[d] - nodes, devices[d])
        exact_e = _load(problem, held[e] | nodes, devices[e])
        if max(exact_d, exact_e) < limit[e]:
            return nodes, d, e, exact_d, exact_e
    return None


def _load(problem: Problem, nodes: Collection[str], device: Device) -> float:
    """The load of ``nodes`` on ``device``; ``inf`` if they do not fit its memory or cannot run there."""
    if not nodes:
        return 0.0
    cost = costmodel.device_cost(problem, nodes, device)
    if device.memory_bytes is not None and cost.memory > device.memory_bytes:
        return math.inf
    return cost.load
