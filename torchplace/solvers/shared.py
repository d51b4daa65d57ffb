"""Solving a problem whose graph has shared tensors (tied weights, a module called twice).

A tensor that several nodes read is held once by every device that runs one of them
(:func:`torchplace.costmodel.memory`). That memory is not a sum over nodes, which every solver
assumes, so a problem with shared tensors is solved through problems that are:

1. the *relaxation*: each shared tensor counted once, on its owner. It never charges more than
   the true memory, so its lower bound holds for the true problem, and when its plan also fits
   the true memory that plan is optimal for the true problem too (the usual case: memory is not
   what binds);
2. otherwise restrictions, whose plans always fit the true memory: *colocated* (a shared
   tensor's readers share a device with its owner, so it is held once: exact) and *replicated*
   (every reader pays for the tensor: a device never holds more than it is charged for). The
   better plan is kept, with the relaxation's bound;
3. if neither fits, the groupings between them: one restriction per way of grouping each shared
   tensor's nodes (owner and readers) into blocks that share a device, a block without the owner
   paying one copy (on one of its members). A plan whose devices group the nodes so is charged
   exactly, any other never less than it holds; every plan groups them some way, so none fitting
   proves that nothing fits (for an exact method). Past :data:`MAX_GROUPINGS` groupings (set
   partitions: 5 for three nodes, 15 for four) only one is: each tensor's readers other than its
   owner on one device, paying one copy (:func:`readers_apart`), and the error says that a plan
   may still fit. (With two nodes per tensor and one tensor, the extremes are all there is.)

Every returned plan is evaluated and validated on the true problem. Under a training
:class:`~torchplace.problem.Pipeline` a variant's plan is taken to the true problem with each
device recomputing exactly when keeping its activations (and now its copies) does not fit
(:func:`torchplace.solvers.pipelined.fit`); a plan that had to start recomputing there keeps no
claim of optimality.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import networkx as nx

from torchplace import costmodel
from torchplace.errors import InfeasibleError, InvalidPlanError
from torchplace.graph import OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.limits import stop_if_interrupted
from torchplace.solvers.pipelined import fit, training_pipeline
from torchplace.solvers.stand_in import on_true_problem

__all__ = ["MAX_GROUPINGS", "colocated", "grouped", "groupings", "readers_apart", "relaxed", "replicated",
           "solve_shared"]

Solve = Callable[..., Plan]

MAX_GROUPINGS = 16
"""Most groupings of the shared tensors' nodes (:func:`groupings`) :func:`solve_shared` tries where
neither :func:`colocated` nor :func:`replicated` fits; beyond it, none."""


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
    g = problem.graph
    links = nx.Graph()
    for t in g.shared_tensors():
        members = sorted(t.readers | {t.owner})
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
    return dataclasses.replace(problem, graph=_copy(g, records))


def _partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every set partition of ``items`` (blocks in order of their first item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first], *part]
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1:]]


def groupings(problem: Problem) -> list[dict[str, list[list[str]]]] | None:
    """Every way to group each shared tensor's nodes (owner and readers) into blocks that share a
    device (tensor name -> blocks), or ``None`` if there are more than :data:`MAX_GROUPINGS`."""
    tensors = problem.graph.shared_tensors()
    sizes = [len(t.readers | {t.owner}) for t in tensors]
    bell = [1, 1, 2, 5, 15, 52, 203]
    if any(n >= len(bell) for n in sizes) or math.prod(bell[n] for n in sizes) > MAX_GROUPINGS:
        return None
    each = [list(_partitions(sorted(t.readers | {t.owner}))) for t in tensors]
    return [{t.name: blocks for t, blocks in zip(tensors, choice)} for choice in itertools.product(*each)]


def grouped(problem: Problem, blocks: Mapping[str, list[list[str]]]) -> Problem:
    """Each shared tensor's nodes kept on one device per block of ``blocks`` (tensor name ->
    blocks; existing colocation classes join the blocks they meet), and each block without the
    owner paying one copy (:func:`torchplace.costmodel.copy_bytes`) on its first member."""
    g = problem.graph
    links = nx.Graph()
    extra: dict[str, int] = {}
    for t in g.shared_tensors():
        for block in blocks[t.name]:
            links.add_edges_from(zip(block, block[1:]))
            if t.owner not in block:
                extra[block[0]] = extra.get(block[0], 0) + sum(costmodel.copy_bytes(problem, t))
    records = {v: dataclasses.replace(g.record(v), param_bytes=g.record(v).param_bytes + b) for v, b in extra.items()}
    if links.number_of_edges():
        by_label: dict[str, list[str]] = {}
        for v, r in g.records():  # existing colocation classes stay together and join the new ones
            if r.colocation is not None:
                by_label.setdefault(r.colocation, []).append(v)
                links.add_node(v)
        for members in by_label.values():
            links.add_edges_from(zip(members, members[1:]))
        for comp in nx.connected_components(links):
            label = "shared:" + min(comp)
            records.update({v: dataclasses.replace(records.get(v, g.record(v)), colocation=label) for v in comp})
    return dataclasses.replace(problem, graph=_copy(g, records))


def readers_apart(problem: Problem) -> Problem:
    """The grouping that keeps each shared tensor's readers other than its owner on one device,
    paying one copy there: the one tried where :func:`groupings` are too many (it finds the plans
    that keep the owner apart, when the readers are too big for the owner's device and too many to
    each pay a copy)."""
    return grouped(problem, {t.name: [b for b in ([t.owner], sorted(t.readers - {t.owner})) if b]
                             for t in problem.graph.shared_tensors()})


def _on_truth(problem: Problem, plan: Plan, lower_bound: float, how: str) -> Plan:
    """``plan`` (of the relaxation, ``how="relaxed"``, or of a grouping) built on the true problem,
    recomputing where a training pipeline needs it for the copies; its status and proofs are its
    solver's only for the relaxation's plan with the recomputation it was solved with."""
    stages = plan.stages
    if training_pipeline(problem) is not None:
        stages = fit(problem, plan.stages) or plan.stages  # (a plan that does not fit raises below)
    kept = how == "relaxed" and [s.recompute for s in stages] == [s.recompute for s in plan.stages]
    return on_true_problem(problem, plan, lower_bound, how, key="shared_tensors", stages=stages, kept=kept)


def solve_shared(problem: Problem, solve: Solve, time_limit: float | None, **opts: Any) -> Plan:
    """Solve ``problem`` with ``solve(problem, time_limit=..., **opts)`` as the module docstring says.

    Raises:
        InfeasibleError: if the relaxation is infeasible (so is the problem), or if no
            restriction has a plan that fits (so is the problem, where every grouping was tried;
            the message says when only the two extremes were).
    """
    start = time.perf_counter()
    share = None if time_limit is None else time_limit / 2
    first = solve(relaxed(problem), time_limit=share, **opts)
    found: list[Plan] = []
    truth: Plan | None = None  # the relaxation's plan on the true problem, where it fits
    try:
        truth = _on_truth(problem, first, first.lower_bound, "relaxed")
        if [s.recompute for s in truth.stages] == [s.recompute for s in first.stages] or first.meta.get("interrupted"):
            return truth  # its load is the relaxation's: its proof carries over (or Ctrl-C: what there is)
        found.append(truth)  # it fits only by recomputing more: the restrictions may do better
    except InvalidPlanError:  # the relaxation's plan needs more memory for the copies than a device has
        stop_if_interrupted(first.meta)
    errors: list[Exception] = []

    def attempt(variants: list[Problem]) -> None:
        for i, variant in enumerate(variants):  # each gets its share of the time left
            spent = time.perf_counter() - start
            left = None if time_limit is None else max(time_limit - spent, 0.0) / (len(variants) - i)
            try:
                found.append(solve(variant, time_limit=left, **opts))
            except InfeasibleError as e:
                errors.append(e)
                continue
            if found[-1].meta.get("interrupted"):  # Ctrl-C: the best of what was found, and no more
                return

    attempt([colocated(problem), replicated(problem)])
    every = groupings(problem)
    if not found and every is not None:  # the groupings between the extremes (every[0] is replicated's,
        attempt([grouped(problem, blocks) for blocks in every[1:-1]])  # every[-1] colocated's)
    elif not found:
        attempt([readers_apart(problem)])
    if not found:
        names = ", ".join(t.name for t in problem.graph.shared_tensors())
        if every is None:
            raise InfeasibleError(
                f"no plan found that fits memory with the copies of the shared tensors ({names}) counted on every "
                f"device that reads them: neither all readers of a tensor with its owner, nor its other readers "
                f"on one device, nor every reader paying a copy fits ({errors[0]}), and the {MAX_GROUPINGS}+ other "
                f"groupings were not searched, so a plan may still fit; allow more memory (max_memory) or add a "
                f"device"
            ) from errors[0]
        raise InfeasibleError(
            f"no plan fits memory once the copies of the shared tensors ({names}) are counted on every device "
            f"that reads them ({errors[0]}); allow more memory (max_memory) or add a device"
        ) from errors[0]
    best = min(found, key=lambda p: p.objective)  # (ties: the relaxation's, already on the truth)
    return best if best is truth else _on_truth(problem, best, first.lower_bound, "grouped")
