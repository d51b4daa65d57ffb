"""Making a plan that overfills devices fit, its memory counted as it runs (liveness).

The solvers behind :mod:`torchplace.solvers.liveness` count a device's working memory from below
(the relaxation: parameters only) or from above (room reserved, or every activation alive at
once). The relaxation's plan that overfills a device is often close to one that fits:

- its pieces may fit on each other's devices: devices that differ only in their memory are
  alike to the relaxation, which may put the larger piece on the smaller device (seen on a small
  CNN over two logical CPUs capped at its own uncapped plan's memory);
- or a unit or two from one that fits: profiled again, the same CNN's optimal cut moved three
  layers later, where the activations are larger, and its first device then needed 398 kB of
  its 298 kB. Counted from above, the restriction found no split at all.

:func:`repair` first tries the plan's pieces on other devices (each piece on a device, each device
one piece). Failing that, it walks from the plan to one that fits, each step priced on the true
problem: it moves one colocation unit (a node, or the nodes that must share a device, backward
nodes with their forward node) off a device over its limit (where no such move helps, off any
device) to a device that holds one of its graph neighbours or to an unused device, the pieces then
on the devices where they overflow least. Of the moves after which the
plan is still a valid split (contiguous where the problem asks it), it takes the one that lowers
the total overflow (the bytes over the limits, summed over devices) with the least objective
(ties: the least overflow), or where none lowers it, the one that keeps it with the least
objective among splits not yet visited (a chain's activations may fit only two layers on, past a
layer that needs as much). The walk ends with a plan that fits, or with none where no move keeps
the overflow, at the deadline, or after four steps per unit.
It is a descent in the spirit of the move-based partition refinement of Fiduccia and
Mattheyses (1982), with the overflow in place of the cut.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Mapping, Sequence

from torchplace import costmodel
from torchplace.errors import InvalidPlanError
from torchplace.plan import Plan, Stage, check_contiguity
from torchplace.problem import Problem

__all__ = ["RENAME_LIMIT", "Priced", "least_overflow", "priced", "renamed", "repair"]

RENAME_LIMIT = 64
"""The most ways of putting a plan's pieces on other devices listed for one plan."""

_TIES = 4  # renamings of equal least overflow priced for their objective, per split
_MOST_POPS = 20_000  # partial renamings the best-first search takes from its heap, at most


@dataclasses.dataclass(frozen=True)
class Priced:
    """A plan's stages with their objective, overflow (bytes over the devices' limits, summed) and
    the devices over their limits."""

    overflow: int
    objective: float
    stages: list[Stage]
    full: frozenset[str] = frozenset()


def priced(problem: Problem, stages: Sequence[Stage]) -> Priced:
    """``stages`` priced on ``problem`` (the cost model's objective and memory)."""
    objective, costs = costmodel.evaluate_stages(problem, stages)
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
    over = {c.device: c.memory - cap for c in costs if (cap := caps[c.device]) is not None and c.memory > cap}
    return Priced(sum(over.values()), objective, list(stages), frozenset(over))


def least_overflow(problem: Problem, stages: Sequence[Stage]) -> Priced:
    """``stages`` as they are, or renamed (:func:`renamed`) where that overflows less: the least
    overflow, and among up to four renamings of equal overflow the least objective."""
    here = priced(problem, stages)
    if not here.overflow:
        return here
    others = renamed(problem, stages)
    least = [s for over, s in others if over == others[0][0] < here.overflow] if others else []
    options = [here, *(p for s in least[:_TIES] if math.isfinite((p := priced(problem, s)).objective))]
    return min(options, key=lambda p: (p.overflow, p.objective))


def renamed(problem: Problem, stages: Sequence[Stage]) -> list[tuple[int, list[Stage]]]:
    """``stages`` with their devices renamed, each with its overflow, least first: each device's
    piece on another device (or its own) that can run all of it, each device one piece, ``stages``
    themselves not among them; the :data:`RENAME_LIMIT` with the least overflow (a best-first
    search over the pieces' devices, a piece's overflow on a device being what its memory there,
    the plan's micro-batches in flight kept, exceeds the device's limit)."""
    need = costmodel.memory_elsewhere(problem, stages)
    pieces = list(dict.fromkeys(s.device for s in stages))
    nodes = {p: [v for s in stages if s.device == p for v in s.nodes] for p in pieces}
    cost = [{d.name: 0 if d.memory_bytes is None else max(need(p, d) - d.memory_bytes, 0)
             for d in problem.cluster.devices if not any(math.isinf(problem.node_time(v, d)) for v in nodes[p])}
            for p in pieces]
    out = []
    for total, names in _cheapest_injections(cost, RENAME_LIMIT + 1):
        if names != tuple(pieces):
            rename = dict(zip(pieces, names))
            out.append((total, [dataclasses.replace(s, device=rename[s.device]) for s in stages]))
    return out[:RENAME_LIMIT]


def _cheapest_injections(cost: Sequence[Mapping[str, int]], limit: int) -> list[tuple[int, tuple[str, ...]]]:
    """Up to ``limit`` tuples with one distinct key of each ``cost[i]``, by least total cost: a
    best-first search whose bound adds each unplaced position's cheapest key (never more than the
    truth, so complete tuples come out in order); among equal bounds the deepest goes first."""
    rest = [0] * (len(cost) + 1)
    for i in reversed(range(len(cost))):
        if not cost[i]:
            return []
        rest[i] = rest[i + 1] + min(cost[i].values())
    heap: list[tuple[int, int, int, tuple[str, ...]]] = [(rest[0], 0, 0, ())]
    count, out = itertools.count(1), []
    for _ in range(_MOST_POPS):
        if not heap or len(out) >= limit:
            break
        bound, _, _, partial = heapq.heappop(heap)
        i = len(partial)
        if i == len(cost):
            out.append((bound, partial))
            continue
        so_far = bound - rest[i]
        for name, c in cost[i].items():
            if name not in partial:
                heapq.heappush(heap, (so_far + c + rest[i + 1], -(i + 1), next(count), (*partial, name)))
    return out


def repair(problem: Problem, plan: Plan, *, deadline: float = math.inf) -> list[Stage] | None:
    """The stages of a plan that fits ``problem``'s memory, found from ``plan`` (module docstring),
    or ``None`` if none is found by ``deadline`` (a :func:`time.perf_counter` value).

    Devices that recompute in ``plan`` keep recomputing (under their new names). The stages are
    not yet validated as a plan: the caller builds it on the true problem.
    """
    from torchplace.solvers.milp.contiguity import stages_from_assignment

    g = problem.graph
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
    current = least_overflow(problem, plan.stages)
    units: dict[str, list[str]] = {}
    for v in g.topological_order():
        key = g.record(v).colocation
        units.setdefault(f"c:{key}" if key is not None else f"n:{v}", []).append(v)
    seen = {_pieces(current.stages)}
    for _ in range(4 * len(units) + 4):
        if current.overflow == 0:
            return current.stages
        assignment = {v: s.device for s in current.stages for v in s.nodes}
        recompute = {s.device for s in current.stages if s.recompute}
        unused = [d for d in caps if d not in set(assignment.values())]
        best: tuple[tuple[bool, float, int], Priced] | None = None
        for sources in (current.full, caps.keys() - current.full):  # off the full devices; where none helps, any
            for members in units.values():
                here = assignment[members[0]]
                if here not in sources:
                    continue
                near = {assignment[w] for v in members for w in (*g.predecessors(v), *g.successors(v))} - {here}
                for there in sorted(near) + unused:
                    moved = {**assignment, **dict.fromkeys(members, there)}
                    if problem.contiguous and not _contiguous(problem, moved):
                        continue
                    out = least_overflow(problem, [Stage(s.device, s.nodes, recompute=s.device in recompute)
                                                   for s in stages_from_assignment(problem, moved)])
                    if out.overflow > current.overflow or not math.isfinite(out.objective):
                        continue
                    rank = (out.overflow == current.overflow, out.objective, out.overflow)  # lower, then level
                    if (best is None or rank < best[0]) and (rank[0] is False or _pieces(out.stages) not in seen):
                        best = (rank, out)
                if time.perf_counter() > deadline:
                    return None
            if best is not None:
                break
        if best is None:
            return None
        current = best[1]
        seen.add(_pieces(current.stages))
    return current.stages if current.overflow == 0 else None


def _pieces(stages: Sequence[Stage]) -> frozenset[frozenset[str]]:
    """The plan's split, whatever devices run its pieces."""
    by_device: dict[str, set[str]] = {}
    for s in stages:
        by_device.setdefault(s.device, set()).update(s.nodes)
    return frozenset(frozenset(nodes) for nodes in by_device.values())


def _contiguous(problem: Problem, assignment: Mapping[str, str]) -> bool:
    per_device: dict[str, list[str]] = {}
    for v, d in assignment.items():
        per_device.setdefault(d, []).append(v)
    try:
        check_contiguity(problem, per_device)
    except InvalidPlanError:
        return False
    return True
