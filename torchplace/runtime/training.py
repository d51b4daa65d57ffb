"""One training step of a split model: forward and backward passes as a schedule of actions.

:meth:`TrainingExecutor.step` runs a global order of :class:`~torchplace.runtime.schedule.Action` s
(GPipe or 1F1B, :func:`~torchplace.runtime.schedule.training_schedule`), each worker thread its own
actions in that order (:func:`~torchplace.runtime.schedule.per_worker`):

* **F(i, s)** waits for the inputs of stage ``s`` on micro-batch ``i`` (and the stages its in-place
  ordering edges name), gives the stage each input as a fresh autograd leaf on its device (a stage
  boundary), and runs it with grad enabled; the outputs keep their autograd history inside the
  stage. After the forward of the micro-batch's last stage the same worker computes the loss on
  leaves of the model's outputs, weighted by the micro-batch's share of the batch,
  ``loss_fn(output, target) / (N / n_i)`` (``/ m`` for ``m`` equal micro-batches), and
  back-propagates it to them.
* **B(i, s)** waits until every gradient for the stage's outputs has arrived (one from each later
  stage that read the value, one from the loss if it is a model output), calls
  ``torch.autograd.backward`` on those outputs, which accumulates the parameters' ``.grad``
  (the model's own parameters, wherever they are, :mod:`~torchplace.runtime.params`), and sends
  the gradient of each input leaf back to the device that produced the value, where the
  contributions are summed. The stage's outputs of that micro-batch are then forgotten: every
  reader has run its backward, so a worker holds the values of the micro-batches in flight only.

Gradients therefore equal those of the unsplit model run on the same micro-batches with the loss
averaged over them, each weighted by its share of the samples: for a loss that is a mean over its
samples, the gradients of one full-batch step (up to float rounding), however the batch splits. A stage that fails raises
:class:`~torchplace.errors.StageError` naming the stage, micro-batch and direction; every wait polls
a stop event, so nothing hangs. Copies use the default CUDA stream of each device (no overlap of
copies and compute in training steps yet).
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from torchplace.errors import StageError, UnsupportedError, UsageError
from torchplace.fxutil import draws_random_numbers
from torchplace.profiling.effects import version_of
from torchplace.profiling.loss import WRITES_ITS_OUTPUT, writes_its_output
from torchplace.runtime.devices import as_stage_error, autocast_of, caller_autocast, normalize_device
from torchplace.runtime.microbatch import batch_size, scatter
from torchplace.runtime.params import StageParameters
from torchplace.runtime.schedule import Action, per_worker, training_schedule
from torchplace.runtime.spans import StageSpan
from torchplace.runtime.split import StageModule
from torchplace.runtime.values import Values, written_inputs
from torchplace.runtime.workers import WorkerThreads

__all__ = ["TrainingExecutor"]

_POLL_S = 0.05
_JOIN_S = 5.0


class _Stopped(Exception):
    pass


def _beside(target: Any, output: Any) -> Any:
    """``target`` with its tensors on the device of ``output``'s tensors when they share one device
    (the last stage's): a caller's target on the CPU meets outputs that a plan left on a GPU."""
    devices = {t.device for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
    if len(devices) != 1:
        return target
    device = devices.pop()
    return tree_map_only(torch.Tensor, lambda t: t if t.device == device else t.to(device), target)


def _leaf(value: Any) -> Any:
    """A stage-boundary copy of ``value``: same memory, no history, requiring grad where the value
    is a floating-point or complex tensor that does. Values that hold several tensors (the list ``split``
    returns) are copied tensor by tensor: a consumer's backward must never reach into the
    producer's graph, or the producer's own backward finds it freed."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(
        t.requires_grad and (t.is_floating_point() or t.is_complex())), value)


@dataclass
class _Step:
    """The shared state of one step."""

    values: list[Values]
    pending: dict[tuple[int, str], int]
    inputs: list[dict[str, Any]] = field(default_factory=list)  # each micro-batch's bound model inputs
    grads: dict[tuple[int, str], Any] = field(default_factory=dict)
    input_grads: dict[tuple[int, str], Any] = field(default_factory=dict)  # of model inputs that require grad
    before: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    leaves: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    outputs: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    done: set[Action] = field(default_factory=set)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    spans: list[StageSpan] = field(default_factory=list)
    began: dict[Action, float] = field(default_factory=dict)  # action -> when its inputs were ready
    cond: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self, ready: Callable[[], bool]) -> None:
        with self.cond:
            while not ready():
                if self.stop.is_set():
                    raise _Stopped
                self.cond.wait(_POLL_S)

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.stop.set()
            self.cond.notify_all()


class TrainingExecutor:
    """Run training steps of a model's stages on one worker thread per device.

    Args:
        stages: the forward stages from :func:`~torchplace.runtime.split.split_stages`, in order.
        stage_devices: the torch device of each stage.
        stage_workers: the worker key (plan device) of each stage.
        graph_io: the :class:`~torchplace.runtime.graph_io.GraphIO` of the split model.
        stage_params: the stages' parameter homes and replicas (made here if not given).
        isolate: give every worker its own memory (a test aid, :class:`~torchplace.runtime.values.Values`).
        recompute: per stage, whether its forward pass keeps only its inputs and its backward pass
            runs the forward again with grad first (activation recomputation, Chen et al. 2016):
            the second run starts from the buffers the first one found (an EMA the stage updates
            and reads gives the same activations), and the buffers are put back afterwards, so they
            advance once. A stage that draws random numbers or writes a model input in place cannot
            be recomputed exactly and is refused.
        stage_threads: intra-op threads of each stage's worker (``Device.threads``; ``None``:
            the process's setting), applied in the worker's thread.
    """

    def __init__(self, stages: Sequence[StageModule], stage_devices: Sequence[str], stage_workers: Sequence[str],
                 graph_io: Any, *, stage_params: StageParameters | None = None, isolate: bool = False,
                 recompute: Sequence[bool] = (), stage_threads: Sequence[int | None] | None = None) -> None:
        if not len(stages) == len(stage_devices) == len(stage_workers) or not stages:
            raise ValueError("a training executor needs one device and one worker per stage, and a stage")
        self.recompute = tuple(recompute) or (False,) * len(stages)
        for s, again in enumerate(self.recompute):
            if again:
                _check_recomputable(stages[s], s, graph_io)
        self.stages = list(stages)
        self.devices = [normalize_device(d) for d in stage_devices]
        self.workers = list(stage_workers)
        self.graph_io = graph_io
        self.isolate = isolate
        self.stage_params = stage_params or StageParameters(self.stages, self.devices, self.workers, isolate)
        self._producer = {name: s for s, stage in enumerate(self.stages) for name in stage.outputs}
        self._inputs = frozenset(getattr(graph_io, "placeholder_names", ()))
        self._consumers: dict[str, int] = {}
        for stage in self.stages:
            for name in stage.inputs:
                self._consumers[name] = self._consumers.get(name, 0) + 1
        self._lock = threading.Lock()
        self._threads = WorkerThreads("train", {w: n for w, n in zip(self.workers, stage_threads or ())})
        self.saved: SavedBytes | None = None
        self.last_spans: list[StageSpan] = []

    def track_saved(self, on: bool = True) -> None:
        """Measure the activations each worker keeps for backward (peaks in ``self.saved.peak``)."""
        self.saved = SavedBytes() if on else None

    # -- the step ---------------------------------------------------------------------------------------
    def step(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], target: Any,
             loss_fn: Callable[[Any, Any], torch.Tensor], microbatches: int, schedule: str = "1f1b") -> list[torch.Tensor]:
        """Forward and backward of one batch in ``microbatches`` micro-batches; returns each
        micro-batch's loss (detached). Parameters' ``.grad`` accumulate ``d(mean loss)/dp``, each
        micro-batch's loss weighted by its share of the samples (:func:`_loss_divisors`), and so do
        model inputs that require grad; inputs the model writes in place are written, as by the model.

        Raises:
            StageError: a stage's forward or backward, or the loss, raised (the original is chained).
        """
        with self._lock:
            chunks = scatter(args, kwargs, microbatches)
            shares = _loss_divisors(batch_size(args, kwargs), chunks)
            targets = _split_target(target, len(chunks), batch_size(args, kwargs))
            actions = training_schedule(schedule, len(chunks), len(self.stages))
            state = self._start(chunks)
            self.last_spans = state.spans  # filled by the workers as the step runs
            amp = caller_autocast()  # thread-local: the workers enter it again
            threads = [self._threads.submit(w, self._work, state, w, order, targets, loss_fn, shares, amp)
                       for w, order in per_worker(actions, self.workers).items() if order]
            try:
                for t in threads:
                    while t.is_alive():
                        t.join(_POLL_S)
            except BaseException as error:  # Ctrl-C: stop the workers before it propagates
                state.fail(error)
                for t in threads:
                    t.join(_JOIN_S)
                raise
            if state.error is not None:
                raise state.error
            self._finish(state)
            return [state.losses[i] for i in range(len(chunks))]

    def _finish(self, state: _Step) -> None:
        """After every action ran: write back the model inputs the model wrote (each micro-batch's
        part of the caller's tensor), and pass the gradients of the inputs that require grad on to
        the caller's tensors (a micro-batch is a view of them: its backward reaches them)."""
        for values in state.values:
            values.finish()
        tensors, grads = [], []
        for (i, name), received in state.input_grads.items():
            for tensor, grad in zip(tree_leaves(state.inputs[i][name]), received):
                if grad is not None and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensors.append(tensor)
                    grads.append(grad)
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _start(self, chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> _Step:
        values, inputs = [], []
        for a, k in chunks:
            bound = self.graph_io.bind_inputs(a, k)
            inputs.append(bound)
            values.append(Values(bound, bound, self.isolate, written_inputs(self.stages, self.graph_io)))
        outputs = set(self.graph_io.output_names)
        pending = {}
        for i in range(len(chunks)):
            for name in self._producer:
                pending[i, name] = self._consumers.get(name, 0) + (name in outputs)
        return _Step(values, pending, inputs)

    def _work(self, state: _Step, worker: str, order: Sequence[Action], targets: Sequence[Any],
              loss_fn: Callable[[Any, Any], torch.Tensor], shares: Sequence[float], amp: tuple = ()) -> None:
        try:
            with torch.enable_grad(), autocast_of(amp), self._saved_tracking(worker):
                for action in order:
                    if action.kind == "F":
                        self._forward(state, action, worker)
                        if action.stage == len(self.stages) - 1:
                            self._loss(state, action.microbatch, targets[action.microbatch], loss_fn,
                                       shares[action.microbatch])
                    else:
                        self._backward(state, action, worker)
                    state.spans.append(StageSpan(action.stage, worker, state.began.pop(action), time.perf_counter(),
                                                 action.microbatch, action.kind))
                    with state.cond:
                        state.done.add(action)
                        state.cond.notify_all()
        except _Stopped:
            return
        except BaseException as error:  # noqa: BLE001 - every failure must reach the caller
            state.fail(as_stage_error(worker, error))

    def _saved_tracking(self, worker: str) -> Any:
        """While a worker runs: count the bytes autograd saves for backward on it, each storage once
        while any saved reference to it lives (:attr:`peak_saved`), when ``track_saved`` is set."""
        if self.saved is None:
            return contextlib.nullcontext()
        return self.saved.hooks(worker)

    # -- the actions ------------------------------------------------------------------------------------
    def _forward(self, state: _Step, a: Action, worker: str) -> None:
        stage, device = self.stages[a.stage], self.devices[a.stage]
        values = state.values[a.microbatch]
        state.wait(lambda: all(n in values for n in stage.inputs)
                   and all(Action("F", a.microbatch, s) in state.done for s in stage.waits_for))
        state.began[a] = time.perf_counter()
        try:
            with state.cond:
                got = [values.get(n, worker, device, None) for n in stage.inputs]
            leaves = [_leaf(v) for v in got]
            self.stage_params.refresh_stage(a.stage)
            if self.recompute[a.stage]:  # keep only the inputs; the outputs carry no history
                before = [(b, b.detach().clone(), version_of(b)) for b in stage.buffers()]
                with torch.autograd.graph.saved_tensors_hooks(_keep_nothing, _kept_nothing):
                    outputs = tuple(_detached(o) for o in stage.forward(*leaves))  # which need grad, as without
                state.before[a.microbatch, a.stage] = [(b, saved) for b, saved, v in before  # the buffers it wrote
                                                       if version_of(b) != v or not torch.equal(b, saved)]
            else:
                outputs = stage.forward(*leaves)
            with state.cond:
                values.wrote(stage.writes, worker)
                values.put(zip(stage.outputs, outputs), worker)
                state.leaves[a.microbatch, a.stage] = dict(zip(stage.inputs, leaves))
                state.outputs[a.microbatch, a.stage] = tuple(outputs)
                state.cond.notify_all()
        except Exception as error:
            raise StageError(f"stage {a.stage} on {worker} failed in the forward pass of micro-batch "
                             f"{a.microbatch}: {type(error).__name__}: {error}") from error

    def _loss(self, state: _Step, i: int, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
              divisor: float) -> None:
        values = state.values[i]
        names = list(self.graph_io.output_names)
        state.wait(lambda: all(n in values for n in names))
        try:
            with state.cond:
                leaves = {n: _leaf(values.originals[n]) for n in names}
            output = self.graph_io(leaves)
            loss = loss_fn(output, _beside(target, output))
            if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
                raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                f"{'' if not isinstance(loss, torch.Tensor) else ' of shape ' + str(tuple(loss.shape))}")
            (loss / divisor).backward()
        except Exception as error:
            fix = f"; {WRITES_ITS_OUTPUT}" if writes_its_output(error) else ""
            raise StageError(f"the loss of micro-batch {i} failed: {type(error).__name__}: {error}{fix}") from error
        with state.cond:
            for n, leaf in leaves.items():
                self._contribute(state, i, n, leaf)
            state.losses[i] = loss.detach()
            state.cond.notify_all()

    def _backward(self, state: _Step, a: Action, worker: str) -> None:
        stage = self.stages[a.stage]
        key = (a.microbatch, a.stage)
        state.wait(lambda: all(state.pending[a.microbatch, n] == 0 for n in stage.outputs))
        state.began[a] = time.perf_counter()
        try:
            with state.cond:
                outputs = state.outputs.pop(key)
                leaves = state.leaves.pop(key)
                grads_in = [state.grads.pop((a.microbatch, n), None) for n in stage.outputs]
            restore = None
            if self.recompute[a.stage]:
                outputs, restore = self._recompute(a.stage, leaves, state.before.pop(key, []))
            tensors, grads = _with_grads(list(zip(outputs, grads_in)))
            if tensors:
                torch.autograd.backward(tensors, grads)
            if restore is not None:
                restore()
        except Exception as error:
            raise StageError(f"stage {a.stage} on {worker} failed in the backward pass of micro-batch "
                             f"{a.microbatch}: {type(error).__name__}: {error}") from error
        with state.cond:
            for n, leaf in leaves.items():
                self._contribute(state, a.microbatch, n, leaf)
            for n in stage.outputs:  # every reader (and the loss) has run its backward: nothing reads them again
                state.values[a.microbatch].drop(n)
            state.cond.notify_all()

    def _recompute(self, index: int, leaves: Mapping[str, Any],
                   before: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[tuple[Any, ...], Callable[[], None]]:
        """Stage ``index``'s forward again, with grad, on the inputs it kept, from the buffers its
        first run found (``before``: those it wrote, as they were), and a function that puts back
        the buffers as they are now; call it after the backward, which may check the versions of
        what it saved."""
        stage = self.stages[index]
        now = [(b, b.detach().clone()) for b, _ in before]
        with torch.no_grad():
            for b, saved in before:
                b.copy_(saved)
        self.stage_params.refresh_stage(index)
        outputs = tuple(stage.forward(*(leaves[n] for n in stage.inputs)))

        def restore() -> None:
            with torch.no_grad():
                for b, saved in now:
                    b.copy_(saved)

        return outputs, restore

    def _contribute(self, state: _Step, i: int, name: str, leaf: Any) -> None:
        """Add ``leaf``'s gradient to the gradient of value ``name`` (on the producer's device, or
        the caller's for a model input); called with ``state.cond`` held."""
        if name in self._producer:
            grad, into = _grad_like(leaf, state.values[i].originals[name]), state.grads
            state.pending[i, name] -= 1
        elif name in self._inputs:
            grad, into = _grad_like(leaf, state.inputs[i][name]), state.input_grads
        else:
            return
        if grad is not None:
            have = into.get((i, name))
            into[i, name] = grad if have is None else _add(have, grad)


def _check_recomputable(stage: StageModule, index: int, graph_io: Any) -> None:
    """Refuse recomputing a stage whose second run would differ from its first."""
    for n in stage.graph.nodes:
        if draws_random_numbers(stage, n):
            raise UnsupportedError(f"stage {index} draws random numbers ({n.name}: "
                                   f"{getattr(n.target, '__name__', n.target)}), so recomputing its activations "
                                   "would not reproduce them: place without recomputation (recompute=False)")
    written = set(stage.writes) & set(getattr(graph_io, "placeholder_names", ()))
    if written:
        raise UnsupportedError(f"stage {index} writes the model input {sorted(written)[0]!r} in place, which a second run "
                               "would write again: place without recomputation (recompute=False)")


def _detached(value: Any) -> Any:
    """An output of a recomputing stage's first forward, without its history: each tensor requires
    grad as it did (as it would in a forward that keeps its activations), no more."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value)


def _keep_nothing(tensor: torch.Tensor) -> None:
    """A recomputing stage's first forward saves nothing for backward: its graph only tells which
    outputs need a gradient."""
    return None


def _kept_nothing(packed: None) -> torch.Tensor:
    raise RuntimeError("a recomputing stage's first forward has no backward; its second one does")


class SavedBytes:
    """Bytes of tensors autograd keeps for backward, per worker: live now and at the peak.

    A saved tensor is boxed when autograd packs it; the box lives as long as autograd keeps it,
    and its storage counts once per worker while any box of it lives.
    """

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._refs: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def hooks(self, worker: str) -> Any:
        def pack(t: torch.Tensor) -> Any:
            if t.layout != torch.strided or isinstance(t, torch.nn.Parameter):
                return t
            box = _Box(t)
            key, nbytes = (worker, t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()
            with self._lock:
                self._refs[key] = self._refs.get(key, 0) + 1
                if self._refs[key] == 1:
                    self.live[worker] = self.live.get(worker, 0) + nbytes
                    self.peak[worker] = max(self.peak.get(worker, 0), self.live[worker])
            weakref.finalize(box, self._release, key, nbytes)
            return box

        def unpack(packed: Any) -> torch.Tensor:
            return packed.tensor if isinstance(packed, _Box) else packed

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, key: tuple[str, int], nbytes: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live[key[0]] -= nbytes


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _grad_like(leaf: Any, original: Any) -> list[torch.Tensor | None] | None:
    """The gradients a boundary copy received, one per tensor of the value (``tree_leaves``
    order), on the original tensors' devices; ``None`` if it received none."""
    grads = [
        (mine.grad.to(theirs.device) if isinstance(theirs, torch.Tensor) else mine.grad)
        if isinstance(mine, torch.Tensor) and mine.grad is not None else None
        for mine, theirs in zip(tree_leaves(leaf), tree_leaves(original))
    ]
    return grads if any(g is not None for g in grads) else None


def _add(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b)]


def _with_grads(pairs: Sequence[tuple[Any, Any]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The output tensors that received a gradient and need one, with their gradients."""
    tensors, grads = [], []
    for output, received in pairs:
        if received is None:
            continue
        for tensor, grad in zip(tree_leaves(output), received):
            if grad is not None and isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensors.append(tensor)
                grads.append(grad)
    return tensors, grads


def _loss_divisors(batch: int | None, chunks: Sequence[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[float]:
    """What each micro-batch's loss is divided by: ``N / n_i``, the batch's samples over the
    micro-batch's, so that the losses of a mean over samples add up to the batch's mean however the
    batch splits (a DataLoader's last batch); ``m`` itself where ``m`` equal micro-batches (or no
    batch) make every share ``1/m``, which keeps those steps' rounding as it was."""
    m = len(chunks)
    if not batch or batch % m == 0:
        return [m] * m
    return [batch / (batch_size(*chunk) or batch) for chunk in chunks]


def _split_target(target: Any, chunks: int, batch: int | None) -> list[Any]:
    """The target split along dim 0 like the inputs (:func:`~torchplace.runtime.microbatch.scatter`).

    Raises:
        UsageError: a tensor of the target has other rows than the inputs' ``batch`` while there
            are several micro-batches (it would be cut into pieces that match no sample).
    """
    leaves, spec = tree_flatten(target)
    for leaf in leaves if chunks > 1 else ():
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] != batch:
            raise UsageError(
                f"a tensor of the target has {leaf.shape[0]} rows where the inputs have {batch}: step() splits every "
                "tensor of the target along dim 0 as it splits the batch; pass one row per sample, and give what is "
                "not per sample (class weights, say) to the loss function instead (a closure or functools.partial)")
    columns = [t.tensor_split(chunks) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * chunks for t in leaves]
    return [tree_unflatten([c[i] for c in columns], spec) for i in range(chunks)]
