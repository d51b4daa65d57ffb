"""PlacedModule: a model split into stages on several devices, still the model as far as a user can tell.

Its module tree, parameters, buffers and ``state_dict`` keys are the original model's own (the
model's children are its children), so optimizers, ``load_state_dict`` of a checkpoint of the
model, ``clip_grad_norm_`` and ``named_parameters`` work unchanged; each tensor lives on its home
device (:mod:`torchplace.runtime.params`). What it cannot do exactly, it refuses with a
:class:`~torchplace.errors.UnsupportedError` that says what to do instead: moving or converting it
(``.to()``, ``.cuda()``, ``.half()``), pickling or copying it, training mode before training
placement exists, ``load_state_dict(assign=True)``.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchplace import batchdim
from torchplace.checks import non_negative_int, positive_int
from torchplace.errors import StageError, UnsupportedError, UsageError
from torchplace.fxutil import bind_call, dtype_guards, left_out
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.profiling import Traced, trace
from torchplace.profiling.effects import StateSnapshot
from torchplace.runtime import GraphIO, LatencyExecutor, PipelineExecutor, StageModule, split_stages
from torchplace.runtime.devices import check_autocast, check_eager_call, normalize_device, random_state_kept
from torchplace.runtime.params import StageParameters, move_in_place
from torchplace.runtime.remap import stage_assignment
from torchplace.runtime.structure import Structure
from torchplace.runtime.training import TrainingExecutor

__all__ = ["PlacedModule"]

_SAVE_INSTEAD = (
    "save placed.plan.save('plan.json') and torch.save(placed.state_dict(), 'weights.pt'), then rebuild with "
    "torchplace.place(model, devices, example_inputs, plan='plan.json') and placed.load_state_dict(torch.load("
    "'weights.pt'))"
)


def _fx_names(stage: StageModule) -> list[str]:
    return [n.name for n in stage.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _forward_stages(problem: Problem, plan: Plan) -> list[Stage]:
    """The stages a forward run executes: all of them, or for a training plan the ones with
    forward nodes (autograd runs the backward nodes, on the devices of their forward nodes)."""
    if problem.mode != "training":
        return list(plan.stages)
    run = [s for s in plan.stages if any(not problem.graph.record(v).backward for v in s.nodes)]
    return run or list(plan.stages[:1])


def _home_unread_tensors(model: nn.Module, problem: Problem, plan: Plan) -> None:
    """Move the model's tensors that no stage reads (BatchNorm's ``num_batches_tracked`` in eval
    mode) to the device of the node that owns them in the cost model (``graph.meta["state"]``)."""
    state = problem.graph.meta.get("state") or {}
    device_of: dict[str | None, str] = {v: problem.cluster.device(s.device).torch_device for s in plan.stages for v in s.nodes}
    if plan.stages:  # a tensor no node owns (a model with no operators) goes to the first stage
        device_of[None] = problem.cluster.device(plan.stages[0].device).torch_device
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for name, entry in state.items():
        if not entry.get("readers") and entry.get("owner") in device_of and name in tensors:
            move_in_place(tensors[name], normalize_device(device_of[entry["owner"]]), name)


_THROUGH_AUTOGRAD = ("train through autograd instead (loss_fn(placed(x), y).backward(), one backward over the whole "
                     "graph), or remove the hook")


def _check_gradient_hooks(shared: Sequence[torch.Tensor], named: Iterable[tuple[str, torch.Tensor]],
                          fix: str = _THROUGH_AUTOGRAD) -> None:
    """Refuse a step when a parameter several stages read has a gradient hook: each stage's
    backward adds its part of the gradient, so the hook would run once per stage on a part
    (a clamp would clamp parts; an optimizer step in backward would step on each). ``fix``: what
    to do instead, for the message.

    Raises:
        UnsupportedError: naming the parameter and what to do instead.
    """
    hooked = {id(t) for t in shared if t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None)}
    if hooked:
        name = next((n for n, p in named if id(p) in hooked), "a parameter")
        raise UnsupportedError(
            f"{name} has a gradient hook, and several stages of the plan read it: step() back-propagates each stage "
            f"on its own, so the hook would run once per stage on that stage's part of the gradient; {fix}")


@contextlib.contextmanager
def _state_kept(module: nn.Module, inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Leave ``module`` as the block found it: each parameter's ``.grad`` (the same tensor, or
    ``None``), each buffer (BatchNorm's running statistics) and the random number generators (what
    dropout draws next); and the caller's ``inputs`` the model writes in place (``x.mul_(2)``). A
    measured training step accumulates gradients and updates statistics as a real one does, and
    each measured call writes such inputs again; :meth:`PlacedModule.measure` and
    :meth:`PlacedModule.trace` must not, or the user's next ``optimizer.step()`` takes the measured
    steps too, and the next call reads inputs written once per measured call.

    Copies of the gradients, buffers and written inputs live beside them (on their device) for the
    block; buffers are restored by :class:`~torchplace.profiling.effects.StateSnapshot`, as after
    profiling."""
    grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone())
             for p in dict.fromkeys(module.parameters())]
    written = [(t, t.detach().clone()) for t in inputs]
    state = StateSnapshot(module)
    with random_state_kept():
        try:
            yield
        finally:
            with torch.no_grad():
                for p, grad, saved in grads:
                    if p.grad is not grad:
                        p.grad = grad
                    if saved is not None:
                        grad.copy_(saved)
                for t, saved in written:
                    t.copy_(saved)
            state.restore()


class PlacedModule(nn.Module):
    """A model split into stages on several devices.

    For the throughput objective a call runs the stages as a pipeline of micro-batches; for the
    latency objective it runs one sample with every device's stages on its own worker, each stage
    as soon as its inputs exist (:class:`~torchplace.runtime.LatencyExecutor`).

    Attributes:
        plan: the :class:`~torchplace.plan.Plan` being run.
        problem: the measured problem the plan was solved for.
        microbatches: how many micro-batches each call's batch is split into (dim 0; always 1
            for the latency objective).
        stage_modules: the stage modules, in plan order (they call the model's own submodules).

    ``joined_outputs``: which outputs micro-batches join (:func:`torchplace.batchdim.joined_outputs`),
    or the refusal to raise if the model is run split; ``sizes``: the sizes a call must have
    (:class:`torchplace.batchdim.CallSizes`: the fewest samples per call and micro-batch, the dynamic
    dims that may not be one).
    """

    def __init__(self, traced: Traced, problem: Problem, plan: Plan, microbatches: int = 1,
                 example: tuple[tuple[Any, ...], Mapping[str, Any]] | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 joined_outputs: Sequence[bool] | Exception | None = None,
                 sizes: batchdim.CallSizes = batchdim.CallSizes()) -> None:
        super().__init__()
        self._sizes = sizes
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.plan, self.problem, self.microbatches = plan, problem, microbatches
        self._traced, self._example, self._eval = traced, example, None
        self._dtype_guards = dtype_guards(traced.gm) if traced.method == "export" else []  # refused under autocast
        self.loss_fn = loss_fn  # step()'s default loss (place(..., loss_fn=))
        self.last_measurement: Any = None  # set by measure(), shown by report()
        self.refinement: Any = None  # set by place(..., refine=True) (torchplace.refine.Refinement)
        self._last_spans: Sequence[Any] = ()
        self._for_training = problem.mode == "training"
        run = _forward_stages(problem, plan)
        stage_of = {f: i for i, s in enumerate(run) for v in s.nodes for f in problem.graph.record(v).fx_nodes}
        stages = split_stages(traced.gm, stage_of, len(run), traced.effects)
        self._stages = tuple(stages)
        devices = [problem.cluster.device(s.device) for s in run]
        self._torch_devices, self._workers = [d.torch_device for d in devices], [d.name for d in devices]
        self._threads = [d.threads for d in devices]
        self._isolate = os.environ.get("TORCHPLACE_ISOLATE_DEVICES", "") not in ("", "0")
        self._executor: PipelineExecutor | LatencyExecutor
        self._trainer: TrainingExecutor | None = None
        if problem.objective == "latency":
            self.microbatches = 1
            self._executor = LatencyExecutor(stages, self._torch_devices, self._workers, GraphIO(traced.gm, traced.output_spec),
                                             isolate=self._isolate, stage_threads=self._threads)
        else:
            self._executor = PipelineExecutor(stages, self._torch_devices, self._workers, GraphIO(traced.gm, traced.output_spec),
                                              isolate=self._isolate, stage_threads=self._threads,
                                              joined_outputs=joined_outputs)
        if self._for_training:
            recomputing = {s.device for s in plan.stages if s.recompute}
            self._trainer = TrainingExecutor(stages, self._torch_devices, self._workers, GraphIO(traced.gm, traced.output_spec),
                                             stage_params=self._executor.stage_params, isolate=self._isolate,
                                             recompute=[w in recomputing for w in self._workers],
                                             stage_threads=self._threads)
        if traced.model is not None:
            _home_unread_tensors(traced.model, problem, plan)
            self._adopt(traced.model)
        self._train_modes = self._modes() if self._for_training else ()  # frozen modules (a batch norm) in eval mode
        self._structure = Structure.of([*self.named_modules(remove_duplicate=False),
                                        *([("", traced.model)] if traced.model is not None else [])],
                                       own=[self])

    _torchplace_placed = True  # torchplace.arguments.check_model refuses to place it again

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "loss_fn":  # step()'s default loss, not a part of the model: never a child module, so
            self.__dict__[name] = value  # state_dict(), parameters() and the structure check stay the model's
            return
        super().__setattr__(name, value)

    def _adopt(self, model: nn.Module) -> None:
        """Take the model's children, parameters and buffers as this module's own (same objects)."""
        self._modules.update(model._modules)
        self._parameters.update(model._parameters)
        self._buffers.update(model._buffers)
        self._non_persistent_buffers_set.update(model._non_persistent_buffers_set)
        self.training = model.training

    @property
    def stage_modules(self) -> tuple[StageModule, ...]:
        return self._stages

    def refresh_replicas(self) -> None:
        """Copy every tensor a stage reads away from its home device again. A call does this by
        itself when a tensor changed (an optimizer step, ``load_state_dict``); call it after a
        write through ``tensor.data``, which PyTorch does not count as a change."""
        for executor in (self._executor, self._eval):
            if executor is not None:
                executor.stage_params.forget()
                executor.stage_params.refresh()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        check_eager_call()
        self._structure.check()
        check_autocast(self._dtype_guards)
        modes = self._modes()
        if self._for_training and modes == self._train_modes:
            executor = self._executor
        elif not any(modes):
            executor = self._eval_executor() if self._for_training else self._executor
        elif not self._for_training:
            raise UnsupportedError(
                "a module of the placed model is in training mode (model.train() was called after placing?): this "
                "placement runs the graph traced in eval mode; call placed.eval() (or model.eval()), or place the "
                "model for training (mode='training')"
            )
        else:
            raise UnsupportedError(self._modes_message())
        self._sizes.check(args, kwargs, self.microbatches if isinstance(executor, PipelineExecutor) else 1)
        try:
            if isinstance(executor, LatencyExecutor):
                return executor.run(args, kwargs)
            return executor.run(args, kwargs, self.microbatches)
        except StageError as e:
            raise _shape_error(e, self._sizes, args, kwargs) or e


    def step(self, *args: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
             schedule: str | None = None, **kwargs: Any) -> list[torch.Tensor]:
        """One training step of the batch ``(args, kwargs)`` through the plan's pipeline schedule
        (or ``schedule``: ``"1f1b"`` or ``"gpipe"``, which the plan's memory need not allow for).

        The batch is split into :attr:`microbatches` micro-batches (dim 0, ``target`` too); each
        micro-batch's ``loss_fn(output, target)`` is back-propagated weighted by its share of the
        batch's samples (``1/m`` for equal micro-batches), so the parameters' ``.grad`` accumulate
        the gradient of the weighted mean of the micro-batch losses: for a loss that is a mean over
        samples, the gradient of the full batch's loss, however the batch splits.
        ``loss_fn`` defaults to the one given to ``place(..., loss_fn=)``.
        Tensors of ``target`` are moved to the device of the model's outputs (the last stage's)
        when they are elsewhere. Call ``optimizer.step()`` and ``optimizer.zero_grad()`` around it as usual.

        Returns:
            Each micro-batch's loss (detached).

        Raises:
            UnsupportedError: if the model was placed for inference, or is in eval mode.
            StageError: a stage's forward or backward failed (named with its micro-batch).
        """
        if self._trainer is None or self.problem.pipeline is None:
            raise UnsupportedError("this model was placed for inference; place it with mode='training' to train it")
        check_eager_call()
        self._structure.check()
        check_autocast(self._dtype_guards)
        _check_gradient_hooks(self._executor.stage_params.shared, self.named_parameters())
        if self._modes() != self._train_modes:
            raise UnsupportedError(f"step() trains: {self._modes_message()}")
        if schedule not in (None, "1f1b", "gpipe"):
            raise UsageError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
        loss_fn = self.loss_fn if loss_fn is None else loss_fn
        if loss_fn is None:
            raise UsageError("step() needs a loss: pass loss_fn=f (f(output, target) -> scalar tensor), or give it "
                             "to place(..., loss_fn=f)")
        self._sizes.check(args, kwargs, self.microbatches)
        try:
            return self._trainer.step(args, kwargs, target, loss_fn, self.microbatches,
                                      schedule or self.problem.pipeline.schedule)
        except StageError as e:
            raise _shape_error(e, self._sizes, args, kwargs) or e

    def _eval_executor(self) -> PipelineExecutor | LatencyExecutor:
        """The eval-mode graph of a model placed for training, split like the training graph
        (:func:`~torchplace.runtime.remap.stage_assignment`); traced on the first eval-mode call."""
        if self._eval is None:
            traced, model = self._traced, self._traced.model
            if self._example is None or model is None:
                raise UnsupportedError("eval mode of this training placement needs the model and its example inputs; "
                                       "build it with torchplace.place(..., mode='training')")
            args, kwargs = self._example
            with torch.no_grad():
                other = trace(model, args, kwargs, granularity=traced.granularity, leaf_modules=traced.leaf_types,
                              method=traced.method, dynamic_dims=traced.dynamic_dims)
            known = {f: i for i, stage in enumerate(self._stages) for f in _fx_names(stage)}
            stage_of = stage_assignment(other.gm.graph, other.effects, self._traced.gm.graph, known, self._workers)
            stages = split_stages(other.gm, stage_of, len(self._stages), other.effects)
            params = StageParameters(stages, [normalize_device(d) for d in self._torch_devices], self._workers,
                                     self._isolate, homes=self._executor.stage_params)
            joined = batchdim.joined_outputs(batchdim.Runs(None, other.gm, other.flat_inputs, args, kwargs),
                                             self.microbatches)
            self._eval = PipelineExecutor(stages, self._torch_devices, self._workers, GraphIO(other.gm, self._traced.output_spec),
                                          isolate=self._isolate, stage_params=params, stage_threads=self._threads,
                                          joined_outputs=joined)
        return self._eval

    # -- seeing the plan and the runs (torchplace.report) ---------------------------------------------
    def _written_inputs(self, inputs: Any, kwargs: Mapping[str, Any] | None) -> list[torch.Tensor]:
        """The caller's tensors among ``inputs`` / ``kwargs`` (as :meth:`measure` takes them) that
        the model writes in place; none where the call does not bind (it raises when it runs)."""
        names = self._traced.written_inputs()
        if not names:
            return []
        try:
            bound = bind_call(self._traced.gm, inputs if isinstance(inputs, tuple) else (inputs,), kwargs)
        except UsageError:
            return []
        return [v for name, v in bound.items() if name in names and isinstance(v, torch.Tensor)]

    def _run_recorded(self, inputs: Any, kwargs: Mapping[str, Any] | None, target: Any,
                      loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> tuple[list[Any], float]:
        """One call (or, with a ``target``, one training step with ``loss_fn``, by default
        place()'s) and the spans its executor recorded."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        kwargs = dict(kwargs or {})
        if loss_fn is None and target is not None:
            loss_fn = self.loss_fn
            if loss_fn is None:
                raise UsageError("a target measures a training step, which needs a loss: pass loss_fn=f "
                                 "(f(output, target) -> scalar tensor), or give it to place(..., loss_fn=f)")
        if loss_fn is not None:
            if self._trainer is None:
                raise UsageError("loss_fn measures a training step, but this model was placed for inference; "
                                 "leave loss_fn out to measure forward calls")
            start = time.perf_counter()
            self.step(*args, target=target, loss_fn=loss_fn, **kwargs)
            return list(self._trainer.last_spans), time.perf_counter() - start
        with torch.no_grad():
            start = time.perf_counter()
            self(*args, **kwargs)
            wall = time.perf_counter() - start
        training = self._for_training and not any(m.training for m in self.modules())
        executor = self._eval if training and self._eval is not None else self._executor
        return list(executor.last_spans), wall

    def trace(self, inputs: Any, path: str | Path | None = None, *, kwargs: Mapping[str, Any] | None = None,
              target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> list[Any]:
        """Run ``inputs`` once (a training step with ``target``, and ``loss_fn`` or place()'s) and return its
        :class:`~torchplace.runtime.spans.StageSpan` s; with ``path``, also write them as a Chrome /
        Perfetto trace, one track per device (:func:`torchplace.report.trace.write_trace`).

        ``inputs`` is the tuple of positional arguments (or one tensor). The model is left as it was:
        gradients, buffers (BatchNorm statistics), random number generators and the inputs the model
        writes in place are restored."""
        with _state_kept(self, self._written_inputs(inputs, kwargs)):
            spans, _ = self._run_recorded(inputs, kwargs, target, loss_fn)
        if path is not None:
            from torchplace.report.trace import write_trace

            write_trace(path, spans, list(dict.fromkeys(self._workers)))
        return spans

    def measure(self, inputs: Any, *, runs: int = 3, warmup: int = 1, kwargs: Mapping[str, Any] | None = None,
                target: Any = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> Any:
        """Time ``runs`` calls on ``inputs`` (after ``warmup``) and compare each stage's measured
        time and the run's bottleneck (or latency) with the cost model's predictions
        (:func:`torchplace.report.fidelity.compare`). Predictions are for the example inputs the
        model was profiled with: measure with inputs of that size. The result is kept for
        :meth:`report` (``last_measurement``). With ``target`` it times training steps, with
        ``loss_fn`` or else the one given to ``place(..., loss_fn=)``. The model is left as it was:
        the steps' gradients and buffer updates (BatchNorm statistics) are undone, and the random
        number generators and the inputs the model writes in place restored, so measuring between
        training steps changes nothing.

        Returns:
            A :class:`~torchplace.report.fidelity.Measurement` (prints as a table).
        """
        from torchplace.report.fidelity import compare

        runs, warmup = positive_int(runs, "runs"), non_negative_int(warmup, "warmup")
        with _state_kept(self, self._written_inputs(inputs, kwargs)):
            for _ in range(warmup):
                self._run_recorded(inputs, kwargs, target, loss_fn)
            recorded = [self._run_recorded(inputs, kwargs, target, loss_fn) for _ in range(runs)]
        spans = [s for s, _ in recorded]
        # the micro-batches the runs made: fewer than self.microbatches when the batch has fewer rows
        # (the executor clamps m to them), and place() predicted the example's call with that count
        ran = max((s.microbatch + 1 for s in spans[-1]), default=self.microbatches)
        self.last_measurement = compare(self.plan, self.problem, spans, [w for _, w in recorded], ran,
                                        training=self._for_training)
        self._last_spans = spans[-1]
        return self.last_measurement

    def plot_schedule(self) -> Any:
        """The plan's predicted schedule (:func:`torchplace.report.plot_schedule`)."""
        from torchplace.report import plot_schedule

        return plot_schedule(self.plan, self.problem, self._drawn_microbatches())

    def _drawn_microbatches(self) -> int | None:
        """The micro-batches a picture of an inference call draws: this model's, at most what a
        picture holds (:data:`~torchplace.report.timeline.MOST_MICROBATCHES`); ``None`` for
        training (the plan's pipeline)."""
        from torchplace.report.timeline import MOST_MICROBATCHES

        return min(self.microbatches, MOST_MICROBATCHES) if self.problem.mode != "training" else None

    def plot_memory(self) -> Any:
        """Memory per device by kind (:func:`torchplace.report.plot_memory`)."""
        from torchplace.report import plot_memory

        return plot_memory(self.plan, self.problem)

    def plot_graph(self, level: str = "module") -> Any:
        """The graph coloured by device (:func:`torchplace.report.plot_graph`)."""
        from torchplace.report import plot_graph

        return plot_graph(self.plan, self.problem, level)

    def report(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write one self-contained HTML report (:func:`torchplace.report.html.render`): the plan,
        its bound and gap, the three pictures, the device map and, after :meth:`measure`, measured
        beside predicted; after ``place(..., refine=True)``, both plans it ran."""
        from torchplace.report.html import write_report

        try:
            device_map = self.device_map()
        except Exception:  # noqa: BLE001 - a plan without module paths has no device map; the report says so
            device_map = None
        name = type(self._traced.model).__name__ if self._traced.model is not None else "model"
        return write_report(path, self.plan, self.problem, title=title or f"torchplace plan: {name}",
                            microbatches=self._drawn_microbatches(),
                            device_map=device_map, measurement=self.last_measurement, spans=self._last_spans,
                            refinement=self.refinement)

    def device_map(self) -> dict[str, str]:
        """Where each module's weights live, in accelerate's ``device_map`` form."""
        return self.plan.device_map(self.problem)

    # -- what a placed model refuses ----------------------------------------------------------------
    def train(self, mode: bool = True) -> PlacedModule:
        if mode and not self._for_training:
            raise UnsupportedError(
                "this model was placed for inference, and its traced graph runs in eval mode (dropout off, "
                "BatchNorm on running statistics): calling train() would change nothing and silently; train "
                "the unplaced model, or place it for training (torchplace.place(..., mode='training'))"
            )
        model = self._traced.model
        if model is not None:  # the model's root is no child: its own forward may read self.training
            model.train(mode)
        super().train(mode)
        if mode:  # the modes the training graph was traced with: frozen modules stay in eval mode
            for module, flag in zip(self.modules(), self._train_modes):
                module.training = flag
        return self

    def _modes(self) -> tuple[bool, ...]:
        """Each module's ``training`` flag, in ``modules()`` order."""
        return tuple(m.training for m in self.modules())

    def _modes_message(self) -> str:
        """Which modules are not in the mode the training graph was traced with (a training
        placement's graphs run in those modes, or all in eval mode), and what to do."""
        odd = [repr(name) if name else "the model" for (name, module), flag in
               zip(self.named_modules(), self._train_modes) if module.training != flag]
        return (f"modules {', '.join(odd[:3])}{' ...' if len(odd) > 3 else ''} are not in the training modes the model "
                "was placed with (its graphs run in those modes, or all in eval mode): call placed.train(), which "
                "puts them back, or placed.eval()")

    def _apply(self, fn: Any, recurse: bool = True) -> PlacedModule:
        raise UnsupportedError(
            "a placed model's tensors live on their planned devices; .to()/.cuda()/.cpu()/.half() and the like "
            "would undo the placement: convert the model before placing it, or place it again"
        )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The model's own ``load_state_dict``: each tensor is copied onto its device (keys of the
        original model; ``assign=True`` would replace the placed tensors and is refused)."""
        if assign:
            raise UnsupportedError("load_state_dict(assign=True) would replace the placed tensors; use assign=False "
                                   "(values are copied onto each tensor's device)")
        try:
            return super().load_state_dict(state_dict, strict=strict)
        except RuntimeError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise UsageError(f"{' '.join(lines[:3])[:400]} (a placed model takes the original model's state dict, "
                             "e.g. model.state_dict() of the same architecture)") from e

    def __prepare_scriptable__(self) -> Any:
        """``torch.jit.script`` calls this first: refuse with the reason, not TorchScript's parse error."""
        raise UnsupportedError(
            "torch.jit.script cannot compile a placed model: its stages run on worker threads (and other devices) "
            "TorchScript does not follow. Script the original model, or call the placed model as it is")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise UnsupportedError(f"a PlacedModule cannot be pickled, copied or torch.save()d (it holds worker threads "
                               f"and a placement on devices); {_SAVE_INSTEAD}")

    def __deepcopy__(self, memo: Any) -> Any:
        raise UnsupportedError(f"a PlacedModule cannot be deep-copied (it holds worker threads and a placement on "
                               f"devices); place a deep copy of the model instead, or {_SAVE_INSTEAD}")

    def extra_repr(self) -> str:
        devices = " -> ".join(s.device for s in self.plan.stages)
        if self.problem.objective == "latency":
            return f"stages: {devices}; latency mode; objective={self.plan.objective:.4g} s"
        call = self.plan.meta.get("call") or {}
        predicted = f"; predicted call {call['seconds']:.4g} s" if "seconds" in call else ""
        return (f"stages: {devices}; microbatches={self.microbatches}; steady state {self.plan.objective:.4g} s per "
                f"batch{predicted}")


def _shape_error(error: StageError, sizes: batchdim.CallSizes, args: tuple[Any, ...],
                 kwargs: Mapping[str, Any]) -> UsageError | None:
    """The :class:`UsageError` to raise for the call ``(args, kwargs)`` whose inputs the traced
    graph's guards refuse (torch.export's ``Guard failed: ...``; ``sizes``: the placement's), or
    ``None`` for any other failure."""
    cause = error.__cause__
    text = str(cause).strip() if cause is not None else ""
    if not (isinstance(cause, AssertionError) and "Guard failed" in text):
        return None
    left = left_out(sizes.gm, args, kwargs) if sizes.gm is not None else {}  # the call bound: it ran
    return batchdim.guard_error(text.split("Guard failed:", 1)[1].strip().splitlines()[0], sizes.dynamic_dims, left)
