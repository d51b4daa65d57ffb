"""``place()``: trace -> profile -> solve -> split -> wrap, in one call.

    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_inputs=(x,))
    y = placed(x)          # same outputs as model(x), pipelined over the devices
    print(placed.plan)     # which stage went where, predicted time per sample, lower bound, gap
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
import inspect
from typing import Any, NamedTuple

import torch
from torch import nn

from torchplace import solvers
from torchplace.arguments import check_model, example_call, leaf_types, try_example_call
from torchplace.checks import brief, non_negative_int, positive_float, positive_int
from torchplace.devices import Cluster, Device, check_attached, kind_threads, make_cluster
from torchplace.errors import InvalidPlanError, UnsupportedError, UsageError
from torchplace.machine import intra_op_threads
from torchplace.placed_module import PlacedModule
from torchplace.plan import Plan, Stage
from torchplace.problem import Pipeline, Problem
from torchplace.profiling import present_kinds, profile, trace
from torchplace.profiling.training import measure_backward, optimizer_state_factor, training_graph

__all__ = ["Placement", "PlacedModule", "place", "placed", "prepare"]


def place(model: nn.Module, devices: Sequence[str | Device] | Cluster, example_inputs: Any = (),
          **options: Any) -> PlacedModule:
    """Place ``model`` on ``devices`` and return a :class:`PlacedModule` that runs it there.

    The arguments, what is done with them and what is raised are those of :func:`prepare`, which
    decides the placement; ``place`` then splits the traced graph and runs it on worker threads
    (:func:`torchplace.distributed.place` hands the same placement to torch.distributed instead).
    """
    placement = prepare(model, devices, example_inputs, **options)
    return PlacedModule(placement.traced, placement.problem, placement.plan, placement.microbatches,
                        example=placement.example)


class Placement(NamedTuple):
    """What :func:`prepare` decided: the traced model, the measured problem and the plan to run.

    ``example`` is the example call ``(args, kwargs)`` for a training placement (its eval-mode graph
    is traced from it), else ``None``."""

    traced: Any
    problem: Problem
    plan: Plan
    microbatches: int
    example: tuple[tuple[Any, ...], dict[str, Any]] | None


def prepare(
    model: nn.Module,
    devices: Sequence[str | Device] | Cluster,
    example_inputs: Any = (),
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    objective: str = "throughput",
    mode: str = "inference",
    optimizer: str | float = "adamw",
    schedule: str = "1f1b",
    recompute: bool = True,
    contiguous: bool = True,
    time_limit: float | None = None,
    microbatches: int = 4,
    granularity: str = "operator",
    leaf_modules: Iterable[type | str] = (),
    max_memory: Mapping[str, int | str] | None = None,
    share_cores: bool = False,
    solver: str = "auto",
    fuse: bool | None = None,
    trace_method: str = "auto",
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    plan: Plan | str | Path | None = None,
) -> PlacedModule:
    """Decide where ``model`` runs on ``devices``: trace, profile and solve (what :func:`place` runs).

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
    timing leave the model's buffers and the example inputs as they were.

    Args:
        model: the model to place.
        devices: device strings (``"cuda:0"``, ``"cpu"``, logical CPUs ``"cpu:0"``, ``"cpu:1"``),
            :class:`Device` objects, or a ready :class:`Cluster`.
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
            ``"momentum"``, ``"adam"``, ``"adamw"``, or state bytes per parameter byte).
        schedule: training: ``"1f1b"`` (PipeDream-flush) or ``"gpipe"`` (fill-drain).
        recompute: training: whether the solver may let a device recompute its activations in
            the backward pass where memory demands it.
        contiguous: whether each device must hold one contiguous piece (throughput only; with
            ``False`` a device may hold several pieces, Tarnawski Sec. 5.2).
        time_limit: seconds the solver may take (MILPs stop there with their best plan and bound).
        microbatches: micro-batches each call's batch is split into (throughput only).
        granularity: ``"operator"`` or ``"module"`` (one node per leaf module).
        leaf_modules: module classes, or their names (``["GPT2Block"]``), to keep whole (like
            accelerate's ``no_split_module_classes``).
        max_memory: per-device memory caps, bytes or strings like ``"20GiB"``.
        share_cores: split this machine's cores among the CPU devices: each CPU worker computes,
            and the CPU is profiled, with its share of intra-op threads, so logical CPUs stop
            competing for every core. CPU kernels round by thread count: outputs then equal the
            model run with that many threads (``torch.set_num_threads``), not bit for bit the
            model run with all of them. ``Device(..., threads=)`` sets one device's count.
        solver: a name from :data:`torchplace.solvers.METHODS`, or ``"auto"``.
        fuse: solve on a coarsened graph (MOIRAI fusion rules + Baechi co-placement,
            :func:`torchplace.fusion.coarsen`) and expand the plan back to every operator. Fusion
            makes big graphs tractable but can cost objective, since groups cannot be split; the
            default (``None``) fuses only graphs of more than :data:`FUSE_ABOVE` nodes for
            throughput, or more than the MILP's size limit for latency.
        trace_method: ``"auto"``, ``"fx"`` or ``"export"``.
        warmup, repeats: profiling runs (median of ``repeats`` after ``warmup``).
        progress: show a progress bar while profiling.
        plan: run this plan (a :class:`Plan` or a plan file from :meth:`Plan.save`) instead of
            solving: it is checked against the traced model and evaluated on the new timings.

    Returns:
        A :class:`Placement` (traced model, problem, plan); :func:`place` wraps it in a
        :class:`PlacedModule` with ``.plan``, and ``placed(*example_inputs)`` equals
        ``model(*example_inputs)``.

    Raises:
        UsageError: a bad argument (named, with the fix), or example inputs the model fails on;
            raised before anything is traced or timed.
        TraceError: the model cannot be traced (the message says what to try).
        InfeasibleError: the model does not fit; ``min_memory_bytes`` is the smallest per-device
            memory that would.
        InvalidPlanError: ``plan`` does not place this model's graph.
    """
    model = check_model(model)
    if mode not in ("inference", "training"):
        raise UsageError(f"mode must be 'inference' or 'training', got {mode!r}")
    if mode == "training" and objective != "throughput":
        raise UsageError("training is placed for throughput (a pipeline of micro-batches); use objective='throughput'")
    if mode == "training" and schedule not in ("gpipe", "1f1b"):
        raise UsageError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    if objective not in ("throughput", "latency"):
        raise UsageError(
            f"objective must be 'throughput' (pipelined time per sample) or 'latency' (time of one sample), "
            f"got {objective!r}"
        )
    solvers.check_method(solver, objective)
    for name, flag in (("contiguous", contiguous), ("progress", progress), ("recompute", recompute),
                       ("share_cores", share_cores)):
        if not isinstance(flag, bool):
            raise UsageError(f"{name} must be True or False, got {brief(flag)}")
    if fuse is not None and not isinstance(fuse, bool):
        raise UsageError(f"fuse must be True, False or None (fuse only big graphs), got {brief(fuse)}")
    microbatches = positive_int(microbatches, "microbatches")
    time_limit = None if time_limit is None else positive_float(time_limit, "time_limit", unit="of seconds")
    warmup, repeats = non_negative_int(warmup, "warmup"), positive_int(repeats, "repeats")
    args, kwargs = example_call(example_inputs, example_kwargs)
    leaves = leaf_types(model, leaf_modules)
    if isinstance(devices, Cluster):
        check_attached(devices)
        cluster = devices
    else:
        cluster = make_cluster(devices, max_memory, share_cores=share_cores)
    given = _load_plan(plan) if plan is not None else None
    training = mode == "training"
    if training:
        optimizer_state_factor(optimizer)
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        try_example_call(model, args, kwargs)
    except BaseException:
        for m, was in modes.items():  # a refused call leaves the model as it was
            m.training = was
        raise
    with torch.no_grad():
        traced = trace(model, args, kwargs, granularity=granularity, leaf_modules=leaves, method=trace_method,
                       training=training)
    kinds = sorted({d.kind for d in cluster.devices})
    threads = kind_threads(cluster)
    graph = profile(traced, args, kwargs, kinds=kinds, warmup=warmup, repeats=repeats, progress=progress, grad=training,
                    threads=threads)
    pipeline = None
    if training:
        graph = _training_graph(traced, graph, args, kwargs, kinds, optimizer, warmup, repeats, progress, threads)
        pipeline = Pipeline(microbatches, schedule, recompute)  # type: ignore[arg-type]
    problem = Problem(graph, cluster, objective=objective, mode=mode,  # type: ignore[arg-type]
                      contiguous=contiguous and objective == "throughput", pipeline=pipeline)
    if given is not None:
        solved = _replan(problem, given)
    elif len(graph) == 0:
        solved = Plan.build(problem, [Stage(cluster.devices[0].name, ())], solver="none", seconds=0.0, lower_bound=0.0)
    else:
        solved = _solve(problem, solver, time_limit, fuse)
    return Placement(traced, problem, solved, microbatches, (args, kwargs) if training else None)


place.__signature__ = inspect.signature(prepare).replace(return_annotation=PlacedModule)  # type: ignore[attr-defined]


def _training_graph(traced: Any, graph: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], kinds: Sequence[str],
                    optimizer: str | float, warmup: int, repeats: int, progress: bool,
                    threads: Mapping[str, int]) -> Any:
    """The training graph: every node's backward timed on each kind present (twice the forward
    estimate elsewhere) with that kind's threads, with gradients and optimizer state
    (:mod:`torchplace.profiling.training`)."""
    present = present_kinds()
    measured = {}
    for kind in kinds:
        if kind in present:
            with intra_op_threads(threads.get(kind)):
                measured[kind] = measure_backward(traced, args, kwargs, kind=kind, warmup=min(warmup, 1),
                                                  repeats=repeats, progress=progress)
    return training_graph(graph, measured, optimizer, estimated=[k for k in kinds if k not in present])


def _load_plan(plan: Plan | str | Path) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise UsageError(f"plan must be a Plan or the path of a plan file, got {brief(plan)}")


def _replan(problem: Problem, plan: Plan) -> Plan:
    """``plan``'s stages, evaluated and validated on this problem (the model's new timings)."""
    placed = {v for s in plan.stages for v in s.nodes}
    missing, extra = set(problem.graph) - placed, placed - set(problem.graph)
    if missing or extra:
        raise InvalidPlanError(
            f"the plan does not fit this model's graph ({len(missing)} node(s) unplaced, e.g. {sorted(missing)[:3]}; "
            f"{len(extra)} unknown, e.g. {sorted(extra)[:3]}): trace the same model with the same granularity, "
            "leaf_modules and trace_method as when the plan was made"
        )
    from torchplace.solvers.bounds import combinatorial_lower_bound

    return Plan.build(problem, plan.stages, solver=f"{plan.solver} (given)", seconds=0.0,
                      lower_bound=combinatorial_lower_bound(problem), status="feasible")


FUSE_ABOVE = 1000
"""Throughput graphs with more nodes than this are coarsened before solving when ``fuse=None``."""


def _solve(problem: Problem, solver: str, time_limit: float | None, fuse: bool | None) -> Plan:
    """Solve ``problem``, on its coarsened graph when ``fuse`` says so (see :func:`place`)."""
    from torchplace.fusion import coarsen
    from torchplace.solvers.auto import MILP_NODES
    from torchplace.solvers.bounds import combinatorial_lower_bound

    if fuse is None:
        fuse = len(problem.graph) > (MILP_NODES if problem.objective == "latency" else FUSE_ABOVE)
    if not fuse:
        return solvers.solve(problem, method=solver, time_limit=time_limit)
    coarse = coarsen(problem.graph, devices=len(problem.cluster))
    plan = solvers.solve(coarse.coarse_problem(problem), method=solver, time_limit=time_limit)
    return coarse.expand_plan(plan, problem, lower_bound=combinatorial_lower_bound(problem))


class _LazyPlaced(nn.Module):
    """Holds a model and places it on its first call, using that call's inputs as examples."""

    def __init__(self, module: nn.Module, devices: Any, options: Mapping[str, Any]) -> None:
        super().__init__()
        self.module = module
        self._devices, self._options = devices, dict(options)
        self.__dict__["placed"] = None  # not a registered child: it shares the module's tensors

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.placed is None:
            self.__dict__["placed"] = place(self.module, self._devices, args, example_kwargs=kwargs, **self._options)
        return self.placed(*args, **kwargs)

    def train(self, mode: bool = True) -> _LazyPlaced:
        if mode and self._options.get("mode", "inference") != "training":
            raise UnsupportedError("this model is placed for inference on its first call, with its graph traced in "
                                   "eval mode: train() would change nothing; decorate with mode='training' to train it")
        return super().train(mode)

    @property
    def plan(self) -> Plan:
        if self.placed is None:
            raise RuntimeError("the model is placed on its first call; call it once before reading .plan")
        return self.placed.plan


def placed(devices: Any, **options: Any):
    """Class decorator: instances are placed on ``devices`` at their first call.

    Example:
        >>> @torchplace.placed(devices=["cpu:0", "cpu:1"], microbatches=2)   # doctest: +SKIP
        ... class Net(nn.Module): ...
        >>> net = Net(); y = net(x); print(net.plan)                          # doctest: +SKIP

    ``Net(...)`` returns a wrapper module holding the real instance as ``.module``; the
    undecorated class is ``Net.__wrapped__``. Options are those of :func:`place`.
    """

    def decorate(cls: type[nn.Module]):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@placed decorates nn.Module classes, got {cls!r}")

        @functools.wraps(cls, updated=())
        def construct(*args: Any, **kwargs: Any) -> _LazyPlaced:
            return _LazyPlaced(cls(*args, **kwargs), devices, options)

        return construct

    return decorate
