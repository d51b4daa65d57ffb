"""Predicted timelines of a plan, as data: bars on rows (devices, and links in latency mode).

Nothing here says what anything costs: stage and node times come from the one cost model
(:func:`~torchplace.costmodel.stage_costs`, :func:`~torchplace.costmodel.training_stage_times`,
:func:`~torchplace.costmodel.simulate`), and pipeline orders from the schedules the runtime runs
(:mod:`torchplace.runtime.schedule`). This module only lays those out in time:

- inference, throughput: the fill-drain of ``m`` micro-batches as the call-time clock runs it
  (:func:`torchplace.callmodel.simulate_inference`, without the executor's overheads); a stage's
  bar is its cost divided by ``m``.
- training: the plan's GPipe or 1F1B actions on the same clock
  (:func:`torchplace.callmodel.simulate_training`).
- latency: the cost model's simulation of one sample, each node on its device row and each
  transfer on its ``src -> dst`` row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torchplace import costmodel
from torchplace.checks import positive_int
from torchplace.errors import UnsupportedError, UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem

__all__ = ["Bar", "drawn_microbatches", "drawn_schedule", "pipeline_end", "predicted_end", "predicted_timeline",
           "stage_times"]


@dataclass(frozen=True)
class Bar:
    """One piece of work in a timeline.

    Attributes:
        row: the device name (or ``"src -> dst"`` for a transfer).
        start, finish: seconds from the start of the run.
        stage: the stage index (-1 for a transfer).
        microbatch: the micro-batch (0 in latency mode).
        kind: ``"F"`` forward, ``"B"`` backward, ``"node"`` (latency) or ``"transfer"``.
        label: what the bar is, for a tooltip.
    """

    row: str
    start: float
    finish: float
    stage: int
    microbatch: int = 0
    kind: str = "F"
    label: str = ""


def stage_times(plan: Plan, problem: Problem | None) -> list[tuple[str, float]]:
    """(device, predicted seconds for the graph's unit of work) of each stage, in plan order: the
    cost model's per-stage cost with the problem, else the plan's per-device costs split evenly
    over the device's stages (a plan file holds no graph)."""
    if problem is not None:
        return [(c.device, c.load) for c in costmodel.stage_costs(problem, plan.stages)]
    count: dict[str, int] = {}
    for s in plan.stages:
        count[s.device] = count.get(s.device, 0) + 1
    load = {c.device: c.load for c in plan.costs}
    return [(s.device, load.get(s.device, 0.0) / count[s.device]) for s in plan.stages]


MOST_MICROBATCHES = 256
"""The most micro-batches a predicted timeline draws (100000 took 48 s and 61 MB of HTML)."""


def predicted_timeline(plan: Plan, problem: Problem | None = None, microbatches: int | None = None) -> list[Bar]:
    """The bars of the plan's predicted run (see the module docstring).

    Args:
        plan: the plan.
        problem: the problem it was solved for; without it, an inference pipeline is drawn from
            the plan's costs, a training step from the step ``place()`` predicted (its
            ``meta["call"]``), and a latency plan as its stages one after another.
        microbatches: for throughput plans; default the problem's training pipeline's, else the
            plan's (:attr:`Plan.microbatches`);
            at most :data:`MOST_MICROBATCHES` (a picture of more is not readable).

    Raises:
        UsageError: ``microbatches`` is not a whole number from 1 to :data:`MOST_MICROBATCHES`.
        UnsupportedError: a Piper plan, or a training plan file without a predicted step.
    """
    if microbatches is not None:
        microbatches = positive_int(microbatches, "microbatches")
        if microbatches > MOST_MICROBATCHES:
            raise UsageError(f"microbatches: a timeline of {microbatches} micro-batches is not readable; draw at "
                             f"most {MOST_MICROBATCHES}")
    return _bars(plan, problem, microbatches)


def predicted_end(plan: Plan, problem: Problem | None = None, microbatches: int | None = None) -> float:
    """When :func:`predicted_timeline`'s run ends (0 for an empty one), for any number of
    micro-batches: a number to compare with, not a picture, so :data:`MOST_MICROBATCHES` does not
    bound it.

    Raises:
        UsageError: ``microbatches`` is not a positive whole number.
        UnsupportedError: as :func:`predicted_timeline`.
    """
    microbatches = None if microbatches is None else positive_int(microbatches, "microbatches")
    return max((b.finish for b in _bars(plan, problem, microbatches)), default=0.0)


def pipeline_end(times: Sequence[tuple[str, float]], microbatches: int, problem: Problem | None = None) -> float:
    """When a fill-drain pipeline of stages taking ``times`` (``(device, seconds per call)``, in
    plan order) over ``microbatches`` micro-batches ends, on the clock of an inference pipeline
    (a training plan's forward passes, run in eval mode, are one)."""
    return max((b.finish for b in _pipeline(times, positive_int(microbatches, "microbatches"), problem)), default=0.0)


def _bars(plan: Plan, problem: Problem | None, microbatches: int | None) -> list[Bar]:
    """:func:`predicted_timeline` without the bound on ``microbatches``."""
    if any(s.tmpcs for s in plan.stages) or (problem is not None and problem.parallel is not None):
        raise UnsupportedError("a Piper plan's schedule is not drawn (its stages run d data-parallel copies and "
                               "recompute per node, which no timeline here lays out): its stage table gives each "
                               "stage's time per sample (TPS)")
    if problem is not None and problem.objective == "latency":
        return _latency(problem, plan)
    if problem is not None and problem.mode == "training" and problem.pipeline is not None:
        return _training(problem, plan, drawn_microbatches(plan, problem, microbatches))
    if problem is None and plan.meta.get("mode") == "training":
        return _training_from_call(plan, drawn_microbatches(plan, problem, microbatches))
    if (problem is None and plan.meta.get("objective") == "latency") or (problem is None and microbatches == 1):
        return _pipeline(stage_times(plan, None), 1)
    return _pipeline(stage_times(plan, problem), drawn_microbatches(plan, problem, microbatches), problem)


def drawn_microbatches(plan: Plan, problem: Problem | None, microbatches: int | None) -> int:
    """The micro-batches a pipeline picture draws: those asked for, else the training pipeline's,
    else the plan's (:attr:`Plan.microbatches`), at most :data:`MOST_MICROBATCHES`."""
    if microbatches:
        return microbatches
    if problem is not None and problem.mode == "training" and problem.pipeline is not None:
        return problem.pipeline.microbatches
    return min(plan.microbatches, MOST_MICROBATCHES)


def drawn_schedule(plan: Plan, problem: Problem | None) -> str | None:
    """The training schedule a pipeline picture draws (``"gpipe"``, ``"1f1b"``), or ``None`` for
    an inference pipeline."""
    if problem is not None:
        return problem.pipeline.schedule if problem.mode == "training" and problem.pipeline is not None else None
    return plan.meta.get("schedule") if plan.meta.get("mode") == "training" else None


def _pools(problem: Problem | None) -> dict[str, str] | None:
    """Which devices share cores (:func:`torchplace.callmodel.core_pools`), as the call prediction has them."""
    from torchplace.callmodel import core_pools

    return None if problem is None else core_pools(problem)


def _pipeline(times: Sequence[tuple[str, float]], m: int, problem: Problem | None = None) -> list[Bar]:
    """The inference clock of :func:`torchplace.callmodel.simulate_inference` (no overheads), a
    stage's bar being its cost divided by ``m``; devices that share cores take turns."""
    from torchplace.callmodel import simulate_inference

    call = simulate_inference([(d, t / m) for d, t in times], m, pools=_pools(problem))
    return [Bar(t.worker, t.start, t.finish, t.stage, t.microbatch, "F", f"stage {t.stage}, micro-batch {t.microbatch}")
            for t in call.tasks]


def _training(problem: Problem, plan: Plan, m: int) -> list[Bar]:
    """The training clock of :func:`torchplace.callmodel.simulate_training` (no overheads)."""
    from torchplace.callmodel import simulate_training, training_microbatch_times

    assert problem.pipeline is not None
    call = simulate_training(training_microbatch_times(problem, plan.stages, m), m, problem.pipeline.schedule,
                             pools=_pools(problem))
    names = {"F": "forward", "B": "backward"}
    return [Bar(t.worker, t.start, t.finish, t.stage, t.microbatch, t.kind,
                f"{names[t.kind]} of stage {t.stage}, micro-batch {t.microbatch}") for t in call.tasks]


def _training_from_call(plan: Plan, m: int) -> list[Bar]:
    """The training clock of a plan file: each stage's forward and backward time per micro-batch
    from the step ``place()`` predicted (``plan.meta["call"]["stage_seconds"]``, summed over its
    micro-batches) under the plan's schedule (``plan.meta["schedule"]``); devices that share cores
    are not known without the problem, so each runs alone.

    Raises:
        UnsupportedError: the plan records no predicted step (a plan no ``place()`` made).
    """
    from torchplace.callmodel import simulate_training

    call, schedule = plan.meta.get("call"), plan.meta.get("schedule")
    seconds = call.get("stage_seconds") if isinstance(call, dict) else None
    if not seconds or schedule not in ("gpipe", "1f1b"):
        raise UnsupportedError("this training plan records no predicted step (place() records one with the plan it "
                               "makes): draw its schedule with its problem, plan.plot_schedule(problem), or from the "
                               "placed model, placed.plot_schedule()")
    made_for = plan.microbatches
    per_pass = {(int(i), kind): float(t) / made_for for i, kind, t in seconds}
    times = [(s.device, per_pass.get((i, "F"), 0.0), per_pass.get((i, "B"), 0.0)) for i, s in enumerate(plan.stages)]
    call_of = simulate_training(times, m, schedule)
    names = {"F": "forward", "B": "backward"}
    return [Bar(t.worker, t.start, t.finish, t.stage, t.microbatch, t.kind,
                f"{names[t.kind]} of stage {t.stage}, micro-batch {t.microbatch}") for t in call_of.tasks]


def _latency(problem: Problem, plan: Plan) -> list[Bar]:
    sched = costmodel.simulate(problem, plan.stages)
    stage_of = {v: i for i, s in enumerate(plan.stages) for v in s.nodes}
    bars = [Bar(sched.device_of[v], sched.start[v], sched.finish[v], stage_of[v], 0, "node",
                problem.graph.record(v).name or v) for v in sched.start]
    bars += [Bar(f"{t.src} -> {t.dst}", t.start, t.finish, -1, 0, "transfer", f"output of {t.node}")
             for t in sched.transfers]
    return bars
