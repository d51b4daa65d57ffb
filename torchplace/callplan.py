"""``place()``'s decisions that rest on the predicted time of a call (:mod:`torchplace.callmodel`).

After the solver has split the model for the steady state (the max device load), ``place()``

1. predicts one call of the plan with ``m`` micro-batches, each stage's time measured at the
   micro-batch size (the traced graph profiled again on the first of the ``m`` micro-batches; for
   training, its forward and backward), the
   executor's overheads measured once per process (:mod:`torchplace.runtime.overhead`);
2. with ``microbatches="auto"`` tries every ``m`` that divides the example batch, up to
   :data:`AUTO_MAX_MICROBATCHES`, and keeps the one with the shortest predicted call (the
   smaller ``m`` on a tie); memory does not grow with ``m`` for inference (the memory model charges
   the whole batch's working memory, an upper bound on a micro-batch's), so every ``m`` fits;
3. predicts the whole model on each single device that fits it, the same way, and runs on the best
   of them instead unless the plan is predicted at least :data:`SPLIT_MARGIN` faster ("never worse
   than not placing": a split's prediction is the less certain of the two;
   ``allow_single_device=False`` forbids it, and the plan still prints the comparison). An inference call on one device runs unsplit
   (``m = 1``, the plain model); a training step keeps the plan's ``m`` (its memory was checked
   for it). For the latency objective a call is one sample: the cost model's makespan plus the
   executor's per-call overhead and per-stage overhead for each stage.

Everything decided is kept in ``plan.meta`` (``"call"``, ``"single_device"``, ``"microbatch_times"``)
and printed with the plan.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchplace import callmodel, costmodel
from torchplace.callmodel import KEEP_SPLIT, CallPrediction, Overheads
from torchplace.errors import InvalidPlanError, MicrobatchError, warn_caller
from torchplace.graph import OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem

__all__ = ["ALLOW_SINGLE_DEVICE", "AUTO_MAX_MICROBATCHES", "SPLIT_MARGIN", "Decision", "candidates", "decide",
           "split_pays"]

AUTO_MAX_MICROBATCHES = 16
"""The most micro-batches ``microbatches="auto"`` tries."""

ALLOW_SINGLE_DEVICE = True
"""``place()``'s default for ``allow_single_device``. The test suite sets it to ``False`` for tests
that exercise splits (a one-device fallback would let them pass without running a split)."""

SPLIT_MARGIN = 0.10
"""How much shorter (a fraction of the single device's call) a split's predicted call must be for
``place()`` to keep it over the whole model on one device that holds it. A split's prediction has
more to be wrong about than one device's (transfers, workers and queues, devices that share cores),
and its measured calls lie within about 10% of the prediction at the median on this project's
machines (``benchmarks/RESULTS.md``, "Pipeline fidelity"). Inside that margin the split's gain is
not shown, its cost (a worker and a copy of its inputs per device, memory on two devices) is:
measured on the demo, a GPT-2 split predicted 0.5% faster ran at 0.77x of the model on one device."""


def split_pays(plan_seconds: float, single_seconds: float) -> bool:
    """Whether a split whose call is predicted at ``plan_seconds`` is kept over one device's
    ``single_seconds``: it must save at least :data:`SPLIT_MARGIN` of the single device's time."""
    return plan_seconds <= (1.0 - SPLIT_MARGIN) * single_seconds


Profiler = Callable[[int], "OpGraph | None"]
"""Profiles the traced graph on one of ``m`` micro-batches: ``m -> OpGraph`` (times of one micro-batch),
or ``None`` where nothing may be profiled (a plan whose cached costs are reused)."""


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` chose: the plan to run, its micro-batches and the prediction."""

    plan: Plan
    microbatches: int
    call: CallPrediction | None


def candidates(microbatches: int | str, batch: int | None, most: int | None = None) -> list[int]:
    """The ``m`` to predict: the one asked for (at most the batch, as the executor clamps it), or for
    ``"auto"`` every divisor of the batch up to :data:`AUTO_MAX_MICROBATCHES` and ``most`` (``[1]``
    without a batch dimension)."""
    if not batch:  # no batched tensor: one micro-batch whatever is asked
        return [1]
    if microbatches != "auto":
        return [min(int(microbatches), batch)]
    top = min(batch, AUTO_MAX_MICROBATCHES, most or batch)
    return [m for m in range(1, top + 1) if batch % m == 0]


def decide(problem: Problem, plan: Plan, microbatches: int | str, batch: int | None, profiler: Profiler, *,
           overheads: Overheads, allow_single_device: bool = True, given: bool = False,
           most: int | None = None) -> Decision:
    """Predict the plan's call, choose ``m``, and compare with the best single device (see the module
    docstring). ``given``: the plan was given by the user (it is run as given, never replaced);
    ``most``: the most micro-batches ``"auto"`` tries.

    Returns:
        The :class:`Decision`; its plan's ``meta`` holds the prediction and the comparison.
    """
    if problem.objective == "latency":
        return _decide_latency(problem, plan, overheads, allow_single_device, given)
    graphs: dict[int, OpGraph] = {}
    notes: list[str] = []
    predictions = {}
    for k in candidates(microbatches, batch, most):
        try:
            predictions[k] = _predict(problem, plan.stages, k, profiler, overheads, graphs, notes)
        except MicrobatchError as error:  # asked for: the user's to fix; "auto": not a candidate
            if microbatches != "auto":
                raise
            notes.append(f"m={k}: not tried: {error}")
    best = min(predictions, key=lambda k: (predictions[k].seconds, k))
    call = predictions[best]
    m = best if microbatches == "auto" else int(microbatches)  # the executor clamps an m above the batch
    plan.meta["call"] = _summary(problem, plan.stages, call, batch, overheads)
    if len(predictions) > 1:
        plan.meta["call"]["tried"] = {str(k): p.seconds for k, p in predictions.items()}
    if notes:
        plan.meta["call"]["notes"] = notes
    if len({s.device for s in plan.stages}) < 2 or given:
        return Decision(plan, m, call)
    single = _best_single(problem, plan, profiler, overheads, graphs, notes)
    if single is None:
        plan.meta["single_device"] = {"device": None, "chosen": False}
        return Decision(plan, m, call)
    one_plan, one_m, one_call = single
    device = one_plan.stages[0].device
    record = {"device": device, "seconds": one_call.seconds, "plan_seconds": call.seconds,
              "plan_microbatches": best, "margin": SPLIT_MARGIN}
    if split_pays(call.seconds, one_call.seconds) or not allow_single_device:
        plan.meta["single_device"] = {**record, "chosen": False}
        return Decision(plan, m, call)
    one_plan.meta["call"] = _summary(problem, one_plan.stages, one_call, batch, overheads)
    one_plan.meta["single_device"] = {**record, "chosen": True}
    warn_caller(f"{_verdict(device, one_call.seconds, call.seconds, len({s.device for s in plan.stages}))} "
                f"with {best} micro-batches): running it on {device} (m={one_m}); "
                f"{KEEP_SPLIT} keeps the split")
    return Decision(one_plan, one_m, one_call)


def _verdict(device: str, single: float, split: float, devices: int) -> str:
    """Why one device was chosen, up to the closing parenthesis: predicted faster, or the split
    predicted faster by less than :data:`SPLIT_MARGIN`."""
    if single < split:
        return (f"the whole model on {device} alone is predicted faster than the {devices}-device plan "
                f"({_ms(single)} vs {_ms(split)} per call")
    gain = math.floor(1000 * (1 - split / single) + 1e-9) / 10  # floored: 9.96% is not "10.0%, under 10%"
    return (f"the {devices}-device plan is predicted only {gain:.1f}% faster than the whole "
            f"model on {device} alone, under the {SPLIT_MARGIN:.0%} a split must gain to be kept "
            f"({_ms(split)} vs {_ms(single)} per call")


def _predict(problem: Problem, stages: Sequence[Stage], m: int, profiler: Profiler, overheads: Overheads,
             graphs: dict[int, OpGraph], notes: list[str]) -> CallPrediction:
    """The call of ``stages`` with ``m`` micro-batches, profiling the graph at that size once."""
    if m > 1 and m not in graphs:
        try:
            small = profiler(m)
        except MicrobatchError:
            raise
        except Exception as error:  # noqa: BLE001 - the prediction falls back, and says so
            notes.append(f"m={m}: profiling one micro-batch failed ({type(error).__name__}: {error}); "
                         "its stage times are the whole batch's divided by m")
        else:
            if small is None:
                notes.append(f"m={m}: the plan's cached costs are the whole batch's; stage times are them divided by m")
            else:
                graphs[m] = small
    return callmodel.predict_call(problem, stages, m, microbatch_graph=graphs.get(m), overheads=overheads)


def _single_plans(problem: Problem, plan: Plan) -> list[Plan]:
    """A one-stage plan for every device that holds the whole model (memory, support)."""
    nodes = tuple(problem.graph.topological_order())
    out = []
    for device in problem.cluster.devices:
        try:
            out.append(Plan.build(problem, [Stage(device.name, nodes)], solver=f"one device ({device.name})",
                                  seconds=0.0, lower_bound=plan.lower_bound, status="feasible"))
        except InvalidPlanError:
            continue
    return out


def _best_single(problem: Problem, plan: Plan, profiler: Profiler, overheads: Overheads,
                 graphs: dict[int, OpGraph], notes: list[str]) -> tuple[Plan, int, CallPrediction] | None:
    """The single-device plan with the shortest predicted call, its ``m`` and its prediction."""
    m = problem.pipeline.microbatches if problem.mode == "training" and problem.pipeline is not None else 1
    best: tuple[Plan, int, CallPrediction] | None = None
    for one in _single_plans(problem, plan):
        call = _predict(problem, one.stages, m, profiler, overheads, graphs, notes)
        if best is None or call.seconds < best[2].seconds:
            best = (one, m, call)
    return best


def _decide_latency(problem: Problem, plan: Plan, overheads: Overheads, allow_single_device: bool,
                    given: bool) -> Decision:
    """Latency: one sample per call, the cost model's makespan plus the executor's overheads."""
    def seconds(p: Plan) -> float:
        return p.objective + overheads.per_call + overheads.per_task * len(p.stages)

    mine = seconds(plan)
    plan.meta["call"] = _latency_summary(problem, plan, overheads, mine)
    if len({s.device for s in plan.stages}) < 2 or given:
        return Decision(plan, 1, None)
    singles = sorted(_single_plans(problem, plan), key=seconds)
    if not singles:
        return Decision(plan, 1, None)
    one = singles[0]
    record = {"device": one.stages[0].device, "seconds": seconds(one), "plan_seconds": mine, "plan_microbatches": 1,
              "margin": SPLIT_MARGIN}
    if split_pays(mine, seconds(one)) or not allow_single_device:
        plan.meta["single_device"] = {**record, "chosen": False}
        return Decision(plan, 1, None)
    one.meta["call"] = _latency_summary(problem, one, overheads, seconds(one))
    one.meta["single_device"] = {**record, "chosen": True}
    warn_caller(f"{_verdict(record['device'], seconds(one), mine, len({s.device for s in plan.stages}))}): "
                f"running it on {record['device']}; {KEEP_SPLIT} keeps the split")
    return Decision(one, 1, None)


def _latency_summary(problem: Problem, plan: Plan, overheads: Overheads, seconds: float) -> dict[str, Any]:
    """``plan.meta["call"]`` of a latency call of ``seconds``: its makespan, the executor's overhead,
    and each stage's predicted span (its cost-model time plus the per-task overhead a span sees)."""
    stages = [[i, "F", c.load + overheads.in_span] for i, c in enumerate(costmodel.stage_costs(problem, plan.stages))]
    return {"microbatches": 1, "seconds": seconds, "makespan": plan.objective, "overhead": seconds - plan.objective,
            "stage_seconds": stages}


def _summary(problem: Problem, stages: Sequence[Stage], call: CallPrediction, batch: int | None,
             overheads: Overheads) -> dict[str, Any]:
    out: dict[str, Any] = call.summary()
    out["stage_seconds"] = callmodel.stage_seconds(call, overheads)
    if batch:
        out["batch"] = batch
        out["per_sample"] = callmodel.steady_per_sample(problem, stages, batch)
    return out


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms"
