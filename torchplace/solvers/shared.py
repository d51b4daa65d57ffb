"""Solving a problem whose graph has shared tensors (tied weights, a module called twice).

A tensor that several nodes read is held once by every device that runs one of them
(:func:`torchplace.costmodel.memory`). That memory is not a sum over nodes, which every solver
assumes, so a problem with shared tensors is solved through problems that are:

1. the *relaxation*: each shared tensor counted once, on its owner. It never charges more than
   the true memory, so its lower bound holds for the true problem, and when its plan also fits
   the true memory that plan is optimal for the true problem too (the usual case: memory is not
   what binds);
2. otherwise two restrictions, whose plans always fit the true memory: *colocated* (a shared
   tensor's readers share a device, so it is held once: exact) and *replicated* (every reader
   pays for the tensor: a device never holds more than it is charged for). The better plan is
   kept, with the relaxation's bound;
3. when neither fits, a third restriction, *grouped*: the readers other than the owner share a
   device and pay for one copy there (what that device holds, or more when the owner is there
   too). It finds the plans that keep the owner apart from its other readers, which neither
   restriction above allows when the readers are too big for the owner's device and too many
   to each pay a copy.

Every returned plan is evaluated and validated on the true problem. Under a training
:class:`~torchplace.problem.Pipeline` a variant's plan is taken to the true problem with each
device recomputing exactly when keeping its activations (and now its copies) does not fit
(:func:`torchplace.solvers.pipelined.fit`); a plan that had to start recomputing there keeps no
claim of optimality.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import networkx as nx

from torchplace import costmodel
from torchplace.errors import InfeasibleError, InvalidPlanError, SolverLimitError
from torchplace.graph import OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.pipelined import fit, training_pipeline

__all__ = ["colocated", "grouped", "relaxed", "replicated", "solve_shared"]

Solve = Callable[..., Plan]


def _copy(graph: OpGraph, records: dict[str, Any]) -> OpGraph:
    """``graph`` without its shared tensors (each in its owner's bytes only), ``records`` replaced."""
    return graph.with_records(lambda v, r: records.get(v, r), meta={k: v for k, v in graph.meta.items() if k != "state"})


def relaxed(problem: Problem) -> Problem:
    """Each shared tensor on its owner only (memory never above the truth)."""
    return dataclasses.replace(problem, graph=_copy(problem.graph, {}))


def replicated(problem: Problem) -> Problem:
    """Every reader of a shared tensor pays for it (memory never below the truth): for its copy, and
    in training for the copy's gradient when the tensor is trainable (:func:`torchplace.costmodel.copy_bytes`)."""
    g = problem.graph
    extra: dict[str, int] = {}
    for t in g.shared_tensors():
        copy = sum(costmodel.copy_bytes(problem, t))
        for v in t.readers - {t.owner}:
            extra[v] = extra.get(v, 0) + copy
    records = {v: dataclasses.replace(g.record(v), param_bytes=g.record(v).param_bytes + b) for v, b in extra.items()}
    return dataclasses.replace(problem, graph=_copy(g, records))


def colocated(problem: Problem) -> Problem:
    """The readers of each shared tensor share a device with its owner (memory exact)."""
    return dataclasses.replace(problem, graph=_copy(problem.graph, _together(
        problem.graph, [t.readers | {t.owner} for t in problem.graph.shared_tensors()])))


def grouped(problem: Problem) -> Problem:
    """The readers of each shared tensor other than its owner share a device, and the first of them
    pays for one copy there (memory never below the truth: a device holding a reader and not the
    owner holds the whole group, which paid)."""
    g = problem.graph
    groups = [t.readers - {t.owner} for t in g.shared_tensors()]
    records = _together(g, groups)
    for t, group in zip(g.shared_tensors(), groups):
        payer = min(group)
        r = records.get(payer, g.record(payer))
        records[payer] = dataclasses.replace(r, param_bytes=r.param_bytes + sum(costmodel.copy_bytes(problem, t)))
    return dataclasses.replace(problem, graph=_copy(g, records))


def _together(g: OpGraph, groups: list[frozenset[str] | set[str]]) -> dict[str, Any]:
    """Records whose colocation keeps each group on one device (with the colocation classes they meet)."""
    links = nx.Graph()
    for group in groups:
        members = sorted(group)
        links.add_nodes_from(members)
        links.add_edges_from(zip(members, members[1:]))
    by_label: dict[str, list[str]] = {}
    for v, r in g.records():  # existing colocation classes stay together and join the new ones
        if r.colocation is not None:
            by_label.setdefault(r.colocation, []).append(v)
    for members in by_label.values():
        links.add_edges_from(zip(members, members[1:]))
    records = {}
    for comp in nx.connected_components(links):
        label = "shared:" + min(comp)
        records.update({v: dataclasses.replace(g.record(v), colocation=label) for v in comp})
    return records


def _on_truth(problem: Problem, plan: Plan, lower_bound: float, status: str) -> Plan:
    stages = plan.stages
    if training_pipeline(problem) is not None:
        stages = fit(problem, plan.stages) or plan.stages  # (a plan that does not fit raises below)
        if status == "optimal" and any(a.recompute != b.recompute for a, b in zip(stages, plan.stages)):
            status = "feasible"  # recomputing for the copies added load the variant did not count
    return Plan.build(problem, stages, solver=plan.solver, seconds=plan.seconds, lower_bound=lower_bound,
                      status=status, meta=plan.meta)


def solve_shared(problem: Problem, solve: Solve, time_limit: float | None, **opts: Any) -> Plan:
    """Solve ``problem`` with ``solve(problem, time_limit=..., **opts)`` as the module docstring says.

    Raises:
        InfeasibleError: if the relaxation is infeasible (so is the problem), or if no
            restriction has a plan that fits (then a plan that splits a tensor's readers other
            than its owner over several devices may still exist: the message says so).
    """
    start = time.perf_counter()
    share = None if time_limit is None else time_limit / 2
    first = solve(relaxed(problem), time_limit=share, **opts)
    found: list[Plan] = []
    try:
        truth = _on_truth(problem, first, first.lower_bound, first.status)
        if [s.recompute for s in truth.stages] == [s.recompute for s in first.stages]:
            return truth  # its load is the relaxation's: its proof carries over
        found.append(truth)  # it fits only by recomputing more: the restrictions may do better
    except InvalidPlanError:
        pass  # the relaxation's plan needs more memory for the copies than a device has
    left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.0) / 2
    errors: list[Exception] = []
    for variant in (colocated, replicated):
        try:
            found.append(solve(variant(problem), time_limit=left, **opts))
        except InfeasibleError as e:
            errors.append(e)
    if not found:
        left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 1e-3)
        try:
            found.append(solve(grouped(problem), time_limit=left, **opts))
        except (InfeasibleError, SolverLimitError) as e:
            errors.append(e)
    if not found:
        names = ", ".join(t.name for t in problem.graph.shared_tensors())
        raise InfeasibleError(
            f"found no plan that fits memory with the copies of the shared tensors ({names}): the best plan "
            f"without copies does not fit with them, and neither keeping each tensor's readers on one device, "
            f"nor its other readers on one device, nor charging every reader a copy fits ({errors[0]}); a plan "
            f"that splits a tensor's other readers is not searched and may fit: allow more memory (max_memory) "
            f"or add a device"
        ) from errors[0]
    best = min(found, key=lambda p: p.objective)  # (ties: the relaxation's, already on the truth)
    status = "optimal" if best.objective <= first.lower_bound * (1 + 1e-9) else "feasible"
    return _on_truth(problem, best, first.lower_bound, status)
