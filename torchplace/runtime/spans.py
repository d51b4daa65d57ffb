"""What the executors record of a run: one span per stage pass, for traces and fidelity.

Every executor appends a :class:`StageSpan` per (stage, micro-batch, pass) it runs, stamped with
``time.perf_counter()`` on the worker's thread: two clock reads and one list append per stage,
negligible beside a stage's work. On CUDA the stamps are host times around the stage's launches
(the work itself may finish later on the stream); :mod:`torchplace.report.trace` writes them as a
Chrome / Perfetto trace.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageSpan"]


@dataclass(frozen=True)
class StageSpan:
    """When one stage ran on one micro-batch (``time.perf_counter`` seconds).

    Attributes:
        stage: the stage's index in the executor's stage list.
        worker: the worker key (the plan's device name) whose thread ran it.
        start, finish: perf_counter seconds.
        microbatch: the micro-batch (0 in latency mode).
        kind: ``"F"`` forward or ``"B"`` backward (training).
    """

    stage: int
    worker: str
    start: float
    finish: float
    microbatch: int = 0
    kind: str = "F"

    @property
    def seconds(self) -> float:
        return self.finish - self.start
