"""Local search that moves work off the bottleneck device of a non-contiguous max-load plan.

The DP is exact among contiguous splits, and a contiguous split can be far from the best split:
BERT's operator graphs tie the word embedding to the output projection, so the contiguous optimum
ships the embedding matrix from the first device to the last (48 s on BERT-12 against 50 s of
compute per layer) and that device becomes the bottleneck, while putting the projection next to the
embedding costs nothing to send. The max-load MILP finds such plans, but on 16 devices and 800
nodes not within a minute. This search finds them in a fraction of a second, and hands the MILP a
better incumbent.

**Moves.** Under the cost model (Tarnawski et al. 2020, App. C, Fig. 7, (18)-(21);
:func:`torchplace.costmodel.device_cost`) a device's load depends only on the node set it holds:
its compute, the tensors it receives from outside the set and the ones it sends out. Moving
nodes from device ``d`` to device ``e`` therefore changes the loads of ``d`` and ``e`` only, and
both are recomputed exactly. From the device with the largest load, the search tries

- each colocation unit (colocated nodes move together) to every device that can run it, and
- all of ``d``'s nodes to every other device (merging two devices' work: the tensors between
  them stop being sent, which a single unit's move may not reach when it is only the last of
  several that pays),

and takes the move whose worse side is least, if that is below the current largest load (the
other devices keep theirs, so the plan's max-load never rises; with ties at the top, the count of
devices at the largest load falls). It stops when no move helps, at ``time_limit``, or after
``max_moves``. Memory is checked per device as the cost model counts it; the result is validated
like every plan, and the plan given is returned when nothing better is found.

Only problems whose plans may be non-contiguous, whose objective is max-load and whose memory is
a sum over a device's nodes (no training pipeline, no Piper) are searched; others are returned
unchanged. This is a steepest-descent variant of the move-based partition refinement of
Fiduccia and Mattheyses (1982), with the max-load objective in place of the cut.
"""
from __future__ import annotations

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


def polish(problem: Problem, plan: Plan, *, time_limit: float | None = 1.0, max_moves: int = 1000) -> Plan:
    """``plan``, or a better non-contiguous plan found by moving work off its bottleneck device
    (module docstring).

    Args:
        problem: the problem ``plan`` solves; its plans must be allowed to be non-contiguous.
        plan: a valid plan for ``problem``.
        time_limit: seconds for the search (``None``: until no move helps).
        max_moves: the most moves made.

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
    devices = problem.cluster.devices
    index = {d.name: i for i, d in enumerate(devices)}
    held: list[set[str]] = [set() for _ in devices]
    for v, name in plan.assignment.items():
        held[index[name]].add(v)
    loads = [_load(problem, nodes, d) for nodes, d in zip(held, devices)]
    moves = 0
    while moves < max_moves and time.perf_counter() < deadline:
        top = max(loads)
        d = loads.index(top)
        move = _best_move(problem, units, held, loads, d, deadline)
        if move is None:
            break
        nodes, e, load_d, load_e = move
        held[d] -= nodes
        held[e] |= nodes
        loads[d], loads[e] = load_d, load_e
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


def _best_move(problem: Problem, units: Units, held: list[set[str]], loads: list[float], d: int,
               deadline: float) -> tuple[set[str], int, float, float] | None:
    """The move off device ``d`` whose worse side is least, if below ``loads[d]`` (module docstring):
    the nodes moved, the device they go to, and the two devices' new loads."""
    devices = problem.cluster.devices
    top = loads[d]
    best: tuple[set[str], int, float, float] | None = None
    best_worse = top

    def consider(nodes: set[str], e: int, load_d: float) -> None:
        nonlocal best, best_worse
        if load_d >= best_worse:
            return
        load_e = _load(problem, held[e] | nodes, devices[e])
        worse = max(load_d, load_e)
        if worse < top * (1 - _TIE) and worse < best_worse:
            best, best_worse = (set(nodes), e, load_d, load_e), worse

    seen: set[int] = set()
    for v in sorted(held[d]):
        u = units.of[v]
        if u in seen:
            continue
        seen.add(u)
        if time.perf_counter() > deadline:
            break
        nodes = set(units.members[u])
        rest_d = _load(problem, held[d] - nodes, devices[d])
        for e in range(len(devices)):
            if e != d and (u, e) in units.allowed:
                consider(nodes, e, rest_d)
    for e in range(len(devices)):
        if e != d and all((units.of[v], e) in units.allowed for v in held[d]):
            consider(set(held[d]), e, 0.0)
    return best


def _load(problem: Problem, nodes: Collection[str], device: Device) -> float:
    """The load of ``nodes`` on ``device``; ``inf`` if they do not fit its memory or cannot run there."""
    if not nodes:
        return 0.0
    cost = costmodel.device_cost(problem, nodes, device)
    if device.memory_bytes is not None and cost.memory > device.memory_bytes:
        return math.inf
    return cost.load
