"""What one call of a placed pipeline costs: the schedule's clock, run with micro-batch stage times.

:func:`torchplace.costmodel.evaluate` gives the *steady state*: the max device load, the time per
batch a pipeline approaches when it never stops (Tarnawski et al. 2020, Sec. 5.1), which is what
the solvers minimise (the papers' throughput). One call of a placed model is not a steady state:
it splits its batch into ``m`` micro-batches, fills the pipeline, runs, and drains it. With ``K``
equal stages GPipe is idle for the bubble fraction ``(K - 1) / (m + K - 1)`` of the call (Huang et
al., "GPipe", https://arxiv.org/abs/1811.06965, Sec. 2.3), so with 2 stages a call reaches at most
``m / (m + 1)`` of the steady state's throughput. Each micro-batch also pays a fixed cost per stage
(Python dispatch, the queue hand-off between workers), and a stage's time on a batch of
``B / m`` samples is not its time on ``B`` samples divided by ``m`` (small batches use the cores
less well).

This module predicts the call. It runs the very schedules the executors run
(:mod:`torchplace.runtime.schedule`: :func:`~torchplace.runtime.schedule.worker_orders` for the
inference fill-drain, :func:`~torchplace.runtime.schedule.training_schedule` for GPipe and 1F1B
training) on a clock, with

- each stage's seconds *per micro-batch* (:func:`microbatch_stage_times`: its compute measured at
  the micro-batch size when a graph profiled at that size is given, plus its share of the
  transfers, which scale with the bytes);
- :class:`Overheads`: seconds per (stage, micro-batch) task and per call, measured once per
  process on the executor itself (:mod:`torchplace.runtime.overhead`).

Logical CPU devices that share this machine's cores (:func:`core_pools`) never compute at the
same time on the clock: each of their ops takes every core, so running two at once only
interleaves them. The inference clock follows :class:`~torchplace.runtime.pipeline.PipelineExecutor` exactly:
consecutive stages on one worker form a segment; a worker takes its (micro-batch, segment) pairs in
``worker_orders`` order, each once the micro-batch has left the segment before; the queues
between segments hold at most ``queue_size`` micro-batches, so a worker that finished a pair waits
until its consumer took the micro-batch ``queue_size`` places earlier. The training clock follows
:class:`~torchplace.runtime.training.TrainingExecutor`: each worker runs its actions in the global
order's sequence; a forward waits for the stage before, a backward for the stage after (the last
stage's for its own forward, which computes the loss).

Nothing here imports torch (the runtime's schedule module is imported on first use); solvers keep
minimising the steady state, and ``place()`` uses the call to choose ``m`` and to compare a plan
with the whole model on one device (:mod:`torchplace.callplan`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torchplace import costmodel
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem

__all__ = [
    "KEEP_SPLIT",
    "CallPrediction",
    "Overheads",
    "core_pools",
    "Task",
    "describe",
    "microbatch_stage_times",
    "predict_call",
    "simulate_inference",
    "simulate_training",
    "stage_seconds",
    "steady_per_sample",
    "training_microbatch_times",
]

KEEP_SPLIT = "allow_single_device=False (torchplace plan: --keep-split)"
"""What keeps a split that one device is predicted to beat, in the API and on the command line."""


@dataclass(frozen=True)
class Overheads:
    """Fixed costs of the executor, beyond the stages' compute and transfers.

    Attributes:
        per_task: seconds each (stage, micro-batch) pays: the stage's Python dispatch, reading and
            writing its carry, the queue hand-off to the next worker.
        per_call: seconds each call pays once: scattering the batch, handing the workers their
            orders, gathering the outputs.
        in_span: the part of ``per_task`` inside a task's measured span
            (:class:`~torchplace.runtime.spans.StageSpan`: reading and writing the carry, calling
            the stage); the rest (dispatch, hand-off) lies between spans.
    """

    per_task: float = 0.0
    per_call: float = 0.0
    in_span: float = 0.0


@dataclass(frozen=True)
class Task:
    """One stage's pass over one micro-batch in a predicted call (seconds from the call's start)."""

    worker: str
    stage: int
    microbatch: int
    kind: str
    start: float
    finish: float


@dataclass(frozen=True)
class CallPrediction:
    """The predicted time of one call with ``microbatches`` micro-batches.

    ``seconds = fill + steady + drain + per_call``: the busiest worker (the bottleneck) is idle
    until ``fill`` (the pipeline filling), busy or waiting on its neighbours for ``steady``, and
    the call ends ``drain`` after its last task; ``per_call`` is the executor's fixed cost.

    Attributes:
        microbatches: ``m``.
        seconds: predicted wall seconds of one call.
        fill, steady, drain: the parts of the clock (see above).
        per_call: the executor's fixed seconds per call.
        overhead: the per-task and per-call overheads inside ``seconds``.
        tasks: every stage pass, as the clock ran it.
    """

    microbatches: int
    seconds: float
    fill: float
    steady: float
    drain: float
    per_call: float
    overhead: float
    tasks: tuple[Task, ...]

    def summary(self) -> dict[str, float]:
        """The numbers without the tasks (what a plan keeps in its ``meta``)."""
        out = asdict(self)
        del out["tasks"]
        return out


def _prediction(tasks: list[Task], m: int, overheads: Overheads) -> CallPrediction:
    """Wrap a clock's tasks: split the call into fill, steady state and drain around the busiest worker."""
    end = max((t.finish for t in tasks), default=0.0)
    busy: dict[str, float] = {}
    for t in tasks:
        busy[t.worker] = busy.get(t.worker, 0.0) + t.finish - t.start
    if not tasks:
        return CallPrediction(m, overheads.per_call, 0.0, 0.0, 0.0, overheads.per_call, overheads.per_call, ())
    bottleneck = max(busy, key=lambda w: (busy[w], w))
    mine = [t for t in tasks if t.worker == bottleneck]
    fill = min(t.start for t in mine)
    drain = end - max(t.finish for t in mine)
    overhead = overheads.per_call + overheads.per_task * len(tasks)
    return CallPrediction(m, end + overheads.per_call, fill, end - fill - drain, drain, overheads.per_call, overhead,
                          tuple(sorted(tasks, key=lambda t: (t.start, t.stage))))


def simulate_inference(stage_times: Sequence[tuple[str, float]], microbatches: int,
                       overheads: Overheads = Overheads(), queue_size: int = costmodel.QUEUE_SIZE,
                       pools: Mapping[str, str] | None = None) -> CallPrediction:
    """The clock of one inference call of a :class:`~torchplace.runtime.pipeline.PipelineExecutor`.

    Args:
        stage_times: ``(worker, seconds per micro-batch)`` of each stage, in plan order.
        microbatches: ``m`` (at least 1).
        overheads: added to every task and once to the call.
        queue_size: capacity of the queues between segments (the executor's ``queue_size``).
        pools: worker -> the cores it computes on (:func:`core_pools`); workers of one pool never
            compute at the same time (each would take all its cores). A worker not listed has
            its own.

    Returns:
        The :class:`CallPrediction`.

    Raises:
        ValueError: for ``m < 1`` or ``queue_size < 1``.

    Example:
        Two stages of 1 s on two workers, three micro-batches: fill 1 s, steady 3 s, no drain
        on the busiest (last) worker; the GPipe bubble is ``(K-1)/(m+K-1) = 1/4`` of the call.

        >>> simulate_inference([("a", 1.0), ("b", 1.0)], 3).seconds
        4.0
        >>> simulate_inference([("a", 1.0), ("b", 1.0)], 3, pools={"a": "cpu", "b": "cpu"}).seconds
        6.0
    """
    from torchplace.runtime.schedule import segments, worker_orders

    if microbatches < 1 or queue_size < 1:
        raise ValueError(f"need microbatches >= 1 and queue_size >= 1, got {microbatches} and {queue_size}")
    segs = segments([w for w, _ in stage_times])
    last = len(segs) - 1
    pending = {w: list(o) for w, o in worker_orders(microbatches, [w for w, _ in segs]).items()}
    pool = {w: (pools or {}).get(w, w) for w in pending}
    pool_free = dict.fromkeys(pool.values(), 0.0)
    free = dict.fromkeys(pending, 0.0)
    put: dict[tuple[int, int], float] = {}  # (micro-batch, segment) -> when it entered the next queue
    took: dict[tuple[int, int], float] = {}  # (micro-batch, segment) -> when the segment's worker took it
    waiting: dict[str, tuple[int, int, float]] = {}  # worker -> the pair it is trying to put, and since when
    tasks: list[Task] = []
    while any(pending.values()) or waiting:
        progressed = False
        for worker in pending:
            if worker in waiting:  # a bounded queue: wait until the consumer took the pair queue_size back
                i, seg, done = waiting[worker]
                blocker = (i - queue_size, seg + 1)
                if seg < last and blocker[0] >= 0 and blocker not in took:
                    continue
                put[(i, seg)] = free[worker] = max(done, took.get(blocker, 0.0)) if seg < last else done
                del waiting[worker]
                progressed = True
        # Of the workers whose next pair is ready, the one that can start first takes its cores
        # (with no shared pools the order changes nothing: each worker keeps its own sequence).
        ready = {}
        for worker, order in pending.items():
            if worker in waiting or not order:
                continue
            i, seg = order[0]
            if seg > 0 and (i, seg - 1) not in put:
                continue
            ready[worker] = max(free[worker], put.get((i, seg - 1), 0.0), pool_free[pool[worker]])
        if ready:
            worker = min(ready, key=lambda w: (ready[w], w))
            i, seg = pending[worker].pop(0)
            t = took[(i, seg)] = ready[worker]
            for s in segs[seg][1]:
                dur = stage_times[s][1] + overheads.per_task
                tasks.append(Task(worker, s, i, "F", t, t + dur))
                t += dur
            pool_free[pool[worker]] = t
            waiting[worker] = (i, seg, t)
            progressed = True
        if not progressed:
            raise AssertionError("worker_orders gave an order the pipeline cannot run")
    return _prediction(tasks, microbatches, overheads)


def simulate_training(stage_times: Sequence[tuple[str, float, float]], microbatches: int, schedule: str,
                      overheads: Overheads = Overheads(), pools: Mapping[str, str] | None = None) -> CallPrediction:
    """The clock of one training step of a :class:`~torchplace.runtime.training.TrainingExecutor`.

    Args:
        stage_times: ``(worker, forward seconds, backward seconds)`` per micro-batch of each
            forward stage, in plan order.
        microbatches: ``m``.
        schedule: ``"gpipe"`` or ``"1f1b"`` (:func:`~torchplace.runtime.schedule.training_schedule`).
        overheads: added to every forward and backward task and once to the step.
        pools: worker -> the cores it computes on, as for :func:`simulate_inference`.

    Returns:
        The :class:`CallPrediction` (tasks of kind ``"F"`` and ``"B"``).

    Example:
        >>> simulate_training([("a", 1.0, 2.0), ("b", 1.0, 2.0)], 2, "gpipe").seconds
        9.0
    """
    from torchplace.runtime.schedule import per_worker, training_schedule

    n = len(stage_times)
    workers = [w for w, _, _ in stage_times]
    orders = {w: list(o) for w, o in per_worker(training_schedule(schedule, microbatches, n), workers).items()}
    pool = {w: (pools or {}).get(w, w) for w in orders}
    pool_free = dict.fromkeys(pool.values(), 0.0)
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    tasks: list[Task] = []
    while any(orders.values()):
        ready = {}
        for worker, order in orders.items():
            if not order:
                continue
            a = order[0]
            if a.kind == "F":
                deps = [("F", a.microbatch, a.stage - 1)] if a.stage > 0 else []
            else:
                deps = [("B", a.microbatch, a.stage + 1)] if a.stage < n - 1 else [("F", a.microbatch, n - 1)]
            if any(d not in done for d in deps):
                continue
            ready[worker] = max([free[worker], pool_free[pool[worker]], *(done[d] for d in deps)])
        if not ready:
            raise AssertionError("the training schedule cannot run")
        worker = min(ready, key=lambda w: (ready[w], w))  # the first that can start takes its cores
        a, start = orders[worker].pop(0), ready[worker]
        dur = (stage_times[a.stage][1] if a.kind == "F" else stage_times[a.stage][2]) + overheads.per_task
        free[worker] = pool_free[pool[worker]] = done[(a.kind, a.microbatch, a.stage)] = start + dur
        tasks.append(Task(worker, a.stage, a.microbatch, a.kind, start, start + dur))
    return _prediction(tasks, microbatches, overheads)


def core_pools(problem: Problem) -> dict[str, str]:
    """Device -> the cores it computes on. Logical CPU devices without threads of their own
    (``Device.threads`` is ``None``: each op takes every core, as ``place()`` profiled it) share
    this machine's cores, so two of their stages cannot really run at once: measured on 2 cores,
    a 2-stage GPT-2 pipeline over ``cpu:0``/``cpu:1`` took 1.4x the unsplit model's time per
    call where a clock that let them overlap predicted half. Devices with their own threads
    (``share_cores=True``, ``Device(threads=)``) and accelerators compute on their own."""
    return {d.name: "cpu" if d.torch_device == "cpu" and d.threads is None else d.name
            for d in problem.cluster.devices}


def microbatch_stage_times(problem: Problem, stages: Sequence[costmodel.StageLike], microbatches: int,
                           microbatch_graph: OpGraph | None = None) -> list[tuple[str, float]]:
    """``(device, seconds per micro-batch)`` of each stage, in plan order.

    A stage's compute is :func:`~torchplace.costmodel.stage_costs` on ``microbatch_graph`` (the
    same graph profiled on one micro-batch, ``B / m`` samples) when given, else its compute on
    the whole batch divided by ``m``; its transfers are the whole batch's divided by ``m`` (they
    scale with the bytes).
    """
    full = costmodel.stage_costs(problem, stages)
    if microbatch_graph is None:
        return [(c.device, c.load / microbatches) for c in full]
    small = costmodel.stage_costs(_with_graph(problem, microbatch_graph), stages)
    return [(c.device, s.compute + (c.transfer_in + c.transfer_out) / microbatches) for c, s in zip(full, small)]


def training_microbatch_times(problem: Problem, stages: Sequence[costmodel.StageLike], microbatches: int,
                              microbatch_graph: OpGraph | None = None) -> list[tuple[str, float, float]]:
    """``(device, forward, backward)`` seconds per micro-batch of each forward stage
    (:func:`~torchplace.costmodel.training_stage_times`): on ``microbatch_graph`` (the training
    graph profiled on one micro-batch, transfers of its bytes) when given, else the whole batch's
    times divided by ``m``."""
    if microbatch_graph is not None:
        return costmodel.training_stage_times(_with_graph(problem, microbatch_graph), stages)
    return [(d, f / microbatches, b / microbatches) for d, f, b in costmodel.training_stage_times(problem, stages)]


def predict_call(problem: Problem, stages: Sequence[costmodel.StageLike], microbatches: int, *,
                 microbatch_graph: OpGraph | None = None, overheads: Overheads = Overheads(),
                 queue_size: int = 2) -> CallPrediction:
    """The predicted time of one call of ``stages`` with ``microbatches`` micro-batches: an
    inference call (:func:`simulate_inference`) or, for a training problem with a pipeline, one
    training step under its schedule (:func:`simulate_training`).

    Raises:
        ValueError: for a latency problem (one sample: its call is :func:`~torchplace.costmodel.simulate`).
    """
    if problem.objective == "latency":
        raise ValueError("a latency plan runs one sample per call: its time is costmodel.simulate's makespan")
    pools = core_pools(problem)
    if problem.mode == "training" and problem.pipeline is not None:
        times = training_microbatch_times(problem, stages, microbatches, microbatch_graph)
        return simulate_training(times, microbatches, problem.pipeline.schedule, overheads, pools)
    times_ = microbatch_stage_times(problem, stages, microbatches, microbatch_graph)
    return simulate_inference(times_, microbatches, overheads, queue_size, pools)


def stage_seconds(call: CallPrediction, overheads: Overheads = Overheads()) -> list[list[Any]]:
    """``[stage, pass, seconds]`` per stage pass (``"F"``, ``"B"``): the time its tasks take in the
    predicted call, summed over the micro-batches, less the part of ``overheads.per_task`` that
    lies outside a span: what a measured run's spans of that stage add up to
    (:func:`torchplace.report.fidelity.compare`)."""
    outside = overheads.per_task - overheads.in_span
    total: dict[tuple[int, str], float] = {}
    for t in call.tasks:
        total[(t.stage, t.kind)] = total.get((t.stage, t.kind), 0.0) + t.finish - t.start - outside
    return [[i, kind, seconds] for (i, kind), seconds in sorted(total.items())]


def steady_per_sample(problem: Problem, stages: Sequence[costmodel.StageLike], batch: int) -> float:
    """The steady state's seconds per sample: the max device load (the solvers' objective, for the
    whole batch) over the batch size."""
    return costmodel.evaluate_stages(problem, stages)[0] / max(batch, 1)


def _with_graph(problem: Problem, graph: OpGraph) -> Problem:
    """``problem`` on ``graph`` (profiled on one micro-batch), each node's time at most its time on
    the whole batch: an operator does not get slower on fewer samples, so a micro-batch time above
    it is a measurement outlier (a new shape's first kernels: oneDNN's JIT, cuBLAS's heuristics).
    Measured on an H100 machine: a CPU stage of 0.39 ms on the batch was timed at 17 ms per
    micro-batch, and the call was predicted at 69 ms where it ran in 6.7 ms."""
    from dataclasses import replace

    full = problem.graph

    def bounded(v: str, r: NodeRecord) -> NodeRecord:
        whole = full.record(v).times if v in full else {}
        return replace(r, times={k: min(t, whole.get(k, t)) for k, t in r.times.items()})

    return replace(problem, graph=graph.with_records(bounded))


def describe(meta: Mapping[str, Any]) -> list[str]:
    """The lines a plan prints about its predicted call and the single-device comparison, from its
    ``meta["call"]`` (:meth:`CallPrediction.summary` plus ``batch`` and ``per_sample``, the steady
    state's seconds per sample) and ``meta["single_device"]`` (:mod:`torchplace.callplan`)."""
    lines = []
    call = meta.get("call") or {}
    if "fill" in call:
        m = int(call["microbatches"])
        line = (f"predicted call: {_ms(call['seconds'])} with m={m} micro-batch{'es' if m != 1 else ''} "
                f"(fill {_ms(call['fill'])}, steady {_ms(call['steady'])}, drain {_ms(call['drain'])}; "
                f"executor overheads {_ms(call['overhead'])} of it)")
        if "per_sample" in call and "batch" in call:
            line += (f"; steady state {_ms(call['per_sample'])} per sample "
                     f"({_ms(call['per_sample'] * call['batch'])} per batch of {call['batch']})")
        lines.append(line)
        if "tried" in call:
            lines.append("microbatches='auto' tried " + ", ".join(f"m={k}: {_ms(v)}" for k, v in call["tried"].items()))
    elif call:
        lines.append(f"predicted call: {_ms(call['seconds'])} (makespan {_ms(call['makespan'])} + executor "
                     f"overheads {_ms(call['overhead'])})")
    lines += [f"note: {note}" for note in call.get("notes", ())]
    single = meta.get("single_device")
    if single and single.get("device") and single.get("chosen"):
        versus = (f"faster than the split plan's {_ms(single['plan_seconds'])}"
                  if single["seconds"] < single["plan_seconds"] else
                  f"and the split plan at {_ms(single['plan_seconds'])}, less than the "
                  f"{single.get('margin', 0.0):.0%} faster a split must be to be kept")
        lines.append(f"one device: the whole model on {single['device']} is predicted at {_ms(single['seconds'])} "
                     f"per call, {versus}: running on "
                     f"{single['device']} alone; {KEEP_SPLIT} keeps the split")
    elif single and single.get("device") and single["seconds"] < single["plan_seconds"]:
        lines.append(f"one device: the whole model on {single['device']} is predicted at {_ms(single['seconds'])} "
                     f"per call, faster than this split ({_ms(single['plan_seconds'])}); kept the split because of "
                     f"{KEEP_SPLIT}")
    elif single and single.get("device"):
        lines.append(f"one device: the split plan ({_ms(single['plan_seconds'])} per call) beats the whole model "
                     f"on the best single device, {single['device']} ({_ms(single['seconds'])})")
    elif single:
        lines.append("one device: no single device holds the whole model")
    return lines


def _ms(seconds: float) -> str:
    return "nan" if not math.isfinite(seconds) else f"{1e3 * seconds:.4g} ms"
