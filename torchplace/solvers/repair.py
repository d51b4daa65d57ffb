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
import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence

from torchplace import costmodel
from torchplace.errors import InvalidPlanError
from torchplace.plan import Plan, Stage, check_contiguity
from torchplace.problem import Problem

__all__ = ["RENAME_LIMIT", "renamed", "repair"]

RENAME_LIMIT = 64
"""The most ways of putting a plan's pieces on other devices tried for one plan."""

_TIES = 4  # renamings of equal least overflow priced for their objective, per split


@dataclasses.dataclass(frozen=True)
class _Priced:
    overflow: int  # bytes over the devices' limits, summed
    objective: float
    stages: list[Stage]


def renamed(problem: Problem, stages: Sequence[Stage]) -> list[tuple[int, list[Stage]]]:
    """``stages`` with their devices renamed, each with its overflow (bytes over the devices'
    limits, summed), least first: each device's piece on another device (or its own), each device
    one piece, ``stages`` themselves not among them. The pieces are tried first on the devices
    where they overflow least, and at most :data:`RENAME_LIMIT` renamings are made."""
    need = costmodel.memory_elsewhere(problem, stages)
    pieces = list(dict.fromkeys(s.device for s in stages))
    devices = problem.cluster.devices
    over = {(p, d.name): 0 if d.memory_bytes is None else max(need(p, d) - d.memory_bytes, 0)
            for p in pieces for d in devices}
    choices = [sorted((d.name for d in devices), key=lambda name: over[p, name]) for p in pieces]
    out = []
    for names in itertools.islice(_injections(choices), RENAME_LIMIT):
        rename = dict(zip(pieces, names))
        if any(p != n for p, n in rename.items()):
            out.append((sum(over[p, n] for p, n in rename.items()),
                        [dataclasses.replace(s, device=rename[s.device]) for s in stages]))
    return sorted(out, key=lambda item: item[0])


def _injections(choices: Sequence[Sequence[str]], taken: frozenset[str] = frozenset()) -> Iterator[tuple[str, ...]]:
    """Every tuple with one distinct item of each ``choices[i]`` (none in ``taken``), in order."""
    if not choices:
        yield ()
        return
    for name in choices[0]:
        if name not in taken:
            for rest in _injections(choices[1:], taken | {name}):
                yield (name, *rest)


def repair(problem: Problem, plan: Plan, *, deadline: float = math.inf) -> list[Stage] | None:
    """The stages of a plan that fits ``problem``'s memory, found from ``plan`` (module docstring),
    or ``None`` if none is found by ``deadline`` (a :func:`time.perf_counter` value).

    Devices that recompute in ``plan`` keep recomputing (under their new names). The stages are
    not yet validated as a plan: the caller builds it on the true problem.
    """
    from torchplace.solvers.milp.contiguity import stages_from_assignment

    g = problem.graph
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
    recompute = {s.device for s in plan.stages if s.recompute}

    def priced(stages: list[Stage]) -> _Priced:
        objective, costs = costmodel.evaluate_stages(problem, stages)
        over = sum(max(c.memory - cap, 0) for c in costs if (cap := caps[c.device]) is not None)
        return _Priced(over, objective, stages)

    def best_named(stages: list[Stage]) -> _Priced:
        """``stages`` on the devices where they overflow least (ties: the least objective)."""
        first = priced(stages)
        if not first.overflow:
            return first
        others = renamed(problem, stages)
        least = [s for over, s in others if over == others[0][0] < first.overflow] if others else []
        options = [first, *(p for s in least[:_TIES] if math.isfinite((p := priced(s)).objective))]
        return min(options, key=lambda p: (p.overflow, p.objective))

    current = best_named(list(plan.stages))
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
        _, costs = costmodel.evaluate_stages(problem, current.stages)
        full = {c.device for c in costs if (cap := caps[c.device]) is not None and c.memory > cap}
        best: tuple[tuple[bool, float, int], _Priced] | None = None
        for sources in (full, set(caps) - full):  # off the full devices; where that finds none, off any
            for members in units.values():
                here = assignment[members[0]]
                if here not in sources:
                    continue
                near = {assignment[w] for v in members for w in (*g.predecessors(v), *g.successors(v))} - {here}
                for there in sorted(near) + unused:
                    moved = {**assignment, **dict.fromkeys(members, there)}
                    if problem.contiguous and not _contiguous(problem, moved):
                        continue
                    out = best_named([Stage(s.device, s.nodes, recompute=s.device in recompute)
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
