"""Closing the loop: run the plan, re-time its stages as placed, solve again, keep the faster.

Profiling times each operator alone; placed, a stage runs them back to back on its worker, with
the others running beside it, so the measured stage time can differ from the sum the cost model
predicts (shared cores and caches, per-call overheads). ``place(..., refine=True)`` measures the
plan it solved (:meth:`~torchplace.placed_module.PlacedModule.measure`), rewrites the graph's
times so that the cost model reproduces each measured stage (:func:`measured_graph`), solves that
problem, runs the new plan too if it differs, and keeps the plan whose calls measure faster
(median wall time per call). The result's :class:`Refinement` (``placed.refinement``) holds both
plans and both measurements; :meth:`~torchplace.placed_module.PlacedModule.report` shows them.

The lower bound printed beside the kept plan is still a proof, for the problem that plan was
solved on: bounds speak about the cost model, and a measurement is not a proof of anything.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchplace import costmodel
from torchplace.graph import OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem

__all__ = ["RefinedPlan", "Refinement", "measured_graph", "refine"]


@dataclass(frozen=True)
class RefinedPlan:
    """One plan ``place(..., refine=True)`` ran.

    Attributes:
        costs: ``"profiled"`` or ``"measured"``: the costs it was solved on.
        plan: the plan (evaluated on the profiled costs, as the placed module's ``problem``).
        on_measured: its objective on the measured costs.
        measured: its :class:`~torchplace.report.fidelity.Measurement`.
    """

    costs: str
    plan: Plan
    on_measured: float
    measured: Any

    @property
    def wall(self) -> float:
        """Median measured wall seconds per call."""
        return self.measured.measured_wall


@dataclass(frozen=True)
class Refinement:
    """What ``place(..., refine=True)`` ran and which plan it kept.

    Attributes:
        runs: the plan solved on profiled costs, then (if the measured costs gave another plan)
            the plan solved on measured costs.
        kept: the index in ``runs`` of the plan kept: the one whose calls measured faster.
    """

    runs: tuple[RefinedPlan, ...]
    kept: int

    def __str__(self) -> str:
        head = f"{'solved on':<15} {'solver':>12} {'predicted':>11} {'on measured':>12} {'measured s/call':>16}"
        lines = ["refine=True:", head]
        for i, r in enumerate(self.runs):
            mark = "  <- kept" if i == self.kept else ""
            lines.append(f"{r.costs + ' costs':<15} {r.plan.solver:>12} {r.plan.objective:>11.4g} {r.on_measured:>12.4g} "
                         f"{r.wall:>16.4g}{mark}")
        if len(self.runs) == 1:
            lines.append("(the measured costs gave the same plan)")
        return "\n".join(lines)


def measured_graph(problem: Problem, plan: Plan, measurement: Any) -> OpGraph:
    """``problem.graph`` with each stage's compute re-timed to what the stage measured.

    For stage ``i`` on a device of kind ``k`` with predicted compute ``c`` and transfers ``t``
    (:func:`~torchplace.costmodel.stage_costs`) that measured ``m`` seconds per call, every node
    of the stage gets its time on ``k`` multiplied by ``max(m - t, 0) / c``: the cost model then
    charges that stage ``m`` (its transfers as before). Nodes of stages that took no compute, and
    times on other kinds, are kept. A stage run on several micro-batches is compared per call.
    """
    graph = OpGraph.from_json(problem.graph.to_json())
    predicted = costmodel.stage_costs(problem, plan.stages)
    measured = {s.stage: s.measured for s in measurement.stages if s.kind == "F"}
    for i, (stage, cost) in enumerate(zip(plan.stages, predicted)):
        if i not in measured or cost.compute <= 0 or not math.isfinite(measured[i]):
            continue
        factor = max(measured[i] - cost.transfer_in - cost.transfer_out, 0.0) / cost.compute
        kind = problem.cluster.device(stage.device).kind
        for v in stage.nodes:
            record = graph.record(v)
            times = dict(record.times)
            times[kind] = times[kind] * factor
            graph.replace_record(v, dataclasses.replace(record, times=times))
    return graph


def refine(placed: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any], solve: Callable[[Problem], Plan],
           build: Callable[[Plan], Any], runs: int = 3) -> Any:
    """Measure ``placed``, solve again on the measured costs, and return the placed module whose
    calls measure faster, with ``refinement`` set (see the module docstring).

    Args:
        placed: the :class:`~torchplace.placed_module.PlacedModule` of the first plan.
        inputs, kwargs: the example call to measure with.
        solve: solves a problem (as ``place()`` solved the first).
        build: builds the placed module of a plan for ``placed.problem``.
        runs: measured calls per plan (after one warm-up call).
    """
    problem, first = placed.problem, placed.plan
    first_measured = placed.measure(inputs, kwargs=kwargs, runs=runs)
    if len(problem.graph) == 0:  # a model with no operators: no other plan to solve
        placed.refinement = Refinement((RefinedPlan("profiled", first, first.objective, first_measured),), 0)
        return placed
    remeasured = dataclasses.replace(problem, graph=measured_graph(problem, first, first_measured))
    solved = solve(remeasured)
    done = [RefinedPlan("profiled", first, costmodel.evaluate(remeasured, first), first_measured)]
    if [(s.device, s.nodes) for s in solved.stages] == [(s.device, s.nodes) for s in first.stages]:
        placed.refinement = Refinement(tuple(done), 0)
        return placed
    # Evaluated on the profiled costs, as the first; their bound holds for every plan of them.
    second = Plan.build(problem, solved.stages, solver=solved.solver, seconds=solved.seconds,
                        lower_bound=first.lower_bound, status="feasible", meta=solved.meta)
    other = build(second)
    done.append(RefinedPlan("measured", second, solved.objective, other.measure(inputs, kwargs=kwargs, runs=runs)))
    kept = min(range(2), key=lambda i: done[i].wall)
    if kept == 0:
        other = build(first)  # the second plan moved the model's tensors: put them back
        other.last_measurement, other._last_spans = placed.last_measurement, placed._last_spans
    other.refinement = Refinement(tuple(done), kept)
    return other
