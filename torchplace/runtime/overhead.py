"""The pipeline executor's own cost per call and per (stage, micro-batch), measured on this machine.

A stage's profiled time is its operators' time. Running it in a
:class:`~torchplace.runtime.pipeline.PipelineExecutor` adds a fixed cost per task (the stage's
Python dispatch, reading and writing the carry, recording a span, the queue hand-off that wakes the
next worker) and per call (scattering the batch, submitting the workers' orders, gathering). The
call-time prediction (:mod:`torchplace.callmodel`) adds them to its clock; they are measured here,
once per process, on the executor itself:

two stages of one trivial operator each on two workers, run with ``1`` and with ``M`` micro-batches.
By the inference clock a call costs ``c + 2 o`` with one micro-batch and ``c + (M + 1) o`` with
``M``, so ``o = (T(M) - T(1)) / (M - 1)`` and ``c = T(1) - 2 o`` (medians over repeated calls; the
trivial operators' microseconds count as overhead). The part of ``o`` a measured span sees
(``Overheads.in_span``) is the median span of those trivial stages.
"""
from __future__ import annotations

import functools
import statistics
import time

import torch
from torch import fx, nn

from torchplace.callmodel import Overheads
from torchplace.runtime.graph_io import GraphIO
from torchplace.runtime.pipeline import PipelineExecutor
from torchplace.runtime.split import compute_nodes, split_stages

__all__ = ["executor_overheads", "measure_overheads"]

_M = 16
"""Micro-batches of the long run."""


class _Two(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + 1) * 2


def measure_overheads(repeats: int = 15, microbatches: int = _M) -> Overheads:
    """Measure :class:`~torchplace.callmodel.Overheads` now (see the module docstring); a
    negative estimate (noise on a loaded machine) is clamped to 0."""
    gm = fx.symbolic_trace(_Two())
    names = [n.name for n in compute_nodes(gm.graph)]
    stages = split_stages(gm, {name: i for i, name in enumerate(names)}, len(names))
    workers = [f"overhead:{i}" for i in range(len(stages))]
    executor = PipelineExecutor(stages, ["cpu"] * len(stages), workers, GraphIO(gm))
    x = torch.zeros(microbatches, 4)

    spans: list[float] = []

    def timed(m: int) -> float:
        runs = []
        with torch.no_grad():
            for i in range(repeats + 2):
                start = time.perf_counter()
                executor.run((x,), {}, m)
                if i >= 2:
                    runs.append(time.perf_counter() - start)
                    spans.extend(s.seconds for s in executor.last_spans)
        return statistics.median(runs)

    one, many = timed(1), timed(microbatches)
    per_task = max(0.0, (many - one) / (microbatches - 1))
    return Overheads(per_task=per_task, per_call=max(0.0, one - len(stages) * per_task),
                     in_span=min(per_task, statistics.median(spans)))


@functools.cache
def executor_overheads() -> Overheads:
    """:func:`measure_overheads`, measured on first use and kept for the process."""
    return measure_overheads()
