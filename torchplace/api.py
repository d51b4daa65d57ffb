"""``place()``: trace -> profile -> solve -> split -> wrap, in one call.

    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_inputs=(x,))
    y = placed(x)          # same outputs as model(x), pipelined over the devices
    print(placed.plan)     # which stage went where, predicted time per sample, lower bound, gap
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, ParamSpec, TypeVar

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchplace import callplan, solvers
from torchplace import parallelism as parallelisms
from torchplace.arguments import check_model, example_call, leaf_types, try_example_call
from torchplace.batchdim import (CallSizes, Runs, call_sizes, check_broadcast_rows, check_rows, check_rows_apart,
                                 check_split, dims_of_one, joined_outputs, output_spec, rows_needed,
                                 state_written_per_microbatch)
from torchplace.checks import brief, non_negative_int, positive_float, positive_int
from torchplace.devices import Cluster, Device, cap_memory, check_attached, kind_threads, make_cluster
from torchplace.errors import (
    InfeasibleError,
    InvalidPlanError,
    MicrobatchError,
    UnsupportedError,
    UsageError,
    warn_caller,
)
from torchplace.fxutil import draws_random_numbers, dtype_guards, on_meta_device, run_graph
from torchplace.graph import OpGraph
from torchplace.machine import intra_op_threads
from torchplace.placed_module import PlacedModule
from torchplace.plan import DEFAULT_MICROBATCHES, Plan, Stage
from torchplace.problem import Pipeline, Problem
from torchplace.profiling import Traced, present_kinds, profile, trace
from torchplace.profiling.cache import KEY as CACHE_KEY
from torchplace.profiling.cache import cached_graph, disk_key, load_profile, profile_meta, store_profile
from torchplace.profiling.dynamic import DynamicDims, check_dynamic_dims
from torchplace.profiling.effects import StateSnapshot
from torchplace.profiling.gradcheck import check_gradients
from torchplace.profiling.loss import assumed_loss_bytes, measure_loss_bytes
from torchplace.profiling.links import with_measured_host_links
from torchplace.profiling.training import measure_backward, optimizer_state_factor, training_graph
from torchplace.runtime.devices import check_autocast, random_state_kept
from torchplace.runtime.microbatch import batch_size, scatter
from torchplace.runtime.overhead import executor_overheads

__all__ = ["Placement", "PlacedModule", "place", "placed", "plan_model", "prepare"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _model_left_as_found(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn(model, ...)`` that leaves the random number generators as it found them (profiling runs
    dropout and draws stand-in tensors: ``torch.manual_seed(0)``, placing, then training must draw
    the batches and masks it would draw without placing; :func:`random_state_kept`) and, when it
    raises (an error, or Ctrl-C at any point), sets every module of ``model`` back to the training
    mode it had: a placement that does not return leaves the model in the modes it found (a
    successful one leaves it in the placement's, eval mode for inference)."""
    @functools.wraps(fn)
    def kept(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        model = args[0] if args else kwargs.get("model")
        modes = [(m, m.training) for m in model.modules()] if isinstance(model, nn.Module) else []
        with random_state_kept():
            try:
                return fn(*args, **kwargs)
            except BaseException:
                for module, was in modes:
                    module.training = was
                raise
    return kept


@_model_left_as_found
def place(
    model: nn.Module,
    devices: Sequence[str | Device] | Cluster,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    objective: str = "throughput",
    mode: str = "inference",
    optimizer: str | float | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    schedule: str | None = None,
    recompute: bool | None = None,
    contiguous: bool = True,
    time_limit: float | None = None,
    microbatches: int | str | None = None,
    granularity: str = "operator",
    leaf_modules: Iterable[type | str] = (),
    max_memory: Mapping[str, int | str] | None = None,
    share_cores: bool = False,
    allow_single_device: bool | None = None,
    solver: str = "auto",
    fuse: bool | None = None,
    trace_method: str = "auto",
    dynamic_dims: DynamicDims = None,
    warmup: int = 2,
    repeats: int = 5,
    profiling: str = "fast",
    profile_cache: str | Path | None = None,
    progress: bool = True,
    plan: Plan | str | Path | None = None,
    refine: bool = False,
    parallelism: str = "pipeline",
    allreduce_bandwidth: float | str | None = None,
    tensor_bandwidth: float | str | None = None,
) -> PlacedModule:
    """Place ``model`` on ``devices`` and return a module that runs it there.

    The model is put in eval mode (placement is for inference), traced with torch.fx (or
    torch.export for models fx cannot trace), every operator is timed on each device kind present
    (and estimated for kinds that are not), a placement is solved for, and the traced graph is
    split into stages. The default solver, ``"auto"`` (:mod:`torchplace.solvers.auto`), runs for
    throughput the optimal contiguous DP when the graph has few enough ideals (Tarnawski et al.
    2020, Sec. 5.1.1), else SliceGraph and BRKGA; for latency the best of Baechi's m-SCT and m-ETF
    and the MOIRAI MILP (graphs of at most 60 nodes, started from the better scheduler's plan).

    The placed module's parameters and buffers are the model's own: each moves, in place, to the
    device that runs it (so the model itself is then spread over the devices, as with
    accelerate's ``dispatch_model``), and ``state_dict()`` has the model's keys. Tracing and
    timing leave the model's buffers, the example inputs and the random number generators as
    they were.

    Args:
        model: the model to place.
        devices: device strings (``"cuda:0"``, ``"cpu"``, logical CPUs ``"cpu:0"``, ``"cpu:1"``),
            :class:`Device` objects, or a ready :class:`Cluster`. Unless a Cluster is given, the
            links between host memory and each CUDA device are measured as the runtime copies
            (:func:`torchplace.profiling.links.with_measured_host_links`; about a second).
        example_inputs: positional inputs of one representative call (batch on dim 0); one
            tensor is one positional input.
        example_kwargs: keyword inputs of that call (``{"input_ids": ids, "attention_mask": m}``).
        objective: ``"throughput"`` (min time per sample of a pipeline of micro-batches) or
            ``"latency"`` (min time of one sample; devices run independent branches at once).
        mode: ``"inference"`` or ``"training"``: the model is traced in training mode, every
            operator's backward is timed too, and the plan is solved for a training pipeline
            (Tarnawski Sec. 5.3): forward and backward of a node on one device, memory for
            parameters, gradients, optimizer state and the activations the schedule keeps in
            flight (:mod:`torchplace.costmodel`). ``placed(x)`` then runs with autograd (its
            backward is the usual ``loss.backward()``), ``placed.step(x, target=y, loss_fn=f)``
            runs ``schedule``; ``placed.eval()`` runs the model's eval-mode graph on the same devices.
        optimizer: training: the optimizer whose state the memory model counts (``"sgd"``,
            ``"momentum"``, ``"adam"``, ``"adamw"`` (the default), or state bytes per parameter
            byte). This, ``schedule`` and ``recompute`` are training options: given for inference,
            they are refused (they would change nothing).
        loss_fn: training: the loss ``placed.step`` will compute, ``loss_fn(output, target)``
            (then the default of ``step``'s ``loss_fn``). Its memory on the device of the model's
            outputs is measured on the example call's outputs and ``example_target``
            (:mod:`torchplace.profiling.loss`); without it the plan assumes
            :data:`~torchplace.profiling.loss.ASSUMED_LOSS_FACTOR` times the outputs' bytes, which
            a cross-entropy or mean-square loss needs (so does a model on the meta device, which
            has no outputs to measure on; Piper's plans do not charge the loss).
        example_target: training: the target of the example batch, for ``loss_fn``.
        schedule: training: ``"1f1b"`` (PipeDream-flush, the default) or ``"gpipe"`` (fill-drain);
            default with ``plan``: the schedule the plan was solved for.
        recompute: training: whether the solver may let a device recompute its activations in
            the backward pass where memory demands it (default ``True``).
        contiguous: whether each device must hold one contiguous piece (throughput only; with
            ``False`` a device may hold several pieces, Tarnawski Sec. 5.2).
        time_limit: seconds the solver may take (MILPs stop there with their best plan and bound).
        microbatches: micro-batches each call's batch is split into (throughput only; default
            the given ``plan``'s, else :data:`~torchplace.plan.DEFAULT_MICROBATCHES`), or
            ``"auto"`` (inference): every ``m`` dividing the example batch up to
            :data:`~torchplace.callplan.AUTO_MAX_MICROBATCHES` is predicted and the one with the
            shortest predicted call is kept. The prediction (:mod:`torchplace.callmodel`) runs the
            executor's schedule with each stage timed on one micro-batch (the graph is profiled
            again at that size) and the executor's overheads; the plan prints it
            (``placed.plan``, ``placed.microbatches``).
        granularity: ``"operator"`` or ``"module"`` (one node per leaf module).
        leaf_modules: module classes, or their names (``["GPT2Block"]``), to keep whole (like
            accelerate's ``no_split_module_classes``).
        max_memory: per-device memory caps by device name, bytes or strings like ``"20GiB"``
            (``{"cuda:0": "20GiB"}``; they also cap the devices of a given :class:`Cluster`).
        share_cores: split this machine's cores among the CPU devices: each CPU worker computes,
            and the CPU is profiled, with its share of intra-op threads, so logical CPUs stop
            competing for every core. CPU kernels round by thread count: outputs then equal the
            model run with that many threads (``torch.set_num_threads``), not bit for bit the
            model run with all of them. ``Device(..., threads=)`` sets one device's count.
        allow_single_device: when the whole model on one of ``devices`` (one that holds it) is
            predicted to run a call faster than the solved split, run it there instead (an
            inference call then runs unsplit, ``m = 1``), with a
            :class:`~torchplace.errors.PlacementWarning` and a line in the printed plan saying so.
            ``False`` always keeps the split (the plan still prints the comparison); ``None``, the
            default, is ``True`` (:data:`torchplace.callplan.ALLOW_SINGLE_DEVICE`). A ``plan=``
            given by the user is never replaced.
        solver: a name from :data:`torchplace.solvers.METHODS`, or ``"auto"``.
        fuse: solve on a coarsened graph (MOIRAI fusion rules + Baechi co-placement,
            :func:`torchplace.fusion.coarsen`) and expand the plan back to every operator. Fusion
            makes big graphs tractable but can cost objective, since groups cannot be split; the
            default (``None``) fuses only graphs of more than :data:`FUSE_ABOVE` nodes for
            throughput, or more than the MILP's size limit for latency.
        trace_method: ``"auto"``, ``"fx"`` or ``"export"``.
        dynamic_dims: input dimensions besides the batch that may differ between calls, so one
            placed model serves them all: ``{"input_ids": [1], "attention_mask": [1]}`` (input
            names, or positions, to dims) or ``"auto"`` (export keeps dynamic every dimension the
            model lets vary). Profiling and memory use the example's sizes. A call outside what
            the export accepts raises :class:`UsageError` (:mod:`torchplace.profiling.dynamic`).
        warmup, repeats: profiling runs (median of ``repeats`` after ``warmup``).
        profiling: ``"fast"`` (default): the graph runs once (a short one again, as often as
            its first run fits in half a second), every node timed in its place, and the nodes of
            one operator signature (operation, argument shapes, dtypes, strides) share the median
            of their timings (after ``warmup`` of them); a signature too rare to get three samples
            in its places over the runs (the head of a model that runs once) is timed in a loop of
            its own until its median settles or ``repeats`` were taken; a node that writes a
            tensor in place runs, and is timed, once per run.
            ``"exhaustive"``: every node is timed in each of ``warmup + repeats`` runs of the whole
            graph (:mod:`torchplace.profiling.profile`): 1.1-7x the time, for stage times that
            agree within noise (over seven models, profiles of both kinds alternated in one
            process: median stage error 1-2% for either against their common median, and splits
            no worse; ``benchmarks/profile_accuracy.py``, RESULTS.md).
        profile_cache: a directory (made if missing) that keeps every profile this call makes, and
            gives it back to later calls for the same model, example shapes, device kinds,
            profiling settings and machine (:mod:`torchplace.profiling.cache`): a job that places
            the same model again times nothing. ``None`` (default): nothing is kept.
        progress: show a progress bar while profiling.
        plan: run this plan (a :class:`Plan` or a plan file from :meth:`Plan.save`) instead of
            solving. A plan ``place()`` made carries its graph's fingerprint and profiled costs
            (:mod:`torchplace.profiling.cache`): for the same model, example input shapes and
            arguments the costs are reused and nothing is timed again (with other threads, another
            optimizer or a device kind it has no times for, the model is profiled anew); a plan
            made for another graph is refused. Other plans are checked against the traced model
            and evaluated on new timings. The plan runs with the micro-batches it was made for
            unless ``microbatches=`` says otherwise (then its memory is checked for that ``m``).
        refine: close the loop (:mod:`torchplace.refine`): run the plan on the example inputs,
            re-time each stage as measured, solve again on those costs, run that plan too if it
            differs, and keep the one whose calls measure faster; ``placed.refinement`` (and the
            report) shows both. Inference only. With ``plan=``, the given plan is where it starts,
            and the re-solved plan replaces it when that measures faster.
        parallelism: ``"pipeline"`` (default) or ``"piper"`` (:mod:`torchplace.parallelism`):
            ``mode="training"`` planned with Piper's data x tensor x pipeline parallelism and
            recomputation (Tarnawski, Narayanan, Phanishayee 2021) over the model's layers, with
            Megatron's split of attention and MLP blocks (:mod:`torchplace.profiling.tmpc`). The
            example call is then one micro-batch and ``microbatches`` is Piper's ``N`` (the most
            micro-batches of a batch). :func:`plan_model` returns the plan; ``place()`` cannot run
            it in one process and raises :class:`~torchplace.errors.UnsupportedError` with the plan
            on it (``.plan``), pointing to :func:`torchplace.distributed.place`.
        allreduce_bandwidth: Piper's ``B`` (bytes/s or ``"25GB/s"``): stage-to-stage transfers and
            the data-parallel all-reduce of the gradients; default: the devices' link.
        tensor_bandwidth: bytes/s of the tensor-parallel all-reduces (NVLink within a server in the
            paper); default: ``allreduce_bandwidth``.

    Returns:
        A :class:`PlacedModule` with ``.plan``; ``placed(*example_inputs)`` equals
        ``model(*example_inputs)``.

    Raises:
        UsageError: a bad argument (named, with the fix), or example inputs the model fails on;
            raised before anything is traced or timed.
        TraceError: the model cannot be traced (the message says what to try).
        InfeasibleError: the model does not fit; ``min_memory_bytes`` is the smallest per-device
            memory that would.
        InvalidPlanError: ``plan`` does not place this model's graph, or was made by ``place()``
            for another graph (its fingerprint differs).
        UnsupportedError: ``parallelism="piper"``: its plan runs over many processes, not here.
    """
    check_model(model)  # a model on the meta device is refused here: plan_model() plans it
    placement = prepare(
        model, devices, example_inputs, example_kwargs=example_kwargs, objective=objective, mode=mode,
        optimizer=optimizer, schedule=schedule, recompute=recompute, contiguous=contiguous, time_limit=time_limit,
        microbatches=microbatches, granularity=granularity, leaf_modules=leaf_modules, max_memory=max_memory,
        share_cores=share_cores, allow_single_device=allow_single_device, solver=solver, fuse=fuse,
        trace_method=trace_method, dynamic_dims=dynamic_dims, warmup=warmup, repeats=repeats, profiling=profiling,
        profile_cache=profile_cache, progress=progress, plan=plan, refine=refine, parallelism=parallelism,
        loss_fn=loss_fn, example_target=example_target,
        allreduce_bandwidth=allreduce_bandwidth, tensor_bandwidth=tensor_bandwidth,
    )
    if parallelism == "piper":
        raise parallelisms.refuse_to_run(placement.plan, placement.problem)
    traced, problem, m = placement.traced, placement.problem, placement.microbatches
    joined, sizes = placement.joined, placement.sizes
    placed = PlacedModule(traced, problem, placement.plan, m, example=placement.example, loss_fn=loss_fn,
                          joined_outputs=joined, sizes=sizes)
    if problem.mode == "training" and m > 1:
        _warn_of_batch_statistics(model, m)
    if refine:
        from torchplace.refine import refine as closing_the_loop

        # Measuring runs the model: what it writes (buffers, inputs written in place) is put back
        # or written to copies, as every other step of place() leaves the model and the example;
        # in a finally, since measuring a call that Ctrl-C stops has written them too.
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (placement.args, placement.kwargs))
        try:
            placed = closing_the_loop(placed, args, kwargs, solve=lambda p: _solve(p, solver, time_limit, fuse),
                                      build=lambda p: PlacedModule(traced, problem,
                                                                   _with_call(problem, p, m, _batch(args, kwargs)), m,
                                                                   joined_outputs=joined, sizes=sizes))
        finally:
            with torch.no_grad():
                for name, b in model.named_buffers():
                    b.copy_(buffers[name])
    placed.plan.meta[CACHE_KEY] = placement.cache  # so plan= can skip profiling next time
    return placed


def _with_call(problem: Problem, plan: Plan, microbatches: int, batch: int | None) -> Plan:
    """``plan`` with the prediction of its call in ``meta["call"]``, made here where it has none (a
    plan ``refine=True`` solved on measured costs): without it the plan said it runs with
    :data:`~torchplace.plan.DEFAULT_MICROBATCHES` (``plan.microbatches``, which a saved plan is run
    with), printed no predicted call and measure() compared with steady-state costs. No profile of
    one micro-batch is at hand, so its stage times are the whole batch's divided by ``m``."""
    if "call" not in plan.meta:
        callplan.decide(problem, plan, microbatches, batch, lambda _: None, overheads=executor_overheads(), given=True)
        if plan.meta["call"].get("notes"):
            plan.meta["call"]["notes"] = [f"m={microbatches}: solved by refine=True on measured costs; stage times "
                                          "are the whole batch's divided by m"]
    return plan


class Placement(NamedTuple):
    """What :func:`prepare` decided, before anything runs: the traced model, the measured problem,
    the plan and its micro-batch count, the example call, and the profile a plan file keeps
    (:mod:`torchplace.profiling.cache`). :func:`place` runs it on worker threads,
    :func:`torchplace.distributed.place` on torch.distributed."""

    traced: Any
    problem: Problem
    plan: Plan
    microbatches: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    cache: dict[str, Any]
    joined: tuple[bool, ...] | MicrobatchError | None = None
    """Which outputs the micro-batches of an inference pipeline join, or why they cannot be split
    (:func:`torchplace.batchdim.joined_outputs`)."""
    sizes: CallSizes = CallSizes()
    """The sizes a call must have (:class:`torchplace.batchdim.CallSizes`): the fewest samples per call
    and micro-batch, and the dynamic dims that may not be one."""

    @property
    def example(self) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The example call for a training placement (its eval-mode graph is traced from it)."""
        return (self.args, self.kwargs) if self.problem.mode == "training" else None


def plan_model(model: nn.Module, devices: Sequence[str | Device] | Cluster, example_inputs: Any = (),
               **options: Any) -> tuple[Plan, Problem]:
    """Plan ``model`` on ``devices`` as :func:`place` does, without placing it: the model and the
    inputs stay where they are. Takes :func:`place`'s options.

    A model on the meta device (built under ``torch.device("meta")`` or accelerate's
    ``init_empty_weights()``: shapes, no weights) is planned with estimated costs: the example
    inputs go to the meta device too, tracing and shape propagation run there, and every device
    kind's times are roofline estimates (:mod:`torchplace.profiling.estimate`), memory the exact
    bytes of its parameters and the liveness of its activations.

    With ``mode="training", parallelism="piper"`` the plan is Piper's (stages with data- and
    tensor-parallel degrees, :mod:`torchplace.parallelism`) and the problem its layer graph with
    TMPCs; the example call is one micro-batch.

    Returns:
        ``(plan, problem)``; ``plan.device_map(problem)`` is the placement in accelerate's form,
        and ``place(model, devices, ..., plan=plan)`` runs it once the weights are loaded, where
        the loaded model traces to the same nodes: at operator level a meta model's graph may
        differ (its layouts, its branches), so keep blocks whole (``leaf_modules=["GPT2Block"]``)
        for a plan to run later (:class:`InvalidPlanError` says so otherwise).

    Raises:
        As :func:`place`.

    Example:
        >>> with torch.device("meta"):                                   # doctest: +SKIP
        ...     model = GPT2LMHeadModel(config)
        >>> plan, problem = torchplace.plan_model(model, ["cuda:0", "cuda:1"], example_kwargs={"input_ids": ids})
        >>> plan.device_map(problem)                                      # doctest: +SKIP
    """
    if "plan" in options:
        raise UsageError("plan_model solves for a plan; to run a given plan use place(..., plan=...)")
    if options.get("refine"):
        raise UsageError("plan_model plans without running: refine=True measures a placed model; use place()")
    placement = prepare(model, devices, example_inputs, **options)
    if on_meta_device(model):  # its graph may differ from the loaded model's: _replan says why, if it does
        placement.plan.meta[FROM_META] = True
    return placement.plan, placement.problem


FROM_META = "planned_on_meta"
"""``Plan.meta`` key: the plan was made by :func:`plan_model` from a model on the meta device."""


@_model_left_as_found
def prepare(
    model: nn.Module,
    devices: Sequence[str | Device] | Cluster,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    objective: str = "throughput",
    mode: str = "inference",
    optimizer: str | float | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    example_target: Any = None,
    schedule: str | None = None,
    recompute: bool | None = None,
    contiguous: bool = True,
    time_limit: float | None = None,
    microbatches: int | str | None = None,
    granularity: str = "operator",
    leaf_modules: Iterable[type | str] = (),
    max_memory: Mapping[str, int | str] | None = None,
    share_cores: bool = False,
    allow_single_device: bool | None = None,
    solver: str = "auto",
    fuse: bool | None = None,
    trace_method: str = "auto",
    dynamic_dims: DynamicDims = None,
    warmup: int = 2,
    repeats: int = 5,
    profiling: str = "fast",
    profile_cache: str | Path | None = None,
    progress: bool = True,
    plan: Plan | str | Path | None = None,
    refine: bool = False,
    parallelism: str = "pipeline",
    allreduce_bandwidth: float | str | None = None,
    tensor_bandwidth: float | str | None = None,
    sends_tensors_only: bool = False,
) -> Placement:
    """Decide where ``model`` runs on ``devices`` without running it: :func:`place` up to its
    plan (trace, profile, solve, choose the micro-batch count or one device), with
    :func:`place`'s arguments and errors. A model on the meta device is planned from shapes
    (:func:`plan_model`). ``sends_tensors_only``: the stages will run where only tensors cross
    between them (``torch.distributed.pipelining``): a node that makes a tuple or a list, or in an
    fx graph a Python number, shares a device with the nodes that read it
    (:func:`keep_unsendable_together`)."""
    model = check_model(model, allow_meta=True)
    if mode not in ("inference", "training"):
        raise UsageError(f"mode must be 'inference' or 'training', got {mode!r}")
    training_only = [f"{name}={brief(value)}" for name, value in
                     (("optimizer", optimizer), ("schedule", schedule), ("recompute", recompute)) if value is not None]
    if mode != "training" and training_only:
        one = len(training_only) == 1
        raise UsageError(f"{', '.join(training_only)} {'is a training option' if one else 'are training options'} "
                         "(the optimizer state, pipeline schedule and recomputation a training plan counts), and this "
                         f"placement is for inference: pass mode='training' to place it for training, or leave "
                         f"{'it' if one else 'them'} out")
    optimizer = "adamw" if optimizer is None else optimizer
    recompute = True if recompute is None else recompute
    if mode == "training" and objective != "throughput":
        raise UsageError("training is placed for throughput (a pipeline of micro-batches); use objective='throughput'")
    if mode == "training" and refine is True:
        raise UsageError("refine=True measures inference calls; place for training without it (measure a training "
                         "step with placed.measure(x, target=y, loss_fn=f))")
    if loss_fn is not None and (mode != "training" or not callable(loss_fn)):
        raise UsageError(f"loss_fn is the training loss (mode='training'), a function loss_fn(output, target) -> "
                         f"scalar tensor; got {brief(loss_fn)} with mode={mode!r}")
    if example_target is not None and loss_fn is None:
        raise UsageError("example_target is the target of loss_fn: give loss_fn too (or leave example_target out)")
    if objective not in ("throughput", "latency"):
        raise UsageError(
            f"objective must be 'throughput' (pipelined time per sample) or 'latency' (time of one sample), "
            f"got {objective!r}"
        )
    solvers.check_method(solver, objective)
    parallelisms.check(parallelism, mode=mode, objective=objective, solver=solver, contiguous=contiguous, plan=plan,
                       allreduce_bandwidth=allreduce_bandwidth, tensor_bandwidth=tensor_bandwidth,
                       schedule="1f1b" if schedule is None else schedule, fuse=fuse,
                       allow_single_device=allow_single_device)
    for name, flag in (("contiguous", contiguous), ("progress", progress), ("recompute", recompute),
                       ("share_cores", share_cores), ("refine", refine)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name} must be True or False, got {brief(flag)}")
    if fuse is not None and not isinstance(fuse, bool):
        raise UsageError(f"fuse must be True, False or None (fuse only big graphs), got {brief(fuse)}")
    given = _load_plan(plan) if plan is not None else None
    if schedule is None:  # a given plan runs with the schedule it was solved for, as with its micro-batches
        schedule = given.meta.get("schedule", "1f1b") if given is not None else "1f1b"
    if mode == "training" and schedule not in ("gpipe", "1f1b"):
        raise UsageError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    if objective == "latency" and microbatches not in (None, 1):
        raise UsageError(f"microbatches={brief(microbatches)} splits each call into a pipeline of micro-batches "
                         "(objective='throughput'); objective='latency' runs each call whole, its devices working "
                         "on independent branches at once: leave microbatches out (torchplace plan: --microbatches)")
    if microbatches is None:
        microbatches = DEFAULT_MICROBATCHES if given is None else given.microbatches
    if microbatches == "auto":
        if mode == "training":
            raise UsageError("microbatches='auto' is for inference (a training plan's memory depends on m, so the "
                             "solver needs it first): give the number of micro-batches, e.g. microbatches=4")
    else:
        microbatches = positive_int(microbatches, "microbatches")
    if allow_single_device is None:
        allow_single_device = callplan.ALLOW_SINGLE_DEVICE
    if not isinstance(allow_single_device, bool):
        raise UsageError(f"allow_single_device must be True or False, got {brief(allow_single_device)}")
    time_limit = None if time_limit is None else positive_float(time_limit, "time_limit", unit="of seconds")
    warmup, repeats = non_negative_int(warmup, "warmup"), positive_int(repeats, "repeats")
    if profiling not in ("fast", "exhaustive"):
        raise UsageError(f"profiling must be 'fast' (each distinct operator timed once) or 'exhaustive' (every "
                         f"operator in every run), got {brief(profiling)}")
    exhaustive = profiling == "exhaustive"
    cache_dir = _cache_dir(profile_cache)
    args, kwargs = example_call(example_inputs, example_kwargs)
    if microbatches != 1 and parallelism != "piper" and (objective == "throughput" or mode == "training"):
        _check_splittable(args, kwargs, microbatches)
    shapes_only = on_meta_device(model)  # planned, never run: its devices need not be on this machine
    if shapes_only:  # the inputs join the weights on the meta device
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    leaves = leaf_types(model, leaf_modules)
    if share_cores and (isinstance(devices, Cluster) or (isinstance(devices, (list, tuple)) and devices and not any(
            isinstance(d, str) for d in devices))):
        raise UsageError("share_cores=True splits this machine's cores among the CPU devices named by strings "
                         "('cpu:0', 'cpu:1'), and these devices are Device objects, which keep their own threads: "
                         "give each its count (Device(..., threads=n), or 'threads' in a cluster file)")
    if isinstance(devices, Cluster):
        if not shapes_only:
            check_attached(devices)
        cluster = devices if max_memory is None else dataclasses.replace(  # caps as for device strings
            devices, devices=tuple(cap_memory(devices.devices, max_memory)))
    elif shapes_only and devices and all(isinstance(d, Device) for d in devices):
        cluster = Cluster(tuple(cap_memory(devices, max_memory)))  # type: ignore[arg-type]
    else:
        cluster = make_cluster(devices, max_memory, share_cores=share_cores)
        if not shapes_only:  # the host <-> GPU links as the runtime pays them (a given Cluster keeps its own)
            cluster = with_measured_host_links(cluster)
    if given is not None:
        check_runnable(given, plan)  # type: ignore[arg-type]
        _check_given_kind(given, plan, objective=objective, mode=mode)  # type: ignore[arg-type]
    training = mode == "training"
    if training:
        optimizer_state_factor(optimizer)
    modes = {m: m.training for m in model.modules()}
    if not training:
        _warn_of_eval_mode(model)
    if not (training and model.training and not all(modes.values())):  # frozen parts (a batch norm in eval) stay
        model.train(training)
    measured_loss = None  # bytes of the training loss on the example outputs (loss_fn given)
    # The model runs on the whole example eagerly only where its output is needed (the loss's
    # bytes), or when tracing fails, to say whether the inputs were the cause (a full forward:
    # 2.7 s of GPT-2 small's place() at one thread). The checks after tracing run it on one or two
    # samples (batchdim, gradcheck), so its forward hooks fire then. A meta model's Python may
    # branch on values it does not have, so it is never run (export does not need it to).
    called = False
    drew = False  # the traced training graph draws random numbers
    try:
        if not shapes_only and training and loss_fn is not None:
            output, called = try_example_call(model, args, kwargs), True
            measured_loss = measure_loss_bytes(output, loss_fn, example_target)
            del output
        with torch.no_grad():
            traced = trace(model, args, kwargs, granularity=granularity, leaf_modules=leaves, method=trace_method,
                           training=training, dynamic_dims=dynamic_dims)
        if traced.method == "export":  # before the checks, which would blame something else
            check_autocast(dtype_guards(traced.gm))
        if training and not shapes_only:  # a no_grad block or a hook in forward is not in the trace
            drew = check_gradients(model, traced.gm, args, kwargs,
                                   microbatches if isinstance(microbatches, int) else 1)
    except Exception:  # the model's modes are put back on the way out (_model_left_as_found)
        if not shapes_only and not called:
            try_example_call(model, args, kwargs)  # raises UsageError when the inputs are the cause
        raise
    if not training:
        _warn_of_fast_path(model)
    _warn_of_hooks(model)
    runs = None if shapes_only else Runs(model, traced.gm, traced.flat_inputs, args, kwargs)  # shared by the checks
    if runs is not None and (spec := output_spec(runs)) is not None:  # the model's ModelOutput, not fx's dict
        traced = dataclasses.replace(traced, output_spec=spec)
    rows = 1 if runs is None else _rows_needed(runs, microbatches if objective == "throughput" or training else 1)
    joined = None  # which outputs a pipeline's micro-batches join, or why they cannot be split
    if runs is not None and objective == "throughput" and not training:
        joined = joined_outputs(runs, microbatches if isinstance(microbatches, int) else 1)
        if traced.effects.written_state and not isinstance(joined, Exception):
            joined = state_written_per_microbatch(traced.effects.written_state, microbatches)
    elif runs is not None and training:  # step() gives each micro-batch's outputs to the loss; a call joins them
        if microbatches != 1:
            check_rows_apart(Runs(model, traced.gm, traced.flat_inputs, args, kwargs))  # own runs: in eval mode
            if isinstance(microbatches, int):  # step() splits its inputs as calls do
                check_broadcast_rows(runs, microbatches)
        try:
            joined = check_split(runs, max(microbatches, 2), values=False)  # type: ignore[call-overload]
        except MicrobatchError as error:
            joined = error  # a call split into micro-batches raises it
    kinds = sorted({d.kind for d in cluster.devices})
    threads = kind_threads(cluster)
    settings = {"threads": threads, "optimizer": optimizer if training else None}
    graph = None if given is None else cached_graph(given.meta, traced, mode, kinds, settings, source=_source(plan))
    cached = graph is not None

    def profiled(call_args: tuple[Any, ...], call_kwargs: Mapping[str, Any]) -> Any:
        """The graph's costs on this call (forward and backward for training), from the profile
        cache when it has them."""
        key = None if cache_dir is None else disk_key(traced, mode, (call_args, call_kwargs), kinds, settings,
                                                      exhaustive)
        hit = None if key is None else load_profile(cache_dir, key, traced.graph)  # type: ignore[arg-type]
        if hit is not None:
            return hit
        costs = profile(traced, call_args, call_kwargs, kinds=kinds, warmup=warmup, repeats=repeats,
                        progress=progress, grad=training, threads=threads, exhaustive=exhaustive)
        if training:
            costs = _training_graph(traced, costs, call_args, call_kwargs, kinds, optimizer, warmup, repeats,
                                    progress, threads)
        if key is not None:
            store_profile(cache_dir, key, costs)  # type: ignore[arg-type]
        return costs

    if graph is None:
        graph = profiled(args, kwargs)
    if sends_tensors_only:
        graph = keep_unsendable_together(graph, traced.gm)
    if training:
        graph.meta["loss_bytes"] = assumed_loss_bytes(graph) if measured_loss is None else measured_loss
    if parallelism == "piper":
        problem, solved = parallelisms.piper_plan(graph, cluster, model, microbatches=microbatches,  # type: ignore[arg-type]
                                                  solver=solver, recompute=recompute, time_limit=time_limit,
                                                  allreduce_bandwidth=allreduce_bandwidth,
                                                  tensor_bandwidth=tensor_bandwidth, traced=traced)
        return Placement(traced, problem, solved, microbatches, args, kwargs,  # type: ignore[arg-type]
                         profile_meta(traced, graph, mode, settings))
    # Inference: the memory model charges activations per micro-batch (for "auto", the largest one).
    split = microbatches if isinstance(microbatches, int) else 1
    pipeline = Pipeline(_split_count(args, kwargs, split)) if objective == "throughput" else None
    random = training and recompute and (drew or any(draws_random_numbers(traced.gm, n)
                                                     for n in traced.gm.graph.nodes))
    written = traced.written_inputs() if training and recompute else []
    # a stage that draws random numbers would draw them again when recomputed, and one that writes
    # a model input in place would write it again: such models are planned without recomputation
    unrecomputable = ("the model draws random numbers (dropout), which a recomputed stage would draw again, "
                      "differently" if random else f"the model writes its input {written[0]!r} in place, which a "
                      "recomputed stage would write again" if written else None)
    if training:
        # as many micro-batches as a step runs: the executor clamps an m above the example's batch (scatter);
        # m = 1e9 for a batch of 8 was priced, and simulated, a micro-batch at a time (hours; found by fuzzing)
        batch = _batch(args, kwargs)
        pipeline = Pipeline(min(split, batch) if batch else split, schedule,  # type: ignore[arg-type]
                            recompute and unrecomputable is None)
    problem = Problem(graph, cluster, objective=objective, mode=mode,  # type: ignore[arg-type]
                      contiguous=contiguous and objective == "throughput", pipeline=pipeline)
    if given is not None:
        _check_given_recomputation(given, problem, unrecomputable)
        solved = _replan(problem, given)
    elif len(graph) == 0:
        solved = Plan.build(problem, [Stage(cluster.devices[0].name, ())], solver="none", seconds=0.0, lower_bound=0.0)
    else:
        try:
            solved = _solve(problem, solver, time_limit, fuse)
        except InfeasibleError as error:
            if unrecomputable is None:
                raise
            raise InfeasibleError(f"{str(error).rstrip('.')}. Recomputation was not tried: {unrecomputable}.",
                                  error.min_memory_bytes) from error
    m = split
    if len(graph) > 0 and not shapes_only:
        def profile_microbatch(m: int) -> Any:  # the graph's times on one of m micro-batches (None: costs cached)
            chunks = scatter(args, kwargs, m)
            if len(chunks) > 1 and _batch(*chunks[-1]) != _batch(*chunks[0]):
                # the last micro-batch is the smallest, and only the first is timed: a graph that fixes a
                # size there (a guard, an index) would fail on every call of the example's size
                _check_runs_on_microbatch(traced, *chunks[-1], m, _batch(args, kwargs))
            if cached:
                return None
            chunk_args, chunk_kwargs = chunks[0]
            try:
                return profiled(chunk_args, chunk_kwargs)  # training: forward and backward of one micro-batch
            except Exception:
                _check_runs_on_microbatch(traced, chunk_args, chunk_kwargs, m, _batch(args, kwargs))
                raise  # the model runs there: profiling failed (the prediction falls back, and says so)

        refused = isinstance(joined, MicrobatchError) and microbatches == "auto"
        decision = callplan.decide(problem, solved, 1 if refused else microbatches, _batch(args, kwargs),
                                   profile_microbatch, overheads=executor_overheads(),
                                   allow_single_device=allow_single_device, given=given is not None,
                                   most=None if rows == 1 else max(1, (_batch(args, kwargs) or 1) // rows))
        solved, m = decision.plan, decision.microbatches
        if refused and "call" in solved.meta:
            solved.meta["call"].setdefault("notes", []).append(f"microbatches='auto' tried only m=1: {joined}")
    ones = () if runs is None else dims_of_one(runs)
    declared = check_dynamic_dims(traced.dynamic_dims, model, args, kwargs)  # by name, dims >= 0: as guards read
    return Placement(traced, problem, solved, m, args, kwargs, profile_meta(traced, graph, mode, settings), joined,
                     call_sizes(rows, ones, traced.gm, args, kwargs, declared))


def _check_splittable(args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int | str) -> None:
    """Refuse micro-batches of an example whose tensor inputs disagree on dim 0 (an input without
    the batch's rows), before anything is traced or timed; ``"auto"`` then keeps one micro-batch.

    Raises:
        MicrobatchError: for a number of micro-batches above one.
    """
    try:
        batch_size(args, kwargs)
    except MicrobatchError as error:
        if microbatches != "auto":
            raise MicrobatchError(f"microbatches={microbatches}: {error}") from None


def _rows_needed(runs: Runs, microbatches: int | str) -> int:
    """:func:`torchplace.batchdim.rows_needed`, checked against the example and the micro-batches
    asked for (1 for a latency placement, which splits nothing).

    Raises:
        UsageError: the example batch is smaller than the trace holds for.
        MicrobatchError: ``microbatches`` splits the example into micro-batches that small.
        TraceError: the trace differs from the model on two samples as well.
    """
    rows = rows_needed(runs)
    check_rows(runs.args, runs.kwargs, microbatches if isinstance(microbatches, int) else 1, rows, fix="microbatches")
    return rows


def _check_runs_on_microbatch(traced: Traced, args: tuple[Any, ...], kwargs: Mapping[str, Any], m: int,
                              batch: int | None) -> None:
    """Run the traced graph on one of ``m`` micro-batches (``args``, ``kwargs``).

    Raises:
        MicrobatchError: when it fails there: the model fixes its batch size, and its placed model
            would fail on every call split into micro-batches.
    """
    snapshot = StateSnapshot(traced.gm)  # a forward that updates buffers (batch norm) leaves them as they were
    try:
        with torch.no_grad():  # an Interpreter, not the module's call, which prints every failure's traceback
            run_graph(traced.gm, traced.flat_inputs(args, kwargs))
    except Exception as error:
        size = next((t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                     and t.dim() > 0), None)
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise MicrobatchError(
            f"the model does not run on one of {m} micro-batches ({size} of the example's {batch} samples): "
            f"{type(error).__name__}: {first_line}. It fixes its batch size (a reshape or view to the example's "
            "size, a size taken from a constant), or an operator needs more samples (batch norm in training needs two); "
            "place it with microbatches=1 (or fewer), or take the size from the input (x.view(x.shape[0], ...) or "
            "x.view(-1, ...))"
        ) from error
    finally:
        snapshot.restore()


def _cache_dir(profile_cache: str | Path | None) -> Path | None:
    """``profile_cache`` as a directory (``~`` expanded; made when first written)."""
    if profile_cache is None:
        return None
    if not isinstance(profile_cache, (str, Path)) or not str(profile_cache):
        raise UsageError(f"profile_cache must be a directory path (str or Path), got {brief(profile_cache)}")
    path = Path(profile_cache).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"profile_cache {str(path)!r} is a file; give a directory (it is made if missing)")
    return path


def _batch(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The example batch micro-batches split (``None`` when the inputs have no common one: the
    executor then refuses to split, and the prediction takes one micro-batch)."""
    try:
        return batch_size(args, kwargs)
    except ValueError:
        return None


def _training_graph(traced: Any, graph: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], kinds: Sequence[str],
                    optimizer: str | float, warmup: int, repeats: int, progress: bool,
                    threads: Mapping[str, int]) -> Any:
    """The training graph: every node's backward timed on each kind present (twice the forward
    estimate elsewhere) with that kind's threads, with gradients and optimizer state
    (:mod:`torchplace.profiling.training`). A model on the meta device has nothing to time: every
    kind is estimated, as :func:`~torchplace.profiling.profile` estimates its forward."""
    present = set() if on_meta_device(traced.gm) else present_kinds()
    measured = {}
    for kind in kinds:
        if kind in present:
            with intra_op_threads(threads.get(kind)):
                measured[kind] = measure_backward(traced, args, kwargs, kind=kind, warmup=min(warmup, 1),
                                                  repeats=repeats, progress=progress)
    return training_graph(graph, measured, optimizer, estimated=[k for k in kinds if k not in present])


def _split_count(args: tuple[Any, ...], kwargs: Mapping[str, Any], microbatches: int) -> int:
    """The ``m`` whose ``1/m`` of the example batch is at least the largest micro-batch the runtime
    makes of it (:func:`torchplace.runtime.microbatch.scatter`): what the memory model divides
    activations by."""
    batch = _batch(args, kwargs)
    if not batch:
        return 1
    return batch // -(-batch // min(microbatches, batch))


def check_runnable(given: Plan, plan: Plan | str | Path) -> None:
    """Refuse a Piper plan given to run (``place(plan=)``, ``torchplace.distributed.place(plan=)``):
    its stages are layer groups over device ranges with per-node TMPCs, which no runtime here runs.

    Raises:
        UnsupportedError: saying what runs instead.
    """
    if any(s.tmpcs for s in given.stages):
        raise UnsupportedError(
            f"{_source(plan)} is a Piper plan (stages over device ranges such as {given.stages[0].device!r}, with "
            "data- and tensor-parallel degrees and a TMPC per layer): no runtime here runs Piper plans yet. "
            "torchplace.distributed.place runs operator-level plans, with one (data_parallel, tensor_parallel) "
            "for every stage; place() without plan= solves a pipeline it runs here")


def _check_given_kind(given: Plan, plan: Plan | str | Path, **asked: str) -> None:
    """Refuse a given plan made for another objective or mode than this placement (a latency plan
    run as a pipeline would run, with another objective than the one it was solved for).

    Raises:
        InvalidPlanError: naming the option to give.
    """
    for option, value in asked.items():
        recorded = given.meta.get(option)
        if recorded is not None and recorded != value:
            raise InvalidPlanError(f"{_source(plan)} was solved for {option}={recorded!r}, not {value!r}: place it "
                                   f"with {option}={recorded!r}, or solve anew without the plan")


def _source(plan: Plan | str | Path) -> str:
    return "the plan" if isinstance(plan, Plan) else f"plan file {str(plan)!r}"


def _load_plan(plan: Plan | str | Path) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise UsageError(f"plan must be a Plan or the path of a plan file, got {brief(plan)}")


REPLAN_BOUND_SECONDS = 1.0
"""How long a saved plan's lower bound may take (the cut bound's exact cuts) when it is reused."""


def keep_unsendable_together(graph: OpGraph, gm: torch.fx.GraphModule) -> OpGraph:
    """``graph`` with every node that makes a value ``torch.distributed.pipelining`` cannot send
    colocated with the nodes that read it, so no stage boundary falls between them (their
    colocation groups, backward nodes included, merge into one). The engine sends only tensors, so:

    * a node that makes a container (a tuple or list: ``chunk``, ``split``, a multi-output module;
      its fx users all take items with ``getitem``) stays with the nodes that take its items;
    * in an fx graph, a node that makes a Python number (``n = x.shape[0]``,
      :attr:`~torchplace.fxutil.TensorInfo.number`) stays with the nodes that read it. An
      exported graph's numbers are symbolic, and a stage that reads one computes it from the sizes
      it receives (:mod:`torchplace.runtime.dist_numbers`); an fx graph's are plain numbers of
      the traced call, which no other stage can compute.

    With ``contiguous=True`` (one piece per device) this keeps them in one stage; a
    non-contiguous plan may still put them in two pieces of one device, which the engine's bridge
    refuses before any communication."""
    import operator

    node_of = {f: v for v, record in graph.records() if not record.backward for f in record.fx_nodes}
    pairs, why = [], {}
    for n in gm.graph.nodes:
        if n.name not in node_of or not n.users:
            continue
        info = n.meta.get("torchplace")
        if not isinstance(n.meta.get("val"), torch.Tensor) and all(
                u.op == "call_function" and u.target is operator.getitem for u in n.users):
            why.setdefault(node_of[n.name], "items")
        elif "val" not in n.meta and info is not None and info.number:
            why.setdefault(node_of[n.name], "number")
        else:
            continue
        pairs += [(node_of[n.name], node_of[u.name]) for u in n.users if u.name in node_of]
    pairs = [(a, b) for a, b in pairs if a != b]
    if not pairs:
        return graph
    label = {v: record.colocation or f"{why.get(v, 'unsent')}:{v}" for v, record in graph.records()}
    parent = {g: g for g in set(label.values())}

    def root(g: str) -> str:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for a, b in pairs:
        parent[root(label[b])] = root(label[a])
    grouped: dict[str, int] = {}
    for v in graph:
        grouped[root(label[v])] = grouped.get(root(label[v]), 0) + 1
    return graph.with_records(lambda v, r: dataclasses.replace(
        r, colocation=root(label[v]) if grouped[root(label[v])] > 1 else r.colocation))


def _warn_of_fast_path(model: nn.Module) -> None:
    """Warn that ``model``'s attention takes PyTorch's fused fast path under ``no_grad``, which no
    trace captures: the placed model then equals it to float rounding, not bitwise."""
    if not torch.backends.mha.get_fastpath_enabled():
        return
    names = [name or type(model).__name__ for name, m in model.named_modules()
             if isinstance(m, nn.MultiheadAttention) and m.batch_first]
    if names:
        warn_caller(f"{len(names)} nn.MultiheadAttention module(s) with batch_first=True ({names[0]}, ...) take "
                    "PyTorch's fused fast path in eval mode under torch.no_grad(), which a traced graph does not "
                    "contain: there the placed model equals the model to float rounding, not bitwise. Call "
                    "torch.backends.mha.set_fastpath_enabled(False) to have the model take the ordinary path too")


def _first_few(names: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names`` for a warning's parenthesis, ``", ..."`` after them if there are more."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def _warn_of_eval_mode(model: nn.Module) -> None:
    """Warn that placing for inference puts ``model`` in eval mode (as ``model.eval()``), where it
    holds modules in training mode that compute otherwise there (:func:`_computes_otherwise_in_eval`).
    (A model built in code is in training mode; one without such modules computes the same in both,
    and is not warned of.)"""
    changed = [f"{name or type(model).__name__} ({type(m).__name__})" for name, m in model.named_modules()
               if m.training and _computes_otherwise_in_eval(m)]
    if changed:
        warn_caller(f"the model is in training mode, and placing it for inference puts it in eval mode, as "
                    f"model.eval() does: {len(changed)} module(s) ({_first_few(changed)}) now compute as in "
                    "eval mode (no dropout; batch norm with its running statistics), and the placed model with them. "
                    "Call model.eval() before placing to say so, or place it with mode='training' to train")


def _computes_otherwise_in_eval(module: nn.Module) -> bool:
    """Whether ``module`` itself computes otherwise in eval mode than in training mode: dropout with
    ``p > 0`` (a dropout module, or the dropout of an attention or of a stacked RNN's layers), and
    batch and instance norms with running statistics to use in eval mode (without them a norm uses
    the batch's statistics in both modes: a batch norm whose running statistics are ``None``, as
    PyTorch's forward decides, an instance norm with ``track_running_stats=False``)."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout > 0
    if isinstance(module, nn.RNNBase):
        return module.dropout > 0 and module.num_layers > 1
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.running_mean is not None or module.running_var is not None
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.track_running_stats
    return False


def _warn_of_batch_statistics(model: nn.Module, m: int) -> None:
    """Warn that the batch norms ``model`` trains normalise each of the ``m`` micro-batches by its
    own statistics, and update their running statistics once per micro-batch: as the model on the
    same micro-batches, not as on the whole batch at once."""
    names = [name or type(model).__name__ for name, module in model.named_modules()
             if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]
    if names:
        warn_caller(f"{len(names)} batch norm module(s) in training mode ({_first_few(names)}) normalise each of the {m} "
                    "micro-batches by its own statistics and update their running statistics once per micro-batch, "
                    "as the model run on the same micro-batches does, not as on the whole batch at once; place with "
                    "microbatches=1 to train on whole batches, or use a norm that keeps samples apart (nn.GroupNorm, "
                    "nn.LayerNorm)")


def _warn_of_hooks(model: nn.Module) -> None:
    """Warn that the forward hooks of ``model``'s modules ran while tracing only: what they put into
    the outputs is in the trace, their other effects (storing activations, logging) are not; and
    that its modules' backward hooks never run on the placed graph."""
    hooked = [name or type(model).__name__ for name, m in model.named_modules()
              if m._forward_hooks or m._forward_pre_hooks]
    if hooked:
        warn_caller(f"forward hooks of {len(hooked)} module(s) ({_first_few(hooked)}) ran while tracing: "
                    "what they compute into the outputs is in the placed graph, but their other effects (storing "
                    "activations, logging) will not happen on calls of the placed model; compute such values as "
                    "outputs of the model instead")
    backward = [name or type(model).__name__ for name, m in model.named_modules()
                if m._backward_hooks or m._backward_pre_hooks]
    if backward:
        warn_caller(f"backward hooks of {len(backward)} module(s) ({_first_few(backward)}) will not run on "
                    "the placed model: its traced graph makes no module calls, so a backward through it never "
                    "reaches them; register tensor hooks on the parameters (p.register_hook) instead")


def _check_given_recomputation(plan: Plan, problem: Problem, unrecomputable: str | None) -> None:
    """Refuse a given plan that recomputes where this placement may not, saying why
    (``unrecomputable``: why the model cannot be recomputed, if it cannot)."""
    recomputing = sorted({s.device for s in plan.stages if s.recompute})
    if not recomputing or (problem.pipeline is not None and problem.pipeline.recompute):
        return
    why = (unrecomputable if unrecomputable is not None else "place() was called with recompute=False"
           if problem.mode == "training" else "the model is placed for inference, which keeps no activations to "
           "recompute")
    raise InvalidPlanError(f"the given plan recomputes activations on {', '.join(recomputing)}, but {why}: "
                           "give a plan without recomputation (one made with recompute=False), or let place() solve")


def _replan(problem: Problem, plan: Plan) -> Plan:
    """``plan``'s stages, evaluated and validated on this problem (the model's new timings)."""
    placed = {v for s in plan.stages for v in s.nodes}
    missing, extra = set(problem.graph) - placed, placed - set(problem.graph)
    if missing or extra:
        differs = (f"the plan does not fit this model's graph ({len(missing)} node(s) unplaced, e.g. "
                   f"{sorted(missing)[:3]}; {len(extra)} unknown, e.g. {sorted(extra)[:3]})")
        if plan.meta.get(FROM_META):
            raise InvalidPlanError(
                f"{differs}: the plan was made by plan_model from the model on the meta device, and the loaded "
                "model traces to another operator graph (the meta device lays out some outputs otherwise, so a "
                ".contiguous() copies on one and not the other, and code that branches on the device or on values "
                "traces otherwise, which renames operators). Plan with the model's blocks kept whole "
                "(leaf_modules=['GPT2Block'], as accelerate's no_split_module_classes), whose nodes match, or "
                "use plan.device_map(problem) with accelerate, or place the loaded model without plan=")
        raise InvalidPlanError(
            f"{differs}: trace the same model with the same granularity, leaf_modules and trace_method as when the "
            "plan was made"
        )
    from torchplace.solvers.bounds import combinatorial_lower_bound

    solver = plan.solver if plan.solver.endswith(" (given)") else f"{plan.solver} (given)"  # saved again: once
    try:
        return Plan.build(problem, plan.stages, solver=solver, seconds=0.0,
                          lower_bound=combinatorial_lower_bound(problem, time_limit=REPLAN_BOUND_SECONDS),
                          status="feasible")
    except InvalidPlanError as error:
        if problem.contiguous and _valid(plan, dataclasses.replace(problem, contiguous=False)):
            raise InvalidPlanError(f"{error}: the given plan puts several pieces on one device, as a plan solved "
                                   "with contiguous=False does; place it with contiguous=False") from error
        raise


def _valid(plan: Plan, problem: Problem) -> bool:
    try:
        plan.validate(problem)
    except InvalidPlanError:
        return False
    return True


FUSE_ABOVE = 1000
"""Throughput graphs with more nodes than this are coarsened before solving when ``fuse=None``."""


def _solve(problem: Problem, solver: str, time_limit: float | None, fuse: bool | None) -> Plan:
    """Solve ``problem``, on its coarsened graph when ``fuse`` says so (see :func:`place`)."""
    from torchplace.fusion import coarsen
    from torchplace.solvers.auto import CUT_BOUND_SHARE, DEFAULT_TIME_LIMIT, MILP_NODES
    from torchplace.solvers.bounds import combinatorial_lower_bound

    if fuse is None:
        fuse = len(problem.graph) > (MILP_NODES if problem.objective == "latency" else FUSE_ABOVE)
    if not fuse:
        return solvers.solve(problem, method=solver, time_limit=time_limit)
    start = time.perf_counter()
    coarse = coarsen(problem.graph, devices=len(problem.cluster))
    plan = solvers.solve(coarse.coarse_problem(problem), method=solver, time_limit=time_limit)
    # the fine graph's bound (the coarse one's need not hold for it), in what the limit leaves
    limit = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    left = max(0.0, limit - (time.perf_counter() - start))
    bound = combinatorial_lower_bound(problem, time_limit=min(left, CUT_BOUND_SHARE * limit))
    return coarse.expand_plan(plan, problem, lower_bound=bound)


class _LazyPlaced(nn.Module):
    """Holds a model and places it on its first call, using that call's inputs as examples.

    Like a :class:`PlacedModule`, it is the model as far as its state goes: it shares the model's
    children, parameters and buffers (the same dicts, so a conversion before placing changes the
    model's own tensors), so ``state_dict()`` has the model's keys and a checkpoint of the model
    loads into it (and the other way round)."""

    def __init__(self, module: nn.Module, devices: Any, options: Mapping[str, Any]) -> None:
        super().__init__()
        self.__dict__["module"] = module  # not a child: its children, parameters and buffers are ours
        for slots in ("_modules", "_parameters", "_buffers", "_non_persistent_buffers_set"):
            self.__dict__[slots] = getattr(module, slots)
        self.training = module.training
        self._devices, self._options = devices, dict(options)
        self.__dict__["placed"] = None  # not a registered child: it shares the module's tensors

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.placed is None:
            self.__dict__["placed"] = place(self.module, self._devices, args, example_kwargs=kwargs, **self._options)
            self.training = self.module.training  # place() puts a model placed for inference in eval mode
        return self.placed(*args, **kwargs)

    def train(self, mode: bool = True) -> _LazyPlaced:
        if mode and self._options.get("mode", "inference") != "training":
            raise UnsupportedError("this model is placed for inference on its first call, with its graph traced in "
                                   "eval mode: train() would change nothing; decorate with mode='training' to train it")
        # the model's root (no child of ours) and its children; once placed, frozen modules go back
        # to the modes they were placed with
        (self.module if self.placed is None else self.placed).train(mode)
        self.training = mode
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own ``state_dict`` (the model's keys, its hooks)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The model's own ``load_state_dict`` (once placed, the placed model's: a mismatch is a
        :class:`UsageError`, ``assign=True`` is refused)."""
        if self.placed is not None:
            return self.placed.load_state_dict(state_dict, strict=strict, assign=assign)
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    _torchplace_placed = True  # torchplace.arguments.check_model refuses to place it (it places itself)

    def _apply(self, fn: Any, recurse: bool = True) -> _LazyPlaced:
        if self.placed is not None:  # refused as for any placed model: the tensors live on their devices
            self.placed._apply(fn, recurse)
        self.module._apply(fn, recurse)  # the model's own (an override of its class too): its tensors are ours
        return self

    @property
    def plan(self) -> Plan:
        if self.placed is None:
            raise UsageError("the model is placed on its first call; call it once before reading .plan")
        return self.placed.plan

    def __getattr__(self, name: str) -> Any:
        """The placed model's own methods and attributes (``device_map()``, ``step()``,
        ``report()``, ...) once it is placed; before, a :class:`UsageError` saying to call it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            placed = self.__dict__.get("placed")
            if name.startswith("_") or not hasattr(PlacedModule if placed is None else placed, name):
                raise
        if placed is None:
            raise UsageError(f"the model is placed on its first call; call it once before using .{name}")
        return getattr(placed, name)


def placed(devices: Any, **options: Any):
    """Class decorator: instances are placed on ``devices`` at their first call.

    Example:
        >>> @torchplace.placed(devices=["cpu:0", "cpu:1"], microbatches=2)   # doctest: +SKIP
        ... class Net(nn.Module): ...
        >>> net = Net(); y = net(x); print(net.plan)                          # doctest: +SKIP

    ``Net(...)`` returns a wrapper module holding the real instance as ``.module``; the
    undecorated class is ``Net.__wrapped__``. Options are those of :func:`place`, checked by name
    here (the first call's inputs are the examples).

    Raises:
        UsageError: an option :func:`place` does not take, or one the first call gives.
    """
    names = set(inspect.signature(place).parameters) - {"model", "devices", "example_inputs", "example_kwargs"}
    unknown = sorted(set(options) - names)
    if unknown:
        if unknown[0] in ("example_inputs", "example_kwargs", "model", "devices"):
            why = "the decorated instance is the model and its first call's inputs are the examples"
        else:
            close = difflib.get_close_matches(unknown[0], sorted(names), n=1)
            why = f"did you mean {close[0]!r}?" if close else "see torchplace.place for its options"
        raise UsageError(f"@placed: option {unknown[0]!r} is not one @placed passes to place(): {why}")

    def decorate(cls: type[nn.Module]):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@placed decorates nn.Module classes, got {cls!r}")

        @functools.wraps(cls, updated=())
        def construct(*args: Any, **kwargs: Any) -> _LazyPlaced:
            return _LazyPlaced(cls(*args, **kwargs), devices, options)

        return construct

    return decorate
