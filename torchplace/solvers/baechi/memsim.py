"""Dynamic memory of a latency plan over time (Baechi Sec. 4.1-4.2, "Dynamic Memory Allocation").

Baechi's execution simulator tracks memory as TensorFlow allocates it, which is far below the sum
of every operator's needs (Inception-V3: 4 GB in use against 22 GB summed). On the schedule of
:func:`torchplace.costmodel.simulate`, per device:

* **persistent**: ``param_bytes`` of every node on the device, held for the whole run;
* **temporary**: ``temp_bytes`` of a node, from its start to its finish;
* **output**: ``output_bytes`` of a node, from its start (the operator writes its output buffer;
  Baechi: "when an operator executes ... the device allocates temporary memory, and separate
  memory for its output tensors") until its last consumer on the device and its last outgoing
  transfer have finished; a node without consumers keeps its output (a result of the model) to the
  end;
* **received copy**: a tensor sent to another device occupies ``output_bytes`` there from the
  start of the transfer (the producer's finish for a transfer of zero time) until its last consumer
  there finishes (a device caches a received tensor, Sec. 4.2).

Intervals are half-open ``[begin, end)``: a buffer freed at ``t`` is gone before one allocated at
``t`` appears; a zero-length interval (a node of zero time) still counts at its instant.

Static vs dynamic. Placement uses the static model of :func:`torchplace.costmodel.memory`
(``param + temp`` summed over the device's nodes), which :meth:`Plan.validate` checks. It does *not*
bound the dynamic peak from above in general: it has no term for outputs, and none for tensors
received from other devices (a device holding one node of 0 static bytes that receives a 100-byte
tensor peaks at 100). What does hold is, per device,

    peak <= static + sum of output_bytes of its nodes + sum of output_bytes it receives,

since ops on one device run one at a time (only one temporary is live) and every other term is
counted at most once; tests check this certificate.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from torchplace import costmodel
from torchplace.costmodel import StageLike, Transfer
from torchplace.problem import Problem

__all__ = ["MemoryTrace", "memory_intervals", "simulate_memory"]


@dataclass(frozen=True)
class MemoryTrace:
    """Dynamic memory of a plan.

    Attributes:
        peak: device -> highest bytes in use at any time.
        timeline: device -> ``(time, bytes in use from then on)`` at every change, in time order
            (a zero-length buffer shows as a rise and a fall at one time).
    """

    peak: dict[str, int]
    timeline: dict[str, list[tuple[float, int]]]


def memory_intervals(problem: Problem, stages: Sequence[StageLike]) -> dict[str, list[tuple[float, float, int]]]:
    """Per device, every buffer as ``(begin, end, bytes)`` on the simulated schedule (module docstring)."""
    g = problem.graph
    sched = costmodel.simulate(problem, stages)
    sent: dict[tuple[str, str], Transfer] = {(t.node, t.dst): t for t in sched.transfers}
    out: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for dev, nodes in sched.order.items():
        for v in nodes:
            r = g.record(v)
            out[dev].append((0.0, math.inf, r.param_bytes))
            out[dev].append((sched.start[v], sched.finish[v], r.temp_bytes))
    for u, dev in sched.device_of.items():
        nbytes = g.record(u).output_bytes
        consumers: dict[str, float] = defaultdict(float)
        for w in g.successors(u):
            consumers[sched.device_of[w]] = max(consumers[sched.device_of[w]], sched.finish[w])
        if not consumers:
            out[dev].append((sched.start[u], math.inf, nbytes))
            continue
        end = max(consumers.get(dev, sched.finish[u]), sched.finish[u])
        for dst, last in consumers.items():
            if dst == dev:
                continue
            t = sent.get((u, dst))
            begin, arrived = (t.start, t.finish) if t is not None else (sched.finish[u], sched.finish[u])
            end = max(end, arrived)
            out[dst].append((begin, last, nbytes))
        out[dev].append((sched.start[u], end, nbytes))
    return dict(out)


def simulate_memory(problem: Problem, plan: object) -> MemoryTrace:
    """Per-device bytes in use over one simulated sample of ``plan`` (anything with ``.stages``).

    Example:
        >>> simulate_memory(problem, plan).peak          # doctest: +SKIP
        {'acc0': 1200, 'cpu0': 300}
    """
    peak: dict[str, int] = {}
    timeline: dict[str, list[tuple[float, int]]] = {}
    for dev, intervals in memory_intervals(problem, plan.stages).items():  # type: ignore[attr-defined]
        peak[dev], timeline[dev] = _sweep(intervals)
    return MemoryTrace(peak, timeline)


def _sweep(intervals: list[tuple[float, float, int]]) -> tuple[int, list[tuple[float, int]]]:
    """Peak and timeline of half-open intervals; a zero-length one counts at its instant.

    At each time, frees of ending buffers come first, then allocations (the timeline's point for
    that time), then the frees of zero-length buffers (a second point at the same time).
    """
    delta: dict[float, list[int]] = defaultdict(lambda: [0, 0])  # time -> [ends and begins, instant ends]
    for begin, end, nbytes in intervals:
        if nbytes == 0:
            continue
        delta[begin][0] += nbytes
        if end == begin:
            delta[end][1] -= nbytes
        elif math.isfinite(end):
            delta[end][0] -= nbytes
    used = best = 0
    timeline: list[tuple[float, int]] = []
    for t in sorted(delta):
        change, instant = delta[t]
        used += change
        best = max(best, used)
        if change or instant:
            timeline.append((t, used))
        if instant:
            used += instant
            timeline.append((t, used))
    return best, timeline
