"""``place()``: trace -> profile -> solve -> split -> wrap, in one call.

    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_inputs=(x,))
    y = placed(x)          # same outputs as model(x), pipelined over the devices
    print(placed.plan)     # which stage went where, predicted time per sample, lower bound, gap
"""
from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from torchplace import solvers
from torchplace.devices import Cluster, Device, make_cluster
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.profiling import Traced, profile, trace
from torchplace.runtime import GraphIO, LatencyExecutor, PipelineExecutor, split_stages

__all__ = ["PlacedModule", "place", "placed"]


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
        stages: the stage modules, in plan order (their parameters live on their devices).
    """

    def __init__(self, traced: Traced, problem: Problem, plan: Plan, microbatches: int = 1) -> None:
        super().__init__()
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.plan, self.problem, self.microbatches = plan, problem, microbatches
        stage_of = {
            fx_name: i
            for i, stage in enumerate(plan.stages)
            for v in stage.nodes
            for fx_name in problem.graph.record(v).fx_nodes
        }
        stages = split_stages(traced.gm, stage_of, len(plan.stages), traced.effects)
        self.stages = nn.ModuleList(stages)
        devices = [problem.cluster.device(s.device) for s in plan.stages]
        torch_devices, workers = [d.torch_device for d in devices], [d.name for d in devices]
        self._executor: PipelineExecutor | LatencyExecutor
        isolate = os.environ.get("TORCHPLACE_ISOLATE_DEVICES", "") not in ("", "0")
        if problem.objective == "latency":
            self.microbatches = 1
            self._executor = LatencyExecutor(stages, torch_devices, workers, GraphIO(traced.gm), isolate=isolate)
        else:
            self._executor = PipelineExecutor(stages, torch_devices, workers, GraphIO(traced.gm), isolate=isolate)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self._executor, LatencyExecutor):
            return self._executor.run(args, kwargs)
        return self._executor.run(args, kwargs, self.microbatches)

    def device_map(self) -> dict[str, str]:
        """Where each module's weights live, in accelerate's ``device_map`` form."""
        return self.plan.device_map(self.problem)

    def extra_repr(self) -> str:
        devices = " -> ".join(s.device for s in self.plan.stages)
        if self.problem.objective == "latency":
            return f"stages: {devices}; latency mode; objective={self.plan.objective:.4g} s"
        return f"stages: {devices}; microbatches={self.microbatches}; objective={self.plan.objective:.4g} s/sample"


def place(
    model: nn.Module,
    devices: Sequence[str | Device] | Cluster,
    example_inputs: Sequence[Any],
    *,
    objective: str = "throughput",
    contiguous: bool = True,
    time_limit: float | None = None,
    microbatches: int = 4,
    granularity: str = "operator",
    leaf_modules: Iterable[type] = (),
    max_memory: Mapping[str, int | str] | None = None,
    solver: str = "auto",
    fuse: bool | None = None,
    trace_method: str = "auto",
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
) -> PlacedModule:
    """Place ``model`` on ``devices`` and return a module that runs it there.

    The model is put in eval mode (placement is for inference), traced with torch.fx (or
    torch.export for models fx cannot trace), every operator is timed on each device kind present
    (and estimated for kinds that are not), a placement is solved for, and the traced graph is
    split into stages. The default solver, ``"auto"`` (:mod:`torchplace.solvers.auto`), runs for
    throughput the optimal contiguous DP when the graph has few enough ideals (Tarnawski et al.
    2020, Sec. 5.1.1), else SliceGraph and BRKGA; for latency the best of Baechi's m-SCT and m-ETF
    and the MOIRAI MILP (graphs of at most 60 nodes, started from the better scheduler's plan).

    Args:
        model: the model to place.
        devices: device strings (``"cuda:0"``, ``"cpu"``, logical CPUs ``"cpu:0"``, ``"cpu:1"``),
            :class:`Device` objects, or a ready :class:`Cluster`.
        example_inputs: positional inputs of one representative call (batch on dim 0).
        objective: ``"throughput"`` (min time per sample of a pipeline of micro-batches) or
            ``"latency"`` (min time of one sample; devices run independent branches at once).
        contiguous: whether each device must hold one contiguous piece (throughput only; with
            ``False`` a device may hold several pieces, Tarnawski Sec. 5.2).
        time_limit: seconds the solver may take (MILPs stop there with their best plan and bound).
        microbatches: micro-batches each call's batch is split into (throughput only).
        granularity: ``"operator"`` or ``"module"`` (one node per leaf module).
        leaf_modules: module classes to keep whole (like accelerate's ``no_split_module_classes``).
        max_memory: per-device memory caps, bytes or strings like ``"20GiB"``.
        solver: a name from :data:`torchplace.solvers.METHODS`, or ``"auto"``.
        fuse: solve on a coarsened graph (MOIRAI fusion rules + Baechi co-placement,
            :func:`torchplace.fusion.coarsen`) and expand the plan back to every operator. Fusion
            makes big graphs tractable but can cost objective, since groups cannot be split; the
            default (``None``) fuses only graphs of more than :data:`FUSE_ABOVE` nodes for
            throughput, or more than the MILP's size limit for latency.
        trace_method: ``"auto"``, ``"fx"`` or ``"export"``.
        warmup, repeats: profiling runs (median of ``repeats`` after ``warmup``).
        progress: show a progress bar while profiling.

    Returns:
        A :class:`PlacedModule` with ``.plan``; ``placed(*example_inputs)`` equals
        ``model(*example_inputs)``.

    Raises:
        ValueError: unknown device or objective.
        TraceError: the model cannot be traced (the message says what to try).
        InfeasibleError: the model does not fit; ``min_memory_bytes`` is the smallest per-device
            memory that would.
    """
    if objective not in ("throughput", "latency"):
        raise ValueError(
            f"objective must be 'throughput' (pipelined time per sample) or 'latency' (time of one sample), "
            f"got {objective!r}"
        )
    cluster = devices if isinstance(devices, Cluster) else make_cluster(devices, max_memory)
    example_inputs = tuple(example_inputs)
    model.eval()
    with torch.no_grad():
        traced = trace(model, example_inputs, granularity=granularity, leaf_modules=leaf_modules, method=trace_method)
        kinds = sorted({d.kind for d in cluster.devices})
        graph = profile(traced, example_inputs, kinds=kinds, warmup=warmup, repeats=repeats, progress=progress)
    problem = Problem(graph, cluster, objective=objective, mode="inference",  # type: ignore[arg-type]
                      contiguous=contiguous and objective == "throughput")
    plan = _solve(problem, solver, time_limit, fuse)
    return PlacedModule(traced, problem, plan, microbatches)


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
        self.placed: PlacedModule | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.placed is None:
            if kwargs:
                raise TypeError(
                    f"the first call of a @placed model is traced with positional inputs only; got keyword "
                    f"arguments {sorted(kwargs)}: call it positionally, or use torchplace.place() with example_inputs"
                )
            self.placed = place(self.module, self._devices, args, **self._options)
        return self.placed(*args, **kwargs)

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
