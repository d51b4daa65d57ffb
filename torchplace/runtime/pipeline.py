"""Run split stages as a pipeline of micro-batches on worker threads.

How it works (one :meth:`PipelineExecutor.run` call):

* The batch is scattered into micro-batches (:func:`torchplace.runtime.microbatch.scatter`);
  each becomes a message whose *carry* is ``{name: value}`` of the model inputs that some stage or
  the output reads.
* Consecutive stages on one worker form a *segment* (:func:`~torchplace.runtime.schedule.segments`).
  Segment ``j`` reads messages from queue ``j`` and writes them to queue ``j + 1``. Queue 0 (the
  micro-batches) and the last queue (the results) are unbounded; the queues between segments are
  ``queue.Queue(maxsize=queue_size)``, which bounds the micro-batches in flight.
* One daemon thread per distinct worker key is started for the call and ends with it. A worker
  processes its (micro-batch, segment) pairs in the order of
  :func:`~torchplace.runtime.schedule.worker_orders` (the GPipe clock restricted to the worker);
  the executor decides no order itself. Each stage reads its inputs on its device (the carry
  keeps every value where it was made and one copy per other device,
  :class:`~torchplace.runtime.values.Values`), runs, applies its in-place writes (stale copies
  forgotten, written model inputs copied back), adds its outputs to the carry and drops the
  values no later stage or the output needs; after the last stage the worker assembles the
  micro-batch's output. A micro-batch's stages run one after another, so in-place ordering edges
  between stages hold by construction.
* The caller's thread collects the outputs in micro-batch order and gathers them
  (:func:`~torchplace.runtime.microbatch.gather`: tensor leaves concatenated along dim 0,
  non-tensor leaves from the first micro-batch).
* Failure: a stage that raises records a :class:`~torchplace.errors.StageError` (chained ``from``
  the original) and sets a shared stop event. Every queue get/put polls with a timeout and checks
  the event, so the other workers stop and the caller re-raises the error; nothing waits forever.
  A worker busy inside a long stage finishes that stage in the background (it is a daemon thread).
* Autograd: the caller's grad mode and inference mode (both thread-local in torch) are applied in
  every worker.
* CUDA: each worker uses one ``torch.cuda.Stream`` per CUDA device; after a segment the worker
  records an event and sends it with the message; the consumer's stream waits on events of its
  own device and the consumer's thread synchronizes on the others before copying; tensors used on
  another stream are marked with ``record_stream``. Copies to CUDA are ``non_blocking``; copies to
  the CPU are blocking (a non-blocking device-to-host copy could be read before it lands).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from torchplace.costmodel import QUEUE_SIZE
from torchplace.errors import StageError, UnsupportedError
from torchplace.runtime.devices import (
    as_stage_error,
    autograd_mode,
    caller_autocast,
    normalize_device,
    stream_context,
    wait_for_producers,
)
from torchplace.runtime.microbatch import gather, given_pieces, scatter
from torchplace.runtime.schedule import segments, worker_orders
from torchplace.runtime.params import StageParameters
from torchplace.runtime.spans import StageSpan
from torchplace.runtime.workers import Job, WorkerThreads
from torchplace.runtime.split import StageModule
from torchplace.runtime.values import Values, written_inputs

__all__ = ["PipelineExecutor"]

_POLL_S = 0.05
"""Seconds a queue get/put waits before checking the stop event again."""

_JOIN_S = 2.0
"""Seconds the caller waits for each worker thread to end after a run."""


@dataclass
class _Message:
    """One micro-batch in flight: its carry, its CUDA events, and finally its output."""

    microbatch: int
    carry: Values
    events: list[tuple[torch.device, Any]] = field(default_factory=list)
    output: Any = None


class _Stopped(Exception):
    """Raised inside a worker when the run's stop event is set."""


@dataclass
class _RunState:
    """The shared state of one run: queues, stop event, first error, observed order."""

    queues: list[queue.Queue]
    grad_enabled: bool
    inference_mode: bool
    autocast: tuple = ()  # the caller's torch.autocast settings (devices.caller_autocast)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    trace: list[tuple[str, int, int]] = field(default_factory=list)
    spans: list[StageSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, error: BaseException) -> None:
        """Keep the first error and tell everyone to stop."""
        with self.lock:
            if self.error is None:
                self.error = error
        self.stop.set()


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    """``q.get()`` that gives up with :class:`_Stopped` once ``stop`` is set."""
    while not stop.is_set():
        try:
            return q.get(timeout=_POLL_S)
        except queue.Empty:
            continue
    raise _Stopped


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """``q.put(item)`` that gives up with :class:`_Stopped` once ``stop`` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return
        except queue.Full:
            continue
    raise _Stopped


def _drop_schedule(stages: Sequence[StageModule], output_names: Sequence[str]) -> list[list[str]]:
    """For each stage, the carried names that no later stage and not the output reads."""
    last_use: dict[str, int] = {}
    for index, stage in enumerate(stages):
        for name in stage.inputs:
            last_use[name] = index
    keep = set(output_names)
    drops: list[list[str]] = [[] for _ in stages]
    for name, index in last_use.items():
        if name not in keep:
            drops[index].append(name)
    return drops


class PipelineExecutor:
    """Run a model's stages as a GPipe forward pipeline of micro-batches on worker threads.

    Args:
        stages: the stages from :func:`~torchplace.runtime.split.split_stages`, in order.
        stage_devices: the torch device string of each stage (``"cpu"``, ``"cuda:0"``); the
            stage's parameters and buffers are moved there at construction (the original model is
            left untouched; tensors already there are shared).
        stage_workers: the worker key of each stage (e.g. ``"cpu:0"``, ``"cpu:1"``, ``"cuda:0"``).
            One thread per distinct key; stages sharing a key run serially on its thread. Two CPU
            keys are two logical CPU devices whose stages overlap in time.
        assemble_output: a :class:`~torchplace.runtime.graph_io.GraphIO` of the split model: it
            binds the call's arguments to input names (``bind_inputs``), lists the names the
            output reads (``output_names``) and, called with ``{name: value}``, builds the output.
        queue_size: the capacity of each queue between segments (at least 1).
        isolate: give every worker its own memory even on one torch device (a test aid, see
            :class:`~torchplace.runtime.values.Values`).
        stage_params: the stages' parameter homes and replicas, when another executor of the same
            stages made them already (made here otherwise).
        stage_threads: intra-op threads of each stage's worker (``Device.threads``; ``None``:
            the process's setting), applied in the worker's thread.
        joined_outputs: per output leaf, whether micro-batches' outputs are joined along dim 0
            (``False``: the first's is the call's; :func:`torchplace.batchdim.check_split`);
            ``None``: every tensor leaf is joined; an exception: why they cannot be, raised by a
            call split into several micro-batches.

    Raises:
        ValueError: if the per-stage lists differ in length or ``queue_size < 1``.

    Attributes:
        last_trace: ``(worker, microbatch, stage)`` in the order stages ran in the last
            :meth:`run` (appended by the workers as they finish each stage).
        last_spans: a :class:`~torchplace.runtime.spans.StageSpan` per (stage, micro-batch) of
            the last :meth:`run`, in finishing order.
    """

    def __init__(
        self,
        stages: list[StageModule],
        stage_devices: list[str],
        stage_workers: list[str],
        assemble_output: Any,
        queue_size: int = QUEUE_SIZE,
        isolate: bool = False,
        stage_params: StageParameters | None = None,
        stage_threads: Sequence[int | None] | None = None,
        joined_outputs: Sequence[bool] | Exception | None = None,
    ) -> None:
        _check_arguments(stages, stage_devices, stage_workers, queue_size)
        self.joined_outputs = joined_outputs
        self.stages = list(stages)
        self.devices = [normalize_device(d) for d in stage_devices]
        self.workers = list(stage_workers)
        self.assemble_output = assemble_output
        self.queue_size = queue_size
        self.isolate = isolate
        self._segments = segments(self.workers)
        self._drops = _drop_schedule(self.stages, assemble_output.output_names)
        self._needed = {n for s in self.stages for n in s.inputs} | set(assemble_output.output_names)
        self._written_inputs = written_inputs(self.stages, assemble_output)
        self._streams = self._make_streams()
        self.last_trace: list[tuple[str, int, int]] = []
        self.last_spans: list[StageSpan] = []
        self._lock = threading.Lock()
        self._threads = WorkerThreads("pipeline", {w: n for w, n in zip(self.workers, stage_threads or ())})
        self.stage_params = stage_params or StageParameters(self.stages, self.devices, self.workers, isolate)

    def _make_streams(self) -> dict[tuple[str, torch.device], Any]:
        """One CUDA stream per (worker, CUDA device) pair."""
        return {
            (worker, device): torch.cuda.Stream(device)
            for worker, device in zip(self.workers, self.devices)
            if device.type == "cuda"
        }

    def run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int) -> Any:
        """Compute the model on ``(args, kwargs)`` through the pipeline.

        Args:
            args: positional model arguments.
            kwargs: keyword model arguments.
            microbatches: number of micro-batches (1: no split; more than the batch size: clamped
                to the batch size with a ``RuntimeWarning``).

        Returns:
            The model's output; with several micro-batches every tensor leaf is the concatenation
            of the micro-batches' leaves along dim 0 (but those ``joined_outputs`` leaves out).

        Raises:
            StageError: if a stage raised; ``__cause__`` is the original exception.
            ValueError: if the inputs cannot be split into micro-batches.
        """
        with self._lock:  # runs take turns: they share the stages and their replicas
            self.stage_params.refresh()
            chunks = scatter(args, kwargs, microbatches)
            if isinstance(self.joined_outputs, Exception) and len(chunks) > 1:
                raise self.joined_outputs
            state = self._start_state(chunks)
            orders = worker_orders(len(chunks), [worker for worker, _ in self._segments])
            threads = [self._threads.submit(worker, self._work, state, worker, order)
                       for worker, order in orders.items()]
            try:
                outputs = self._collect(state, len(chunks), threads)
            finally:
                state.stop.set()
                for thread in threads:
                    thread.join(timeout=_JOIN_S)
                self.last_trace = list(state.trace)
                self.last_spans = list(state.spans)
            joined = None if isinstance(self.joined_outputs, Exception) else self.joined_outputs
            return gather(outputs, joined, given_pieces(args, kwargs, chunks) if len(chunks) > 1 else None)

    def _start_state(self, chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> _RunState:
        """Create the run's queues and put every micro-batch into the first one."""
        inner: list[queue.Queue] = [queue.Queue(maxsize=self.queue_size) for _ in self._segments[1:]]
        queues: list[queue.Queue] = [queue.Queue(), *inner, queue.Queue()]
        state = _RunState(queues, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), caller_autocast())
        bound = [self.assemble_output.bind_inputs(args, kwargs) for args, kwargs in chunks]
        _check_written_inputs_split(bound, self._written_inputs)
        for index, values in enumerate(bound):
            carry = {name: value for name, value in values.items() if name in self._needed}
            queues[0].put(_Message(index, Values(carry, values, self.isolate, self._written_inputs)))
        return state

    def _collect(self, state: _RunState, count: int, threads: Sequence[Job]) -> list:
        """Wait for the ``count`` outputs in micro-batch order; re-raise a worker's error."""
        results: list[Any] = []
        last = state.queues[-1]
        while len(results) < count:
            if state.error is not None:
                raise state.error
            try:
                message = last.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(t.is_alive() for t in threads) and last.empty() and state.error is None:
                    raise RuntimeError("pipeline workers ended without producing every output")
                continue
            wait_for_producers(message.events, torch.device("cpu"), None)
            results.append(message.output)
        return results

    def _work(self, state: _RunState, worker: str, order: Sequence[tuple[int, int]]) -> None:
        """A worker thread: run ``order``'s (micro-batch, segment) pairs, then end."""
        try:
            with autograd_mode(state.grad_enabled, state.inference_mode, state.autocast):
                for microbatch, segment in order:
                    message = _get(state.queues[segment], state.stop)
                    if message.microbatch != microbatch:
                        raise RuntimeError(
                            f"worker {worker} expected micro-batch {microbatch} for segment "
                            f"{segment}, got {message.microbatch}"
                        )
                    self._run_segment(state, worker, segment, message)
                    _put(state.queues[segment + 1], message, state.stop)
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - every failure must reach the caller
            state.fail(as_stage_error(worker, error))

    def _run_segment(self, state: _RunState, worker: str, segment: int, message: _Message) -> None:
        """Run one segment's stages on a message; assemble the output after the last stage."""
        stages = self._segments[segment][1]
        for index in stages:
            self._run_stage(state, worker, index, message)
        for device in {self.devices[i] for i in stages if self.devices[i].type == "cuda"}:
            event = torch.cuda.Event()
            event.record(self._streams[(worker, device)])
            message.events.append((device, event))
        if stages[-1] == len(self.stages) - 1:
            message.carry.finish()
            message.output = self._assemble(worker, message)
            message.carry = Values({}, ())

    def _run_stage(self, state: _RunState, worker: str, index: int, message: _Message) -> None:
        """Run stage ``index`` on ``message``'s carry and update the carry in place."""
        stage, device = self.stages[index], self.devices[index]
        stream = self._streams.get((worker, device))
        carry = message.carry
        start = time.perf_counter()
        try:
            wait_for_producers(message.events, device, stream)
            with stream_context(stream):
                inputs = [carry.get(name, worker, device, stream) for name in stage.inputs]
                outputs = stage.forward(*inputs)  # not stage(): fx's wrapper prints the failing line to stderr
                carry.wrote(stage.writes, worker)
        except Exception as error:
            raise StageError(
                f"stage {index} on {worker} failed on micro-batch {message.microbatch}: "
                f"{type(error).__name__}: {error}"
            ) from error
        carry.put(zip(stage.outputs, outputs), worker)
        for name in self._drops[index]:
            carry.drop(name)
        state.trace.append((worker, message.microbatch, index))  # list.append is atomic
        state.spans.append(StageSpan(index, worker, start, time.perf_counter(), message.microbatch))

    def _assemble(self, worker: str, message: _Message) -> Any:
        """Build one micro-batch's output from its carry."""
        try:
            return self.assemble_output(message.carry.originals)
        except Exception as error:
            raise StageError(
                f"assembling the output of micro-batch {message.microbatch} on {worker} failed: "
                f"{type(error).__name__}: {error}"
            ) from error


def _check_written_inputs_split(bound: Sequence[Mapping[str, Any]], written: frozenset[str]) -> None:
    """Refuse micro-batches that would share a written model input (one without a batch
    dimension): each micro-batch would write it in turn, unlike the model run once per batch."""
    if len(bound) < 2:
        return
    for name in sorted(written):
        if bound[0].get(name) is bound[1].get(name) and isinstance(bound[0].get(name), torch.Tensor):
            raise UnsupportedError(
                f"the model writes its input {name!r} in place, and {name!r} has no batch dimension to split into "
                "micro-batches, so every micro-batch would write it: place with microbatches=1"
            )


def _check_arguments(
    stages: Sequence[StageModule],
    stage_devices: Sequence[str],
    stage_workers: Sequence[str],
    queue_size: int,
) -> None:
    """Raise ValueError for per-stage lists of different lengths or a queue size below 1."""
    if not len(stages) == len(stage_devices) == len(stage_workers):
        raise ValueError(
            "stages, stage_devices and stage_workers need one entry per stage (stages: "
            f"{len(stages)}, stage_devices: {len(stage_devices)}, "
            f"stage_workers: {len(stage_workers)})"
        )
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    if queue_size < 1:
        raise ValueError(f"queue_size must be at least 1 (got {queue_size})")
