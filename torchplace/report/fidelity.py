"""Predicted vs measured: does the cost model hold for a placed model's real runs?

:func:`compare` takes the spans of a few runs (the executors' ``last_spans``) and their wall
times, and sets them beside the cost model: each stage's measured seconds per call (its spans
summed over micro-batches, the median over runs) against the time its tasks take in the call
``place()`` predicted (``plan.meta["call"]["stage_seconds"]``: micro-batch stage times profiled at
the micro-batch size, plus the executor's per-task overhead) when it was for this many
micro-batches, else :func:`~torchplace.costmodel.stage_costs` (or
:func:`~torchplace.costmodel.training_stage_times`, forward and backward apart); the run's
bottleneck (the busiest device's seconds per call, for throughput) or makespan (latency) against
the plan's objective; and the wall time per call against the call ``place()`` predicted
(:mod:`torchplace.callmodel`: the schedule's clock with micro-batch stage times and the executor's
overheads, ``plan.meta["call"]``) when it was for this many micro-batches, else the predicted
timeline's end. Calls of a model placed for training, run in eval mode, are forward passes
alone: their objective is the busiest device's forward time and their wall the pipeline of the
stages' predicted forward times, not the training step ``place()`` predicted.
Predictions are for the graph's unit of work, the example inputs the model was profiled with:
measure with inputs of that size.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torchplace import costmodel
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.report.timeline import pipeline_end, predicted_end
from torchplace.runtime.spans import StageSpan

__all__ = ["Measurement", "StageFidelity", "compare", "pearson"]


@dataclass(frozen=True)
class StageFidelity:
    """One stage pass: predicted and measured seconds per call."""

    stage: int
    device: str
    kind: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """Relative error ``(measured - predicted) / predicted`` (``inf`` for a 0-s prediction)."""
        return (self.measured - self.predicted) / self.predicted if self.predicted > 0 else math.inf


@dataclass(frozen=True)
class Measurement:
    """Predicted vs measured for one placed model (see the module docstring).

    Attributes:
        stages: per stage (and pass).
        objective: ``"throughput"`` or ``"latency"``.
        predicted_objective, measured_objective: the plan's objective; the measured bottleneck
            device's busy seconds per call (throughput) or the makespan of one call (latency).
        predicted_wall, measured_wall: the predicted call (see the module docstring); the median wall
            seconds per call.
        runs, microbatches: how it was measured.
    """

    stages: list[StageFidelity]
    objective: str
    predicted_objective: float
    measured_objective: float
    predicted_wall: float
    measured_wall: float
    runs: int
    microbatches: int

    @property
    def pearson(self) -> float:
        """Pearson correlation of predicted and measured stage times (``nan`` with fewer than two
        stages or no spread)."""
        return pearson([s.predicted for s in self.stages], [s.measured for s in self.stages])

    @property
    def median_error(self) -> float:
        """Median of ``|error|`` over the stages."""
        errors = [abs(s.error) for s in self.stages if math.isfinite(s.error)]
        return statistics.median(errors) if errors else math.nan

    def __str__(self) -> str:
        rows = [f"{'stage':>5}  {'pass':>4}  {'device':>8}  {'predicted':>11}  {'measured':>11}  {'error':>7}"]
        for s in self.stages:
            rows.append(f"{s.stage:>5}  {s.kind:>4}  {s.device:>8}  {s.predicted:>11.4g}  {s.measured:>11.4g}  "
                        f"{100 * s.error:>6.1f}%")
        what = "bottleneck s/call" if self.objective == "throughput" else "makespan s"
        rows.append(f"{what}: predicted {self.predicted_objective:.4g}, measured {self.measured_objective:.4g}; "
                    f"wall per call: predicted {self.predicted_wall:.4g}, measured {self.measured_wall:.4g}; "
                    f"Pearson {self.pearson:.3f}, median |error| {100 * self.median_error:.1f}% "
                    f"({self.runs} runs, {self.microbatches} micro-batches)")
        return "\n".join(rows)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    if len(xs) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    syy = math.fsum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def _predicted_stages(plan: Plan, problem: Problem, training: bool) -> dict[tuple[int, str], tuple[str, float]]:
    if training:
        out = {}
        for i, (dev, fwd, bwd) in enumerate(costmodel.training_stage_times(problem, plan.stages)):
            out[(i, "F")], out[(i, "B")] = (dev, fwd), (dev, bwd)
        return out
    return {(i, "F"): (c.device, c.load) for i, c in enumerate(costmodel.stage_costs(problem, plan.stages))}


def compare(plan: Plan, problem: Problem, runs: Sequence[Sequence[StageSpan]], walls: Sequence[float],
            microbatches: int, training: bool = False) -> Measurement:
    """Set measured runs beside the cost model (see the module docstring).

    Args:
        runs: each run's spans; walls: each run's wall seconds.
        microbatches: micro-batches per run (1 for latency).
        training: the plan is a training plan: stages are its forward stages, compared pass by
            pass (forward only when the runs have no backward spans: eval-mode calls, set beside
            the forward passes alone).
    """
    predicted = _predicted_stages(plan, problem, training)
    call = plan.meta.get("call") or {}
    if call.get("microbatches") == microbatches and call.get("stage_seconds"):  # the call place() predicted
        in_call = {(int(i), str(kind)): float(secs) for i, kind, secs in call["stage_seconds"]}
        if set(predicted) <= set(in_call):
            predicted = {key: (dev, in_call[key]) for key, (dev, _) in predicted.items()}
    kinds = {s.kind for spans in runs for s in spans}
    forward_only = training and "B" not in kinds  # an eval-mode run of a training plan: forward calls, no step
    if training:
        predicted = {k: v for k, v in predicted.items() if k[1] in kinds}
    per_stage: dict[tuple[int, str], list[float]] = defaultdict(list)
    busy: list[float] = []
    makespans: list[float] = []
    for spans in runs:
        total: dict[tuple[int, str], float] = defaultdict(float)
        device: dict[str, float] = defaultdict(float)
        for s in spans:
            total[(s.stage, s.kind)] += s.seconds
            device[s.worker] += s.seconds
        for key in predicted:
            per_stage[key].append(total.get(key, 0.0))
        busy.append(max(device.values(), default=0.0))
        makespans.append(max((s.finish for s in spans), default=0.0) - min((s.start for s in spans), default=0.0))
    stages = [StageFidelity(i, dev, kind, secs, statistics.median(per_stage[(i, kind)]))
              for (i, kind), (dev, secs) in sorted(predicted.items())]
    measured = statistics.median(makespans if problem.objective == "latency" else busy) if runs else math.nan
    objective = plan.objective
    if forward_only:  # the busiest device's forward passes, and their pipeline, not the training step's
        load: dict[str, float] = defaultdict(float)
        for device, forward, _ in costmodel.training_stage_times(problem, plan.stages):
            load[device] += forward
        objective = max(load.values(), default=0.0)
        wall = pipeline_end([predicted[key] for key in sorted(predicted)], microbatches, problem)
    elif call.get("microbatches") == microbatches and "seconds" in call:  # place()'s prediction of this call
        wall = float(call["seconds"])
    else:
        wall = predicted_end(plan, problem, microbatches)
    return Measurement(stages, problem.objective, objective, measured, wall,
                       statistics.median(walls) if walls else math.nan, len(runs), microbatches)
