"""Run one sample with every device working at once: the latency-mode executor.

How it works (one :meth:`LatencyExecutor.run` call):

* A *board* holds every value by name: first the model inputs, then each stage's outputs as the
  stage finishes. Each worker key (a device) runs its stages in plan order; a stage starts as
  soon as every input it reads is on the board. Stages on different workers therefore overlap
  whenever the plan's data flow allows it (MOIRAI Sec. III-D, Baechi Sec. 4.2: "an operator runs
  as soon as its inputs arrive"), and a worker's order is the order the plan (and the cost
  model's simulation) gives it. A stage also waits for the earlier stages its in-place ordering
  edges name (``StageModule.waits_for``): a reader of a value before a write, a writer before a
  later reader. Those edges go forward in plan order too, so the run still cannot deadlock.
* The board keeps every value where it was made and one copy per other device
  (:class:`~torchplace.runtime.values.Values`); after a stage that writes memory in place, stale
  copies are forgotten and written model inputs are copied back into the caller's tensors.
* The first worker runs in the calling thread; every other worker has a daemon thread that the
  executor starts on its first run and keeps, fed one job per run through a queue (starting
  threads on every call costs more than the small stages of a latency plan). Runs of one
  executor take turns (a lock), so jobs of two runs never interleave.
* The plan's stage order sends every edge to the same or a later stage, so a worker never waits
  for a value that its own later stage produces: the run cannot deadlock.
* CUDA: each worker runs its stages on its own stream per CUDA device and records an event after
  each stage; a consumer on the same device waits on the event in its stream, others synchronize
  on it (:mod:`torchplace.runtime.devices`).
* A value is dropped from the board once every stage that reads it has run (model outputs stay
  until the end).
* Failure: a stage that raises records a :class:`~torchplace.errors.StageError` (chained from the
  original) and stops every worker; waits poll a stop event, so nothing waits forever. Ctrl-C in
  the calling thread stops the workers the same way and propagates as ``KeyboardInterrupt``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchplace.errors import StageError
from torchplace.machine import intra_op_threads
from torchplace.runtime.devices import (
    as_stage_error,
    autograd_mode,
    caller_autocast,
    normalize_device,
    stream_context,
    wait_for_producers,
)
from torchplace.runtime.params import StageParameters
from torchplace.runtime.spans import StageSpan
from torchplace.runtime.split import StageModule
from torchplace.runtime.values import Values, written_inputs
from torchplace.runtime.workers import WorkerThreads

__all__ = ["LatencyExecutor", "StageSpan"]

_POLL_S = 0.05
"""Seconds a wait for a value blocks before checking the stop event again."""

_STOP_S = 2.0
"""Seconds a failed or interrupted run waits for the other workers to notice the stop."""


class _Stopped(Exception):
    """Raised inside a worker when the run's stop event is set."""


@dataclass
class _Board:
    """Values by name, with the CUDA event that produced each, and the run's stop/error state."""

    values: Values
    readers: dict[str, int]
    keep: frozenset[str]
    events: dict[str, list[tuple[torch.device, Any]]] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    spans: list[StageSpan] = field(default_factory=list)
    busy: int = 0  # pool workers still running their job for this run

    def wait_for(self, names: Sequence[str], stages: Sequence[int]) -> None:
        """Until every value in ``names`` exists and every stage in ``stages`` has finished."""
        with self.cond:
            while not (all(n in self.values for n in names) and self.finished.issuperset(stages)):
                if self.stop.is_set():
                    raise _Stopped
                self.cond.wait(_POLL_S)

    def take(self, names: Sequence[str], place: str, device: torch.device, stream: Any) -> list[Any]:
        """The values of ``names`` for a stage on plan device ``place`` (torch device ``device``)."""
        with self.cond:
            events = [e for n in names for e in self.events.get(n, [])]
        wait_for_producers(events, device, stream)
        with stream_context(stream):
            return [self.values.get(n, place, device, stream) for n in names]

    def release(self, names: Sequence[str], writes: Sequence[str], place: str) -> None:
        """After a stage read ``names`` and wrote ``writes`` in place: apply the writes
        (:meth:`Values.wrote`) and drop each value no later stage reads."""
        with self.cond:
            self.values.wrote(writes, place)
            for n in names:
                self.readers[n] -= 1
                if self.readers[n] == 0 and n not in self.keep:
                    self.values.drop(n)

    def publish(self, stage: int, place: str, items: Mapping[str, Any], events: list[tuple[torch.device, Any]]) -> None:
        with self.cond:
            self.values.put(items.items(), place)
            for name in items:
                self.events[name] = events
            self.finished.add(stage)
            self.cond.notify_all()

    def done(self) -> None:
        with self.cond:
            self.busy -= 1
            self.cond.notify_all()

    def wait_done(self, timeout: float | None = None) -> bool:
        """Wait until every pool worker has finished this run's job; False if ``timeout`` passed."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self.cond:
            while self.busy:
                if deadline is not None and time.perf_counter() >= deadline:
                    return False
                self.cond.wait(_POLL_S)  # a timed wait, so Ctrl-C reaches the caller
        return True

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.stop.set()
            self.cond.notify_all()


class LatencyExecutor:
    """Run a model's stages for one sample, each device's stages on its own worker thread.

    Args:
        stages: the stages from :func:`~torchplace.runtime.split.split_stages`, in plan order.
        stage_devices: the torch device of each stage; parameters are moved there at construction
            (the original model is left untouched).
        stage_workers: the worker key of each stage (the plan's device name): stages sharing a key
            run one after another, in plan order, on its thread.
        graph_io: a :class:`~torchplace.runtime.graph_io.GraphIO` of the split model.
        isolate: give every worker its own memory even on one torch device (a test aid, see
            :class:`~torchplace.runtime.values.Values`).
        stage_threads: intra-op threads of each stage's worker (``Device.threads``; ``None``:
            the process's setting), applied in the worker's thread.

    Attributes:
        last_spans: when each stage ran in the last :meth:`run`, in finishing order.
    """

    def __init__(
        self,
        stages: list[StageModule],
        stage_devices: list[str],
        stage_workers: list[str],
        graph_io: Any,
        isolate: bool = False,
        stage_threads: Sequence[int | None] | None = None,
    ) -> None:
        if not len(stages) == len(stage_devices) == len(stage_workers):
            raise ValueError(
                f"stages, stage_devices and stage_workers need one entry per stage (stages: {len(stages)}, "
                f"stage_devices: {len(stage_devices)}, stage_workers: {len(stage_workers)})"
            )
        if not stages:
            raise ValueError("a latency executor needs at least one stage")
        self.stages = list(stages)
        self.devices = [normalize_device(d) for d in stage_devices]
        self.workers = list(stage_workers)
        self.graph_io = graph_io
        self.isolate = isolate
        self._written_inputs = written_inputs(self.stages, graph_io)
        self._order: dict[str, list[int]] = {}
        for index, worker in enumerate(self.workers):
            self._order.setdefault(worker, []).append(index)
        self._streams = {
            (w, d): torch.cuda.Stream(d) for w, d in zip(self.workers, self.devices) if d.type == "cuda"
        }
        self._readers: dict[str, int] = {}
        for stage in self.stages:
            for name in stage.inputs:
                self._readers[name] = self._readers.get(name, 0) + 1
        self.last_spans: list[StageSpan] = []
        self._lock = threading.Lock()
        self._threads = WorkerThreads("latency", {w: n for w, n in zip(self.workers, stage_threads or ())})
        self.stage_params = StageParameters(self.stages, self.devices, self.workers, isolate)

    def run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """Compute the model on ``(args, kwargs)``; returns what the model returns.

        Raises:
            StageError: if a stage raised; ``__cause__`` is the original exception.
        """
        with self._lock:
            self.stage_params.refresh()
            bound = self.graph_io.bind_inputs(args, kwargs)
            board = _Board(Values(bound, bound, self.isolate, self._written_inputs), dict(self._readers),
                           frozenset(self.graph_io.output_names))
            mode = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), caller_autocast())
            first, *others = self._order
            try:
                for worker in others:
                    with board.cond:
                        board.busy += 1  # only jobs actually queued are waited for
                    self._threads.submit(worker, self._pool_job, board, worker, mode)
                with intra_op_threads(self._threads.threads.get(first)):  # the caller's thread works too
                    self._work(board, first, mode)
                board.wait_done()
            except BaseException as error:  # Ctrl-C: stop the others before it propagates
                board.fail(error)
                board.wait_done(_STOP_S)
                raise
            finally:
                self.last_spans = list(board.spans)
            if board.error is not None:
                raise board.error
            names = list(self.graph_io.output_names)
            for name in names:
                wait_for_producers(board.events.get(name, []), torch.device("cpu"), None)
            board.values.finish()
            return self.graph_io({n: board.values.originals[n] for n in names})

    def _pool_job(self, board: _Board, worker: str, mode: tuple[bool, bool]) -> None:
        try:
            self._work(board, worker, mode)
        except BaseException as error:  # noqa: BLE001 - the pool thread must live on for later runs
            board.fail(error)
        finally:
            board.done()

    def _work(self, board: _Board, worker: str, mode: tuple[bool, bool]) -> None:
        try:
            with autograd_mode(*mode):
                for index in self._order[worker]:
                    self._run_stage(board, worker, index)
        except _Stopped:
            return
        except Exception as error:  # noqa: BLE001 - every failure must reach the caller
            board.fail(as_stage_error(worker, error))

    def _run_stage(self, board: _Board, worker: str, index: int) -> None:
        stage, device = self.stages[index], self.devices[index]
        stream = self._streams.get((worker, device))
        board.wait_for(stage.inputs, stage.waits_for)
        start = time.perf_counter()
        try:
            inputs = board.take(stage.inputs, worker, device, stream)
            with stream_context(stream):
                outputs = stage.forward(*inputs)  # not stage(): fx's wrapper prints the failing line to stderr
            del inputs
            board.release(stage.inputs, stage.writes, worker)
        except Exception as error:
            raise StageError(f"stage {index} on {worker} failed: {type(error).__name__}: {error}") from error
        made: list[tuple[torch.device, Any]] = []
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            made = [(device, event)]
        board.publish(index, worker, dict(zip(stage.outputs, outputs)), made)
        with board.cond:
            board.spans.append(StageSpan(index, worker, start, time.perf_counter()))
