"""Predicted timelines of a plan, as data: bars on rows (devices, and links in latency mode).

Nothing here says what anything costs: stage and node times come from the one cost model
(:func:`~torchplace.costmodel.stage_costs`, :func:`~torchplace.costmodel.training_stage_times`,
:func:`~torchplace.costmodel.simulate`), and pipeline orders from the schedules the runtime runs
(:mod:`torchplace.runtime.schedule`). This module only lays those out in time:

- inference, throughput: the fill-drain of ``m`` micro-batches, each worker running its
  (micro-batch, segment) pairs in :func:`~torchplace.runtime.schedule.worker_orders` order; a pair
  starts when its worker is free and the micro-batch left the segment before; a stage's bar is its
  cost divided by ``m``.
- training: the plan's GPipe or 1F1B actions (:func:`~torchplace.runtime.schedule.training_schedule`)
  per worker; a forward waits for the stage before, a backward for the stage after.
- latency: the cost model's simulation of one sample, each node on its device row and each
  transfer on its ``src -> dst`` row.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchplace import costmodel
from torchplace.plan import Plan
from torchplace.problem import Problem

__all__ = ["Bar", "predicted_timeline", "stage_times"]


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


def predicted_timeline(plan: Plan, problem: Problem | None = None, microbatches: int | None = None) -> list[Bar]:
    """The bars of the plan's predicted run (see the module docstring).

    Args:
        plan: the plan.
        problem: the problem it was solved for; without it, inference pipelines only (from the
            plan's costs), and a latency plan is drawn as its stages one after another.
        microbatches: for throughput plans; default the problem's training pipeline's, else 4.
    """
    if problem is not None and problem.objective == "latency":
        return _latency(problem, plan)
    if problem is not None and problem.mode == "training" and problem.pipeline is not None:
        return _training(problem, plan, microbatches or problem.pipeline.microbatches)
    if (problem is None and plan.meta.get("objective") == "latency") or (problem is None and microbatches == 1):
        return _pipeline(stage_times(plan, None), 1)
    return _pipeline(stage_times(plan, problem), microbatches or 4)


def _pipeline(times: Sequence[tuple[str, float]], m: int) -> list[Bar]:
    from torchplace.runtime.schedule import segments, worker_orders

    segs = segments([d for d, _ in times])
    free = dict.fromkeys((w for w, _ in segs), 0.0)
    left: dict[tuple[int, int], float] = {}  # (micro-batch, segment) -> when it finished
    bars: list[Bar] = []
    orders = worker_orders(m, [w for w, _ in segs])
    pending = {w: list(o) for w, o in orders.items()}
    while any(pending.values()):  # take each worker's next pair once its input has left the segment before
        progressed = False
        for worker, order in pending.items():
            if not order or (order[0][1] > 0 and (order[0][0], order[0][1] - 1) not in left):
                continue
            i, seg = order.pop(0)
            t = max(free[worker], left.get((i, seg - 1), 0.0))
            for s in segs[seg][1]:
                dur = times[s][1] / m
                bars.append(Bar(worker, t, t + dur, s, i, "F", f"stage {s}, micro-batch {i}"))
                t += dur
            free[worker] = left[(i, seg)] = t
            progressed = True
        if not progressed:
            raise AssertionError("worker_orders gave an order that cannot run")
    return bars


def _training(problem: Problem, plan: Plan, m: int) -> list[Bar]:
    from torchplace.runtime.schedule import per_worker, training_schedule

    times = costmodel.training_stage_times(problem, plan.stages)
    n = len(times)
    workers = [d for d, _, _ in times]
    orders = {w: list(o) for w, o in per_worker(training_schedule(problem.pipeline.schedule, m, n), workers).items()}
    done: dict[Any, float] = {}
    free = dict.fromkeys(orders, 0.0)
    bars: list[Bar] = []
    while any(orders.values()):
        progressed = False
        for worker, order in orders.items():
            if not order:
                continue
            a = order[0]
            if a.kind == "F":
                dep = (("F", a.microbatch, a.stage - 1),) if a.stage > 0 else ()
            else:
                dep = (("B", a.microbatch, a.stage + 1),) if a.stage < n - 1 else (("F", a.microbatch, n - 1),)
            if any(d not in done for d in dep):
                continue
            order.pop(0)
            start = max([free[worker], *(done[d] for d in dep)])
            dur = (times[a.stage][1] if a.kind == "F" else times[a.stage][2]) / m
            free[worker] = done[(a.kind, a.microbatch, a.stage)] = start + dur
            pass_name = "forward" if a.kind == "F" else "backward"
            bars.append(Bar(worker, start, start + dur, a.stage, a.microbatch, a.kind,
                            f"{pass_name} of stage {a.stage}, micro-batch {a.microbatch}"))
            progressed = True
        if not progressed:
            raise AssertionError("the training schedule cannot run")
    return bars


def _latency(problem: Problem, plan: Plan) -> list[Bar]:
    sched = costmodel.simulate(problem, plan.stages)
    stage_of = {v: i for i, s in enumerate(plan.stages) for v in s.nodes}
    bars = [Bar(sched.device_of[v], sched.start[v], sched.finish[v], stage_of[v], 0, "node",
                problem.graph.record(v).name or v) for v in sched.start]
    bars += [Bar(f"{t.src} -> {t.dst}", t.start, t.finish, -1, 0, "transfer", f"output of {t.node}")
             for t in sched.transfers]
    return bars
