"""Solving a training problem with a Pipeline by a solver that assumes memory is a sum over nodes.

Under a training :class:`~torchplace.problem.Pipeline` of ``m`` micro-batches a device's memory is
not a sum over its nodes (:func:`torchplace.costmodel.memory`): one micro-batch's working memory
(the ceiling of a sum), the saved activations of the micro-batches in flight at its pipeline
position (1F1B: ``min(m, S - j)``, Piper 2021 Sec. 3.5), or its stage inputs when it recomputes.
The ideals DP and SliceGraph (hence BRKGA) cost it exactly (:mod:`torchplace.solvers.dp`,
:mod:`torchplace.solvers.slicegraph_pipeline`); the MILPs (the max-load IP, MTPP, Archer's MIP
bounds), whose memory rows are sums over nodes, solve through problems whose node memory is a
sum, as :mod:`torchplace.solvers.shared` does for shared tensors:

1. the *relaxation*: a node needs ``param + floor((temp + saved) / m)`` bytes, never more than its
   share on any device at any position, recomputing or not (``ceil(W/m) + k ceil(A/m) >=
   (W + A)/m`` for ``k >= 1``, and a sum of floors is at most the floor of the sum). Its lower
   bound holds for the true problem (recomputing only adds load). Its plan is re-costed under the
   true model, each device recomputing exactly when keeping its activations does not fit
   (:func:`fit`); when no device has to, the plan's load is the relaxation's, and so is its proof;
2. otherwise the *restriction*: a node needs ``param + ceil(temp / m) + m ceil(saved / m)``, at
   least its share on any device without recomputation (``in_flight <= m``, a sum of ceilings is
   at least the ceiling of the sum), so its plans always fit. The better plan is kept, with the
   relaxation's bound, and status ``"optimal"`` only where that bound proves it.

Every returned plan is evaluated and validated on the true problem.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from torchplace import costmodel
from torchplace.errors import InfeasibleError, SolverLimitError
from torchplace.graph import NodeRecord
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers.limits import in_phases
from torchplace.solvers.paircosts import training_pipeline
from torchplace.solvers.stand_in import on_true_problem

__all__ = ["bounding_problem", "conservative", "fit", "relaxed", "solve_pipelined", "training_pipeline"]

Solve = Callable[..., Plan]


def _with_records(problem: Problem, record: Callable[[NodeRecord], NodeRecord]) -> Problem:
    """``problem`` without its pipeline, each record replaced (graph metadata kept: shared tensors
    still count their copies)."""
    return dataclasses.replace(problem, graph=problem.graph.with_records(lambda v, r: record(r)), pipeline=None)


def relaxed(problem: Problem) -> Problem:
    """Per-node memory never above the truth (module docstring, 1)."""
    m = problem.pipeline.microbatches  # type: ignore[union-attr]
    return _with_records(problem, lambda r: dataclasses.replace(
        r, temp_bytes=(r.temp_bytes + r.saved_bytes) // m, saved_bytes=0, saved_parts={}))


def conservative(problem: Problem) -> Problem:
    """Per-node memory never below the truth without recomputation (module docstring, 2)."""
    m = problem.pipeline.microbatches  # type: ignore[union-attr]
    return _with_records(problem, lambda r: dataclasses.replace(
        r, temp_bytes=-(-r.temp_bytes // m) + m * -(-r.saved_bytes // m), saved_bytes=0, saved_parts={}))


def fit(problem: Problem, stages: Sequence[Stage]) -> list[Stage] | None:
    """``stages`` with each device recomputing exactly when keeping its activations does not fit
    (and the pipeline allows it); None if some device fits neither way."""
    holds = costmodel.in_flight(problem, stages)
    upstream = costmodel.upstream_in_flight(problem, stages, holds)
    allowed = problem.pipeline is not None and problem.pipeline.recompute
    nodes: dict[str, list[str]] = defaultdict(list)
    for s in stages:
        nodes[s.device].extend(s.nodes)
    redo = set()
    for d, members in nodes.items():
        cap = problem.cluster.device(d).memory_bytes
        need = functools.partial(costmodel.memory, problem, members, in_flight=holds[d],
                                 upstream_in_flight=upstream[d], device=problem.cluster.device(d))
        if cap is None or need() <= cap:
            continue
        if not (allowed and need(recompute=True) <= cap):
            return None
        redo.add(d)
    return [dataclasses.replace(s, recompute=s.device in redo) for s in stages]


def _on_truth(problem: Problem, plan: Plan, stages: Sequence[Stage], bound: float, how: str) -> Plan:
    """``stages`` (of ``plan``, solved on the relaxation or the restriction ``how``) built on the
    true problem; its status and proofs are ``plan``'s only where that carries over (the
    relaxation's plan, no device recomputing)."""
    kept = how == "relaxed" and not any(s.recompute for s in stages)
    return on_true_problem(problem, plan, bound, how, key="pipeline_memory", stages=stages, kept=kept)


def solve_pipelined(problem: Problem, solve: Solve, time_limit: float | None, **opts: Any) -> Plan:
    """Solve a training problem with a pipeline by ``solve(problem, time_limit=..., **opts)``, a
    solver whose memory is a sum over nodes, as the module docstring says.

    Raises:
        InfeasibleError: if the relaxation has no plan (so the problem has none), or if neither
            the relaxation's plan nor the restriction's fits.
        SolverLimitError: the relaxation found no plan in its half of ``time_limit`` (the
            message names ``time_limit``).
    """
    start = time.perf_counter()
    share = None if time_limit is None else time_limit / 2
    try:
        first = solve(relaxed(problem), time_limit=share, **opts)
    except SolverLimitError as e:
        raise in_phases(e, time_limit, "a training pipeline is solved on a relaxed problem first, in half the "
                        "time") from e
    except InfeasibleError as e:
        raise InfeasibleError(
            "no split fits the devices' memory for training even with every device holding one micro-batch's "
            "activations; raise max_memory or add devices (method 'dp' states the smallest memory that fits and "
            "whether recomputation, 1F1B or more micro-batches would)") from e
    found: list[Plan] = []
    stages = fit(problem, first.stages)
    if stages is not None:
        found.append(_on_truth(problem, first, stages, first.lower_bound, "relaxed"))
        if not any(s.recompute for s in stages):
            return found[0]
    left = None if time_limit is None else max(time_limit - (time.perf_counter() - start), 0.0)
    try:
        second = solve(conservative(problem), time_limit=left, **opts)
        found.append(_on_truth(problem, second, second.stages, first.lower_bound, "conservative"))
    except SolverLimitError:
        if not found:
            raise
    except InfeasibleError as e:
        if not found:
            raise InfeasibleError(
                f"{first.solver} found no split that fits the devices' memory for training: its best split "
                "with every device holding one micro-batch's activations does not fit at its pipeline position, "
                "and none fits with every device holding all of them; use method 'dp' (exact under a pipeline), "
                "allow recomputation, use schedule='1f1b' or more micro-batches, or raise max_memory") from e
    return min(found, key=lambda p: (p.objective, p.meta["pipeline_memory"] != "relaxed"))


def bounding_problem(problem: Problem) -> Problem:
    """The problem a lower bound may be computed on: the relaxation under a training pipeline
    (its bound holds for the true problem), else ``problem`` itself."""
    return relaxed(problem) if training_pipeline(problem) is not None else problem
