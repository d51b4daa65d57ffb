"""``parallelism=``: the search space a training plan is solved in.

- ``"pipeline"`` (the default): a pipeline of stages, one device each, forward and backward of a
  node together (Tarnawski et al. 2020, Sec. 5.3); :func:`torchplace.place` runs it here.
- ``"piper"``: Piper's data x tensor x pipeline parallelism with activation recomputation
  (Tarnawski, Narayanan, Phanishayee 2021): the profiled training graph becomes a layer graph with
  TMPCs (:mod:`torchplace.profiling.tmpc`, Megatron's split of attention and MLP blocks) and
  :func:`torchplace.solvers.piper.solve` gives each stage its data-parallel degree ``d``,
  tensor-parallel degree ``t`` and a TMPC (recomputation or not) per layer.

    plan, problem = torchplace.plan_model(model, [f"cuda:{i}" for i in range(8)],
                                          example_kwargs={"input_ids": ids, "labels": ids},
                                          mode="training", parallelism="piper", microbatches=16)

For Piper the example call is **one micro-batch** (Piper's unit: times per sample are per
micro-batch) and ``microbatches`` is ``N``, the most micro-batches of a batch (it bounds the sum of
the stages' ``d``); the devices must be alike (one kind), their memory the least of theirs.
"""
from __future__ import annotations

import math
from typing import Any

from torchplace import solvers
from torchplace.checks import brief
from torchplace.devices import Cluster, parse_bandwidth
from torchplace.errors import UnsupportedError, UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem

__all__ = ["PARALLELISMS", "check", "piper_plan", "refuse_to_run"]

PARALLELISMS = ("pipeline", "piper")
"""The accepted values of ``parallelism=``."""

UNLIMITED = float(2**60)
"""Piper's memory per device when the devices give none (a finite stand-in for no limit)."""


def check(parallelism: Any, *, mode: str, objective: str, solver: str, contiguous: bool, plan: Any,
          allreduce_bandwidth: Any, tensor_bandwidth: Any, schedule: str = "1f1b", fuse: bool | None = None,
          allow_single_device: bool | None = None) -> None:
    """Raise :class:`UsageError` for a ``parallelism`` and options that do not go together (an option
    the chosen path would ignore is refused, not dropped)."""
    if not isinstance(parallelism, str) or parallelism not in PARALLELISMS:
        raise UsageError(f"parallelism must be one of {list(PARALLELISMS)}: 'pipeline' (stages on one device each, "
                         f"runs here) or 'piper' (data x tensor x pipeline, mode='training'), got {brief(parallelism)}")
    if parallelism == "pipeline":
        if solver in solvers.PARALLEL_METHODS:
            raise UsageError(f"solver {solver!r} plans data and tensor parallelism: use parallelism='piper' with it")
        for name, value in (("allreduce_bandwidth", allreduce_bandwidth), ("tensor_bandwidth", tensor_bandwidth)):
            if value is not None:
                raise UsageError(f"{name} prices Piper's all-reduces: it goes with parallelism='piper'")
        return
    if mode != "training":
        raise UsageError("parallelism='piper' plans training (data-parallel gradients, recomputation): "
                         "pass mode='training'")
    if solver not in ("auto", *solvers.PARALLEL_METHODS):
        raise UsageError(f"parallelism='piper' is solved by {['auto', *solvers.PARALLEL_METHODS]}, got solver {solver!r}")
    if not contiguous:
        raise UsageError("Piper's stages are contiguous (Sec. 3.2): leave contiguous=True with parallelism='piper'")
    if schedule != "1f1b":
        raise UsageError(f"schedule={schedule!r}: Piper prices a pipeline that does not flush (PipeDream-2BW, Sec. 2 and "
                         "App. A: ceil(s/d) micro-batches in flight per device), not GPipe's: leave schedule out with "
                         "parallelism='piper'")
    if fuse:
        raise UsageError("fuse=True coarsens the operator graph for the pipeline solvers; Piper plans over the "
                         "model's layers (Sec. 3: a TMPC per layer), which it builds itself: leave fuse out with "
                         "parallelism='piper'")
    if allow_single_device:
        raise UsageError("allow_single_device=True lets place() run a pipeline plan on one device; a Piper plan "
                         "already weighs one stage over every device (data parallel, Sec. 3.2) against deeper "
                         "pipelines: leave allow_single_device out with parallelism='piper'")
    if plan is not None:
        raise UsageError("plan= runs a given pipeline plan, and parallelism='piper' solves for a Piper plan, which "
                         "no runtime here runs yet: leave out plan= (or parallelism='piper')")
    for name, value in (("allreduce_bandwidth", allreduce_bandwidth), ("tensor_bandwidth", tensor_bandwidth)):
        if value is not None:
            parse_bandwidth(value)
    if allreduce_bandwidth is not None and parse_bandwidth(allreduce_bandwidth) == math.inf:
        raise UsageError("allreduce_bandwidth is Piper's B, which prices its stage transfers and all-reduces: give a "
                         "finite bandwidth, e.g. '25GB/s'")
    del objective  # training is already refused for latency


def _alike(cluster: Cluster) -> str:
    kinds = sorted({d.kind for d in cluster.devices})
    if len(kinds) != 1:
        raise UsageError(f"Piper plans for identical devices, but the devices are of kinds {kinds}: "
                         "give devices of one kind")
    return kinds[0]


def _bandwidth(cluster: Cluster, given: Any) -> float:
    """Piper's ``B``: the given one, else the link between the first two devices, else the cluster's."""
    if given is not None:
        return float(parse_bandwidth(given))
    names = cluster.names
    bw = cluster.link(names[0], names[1]).bandwidth if len(names) >= 2 else None
    where = f"the link from {names[0]} to {names[1]}" if bw is not None else "the cluster's default link"
    bw = float(cluster.bandwidth if bw is None else bw)
    if not math.isfinite(bw):
        raise UsageError(f"Piper's bandwidth B is taken from {where}, which has no finite bandwidth ({bw}): "
                         "give allreduce_bandwidth=, e.g. '25GB/s'")
    return bw


def piper_plan(graph: Any, cluster: Cluster, model: Any, *, microbatches: int, solver: str, recompute: bool,
               time_limit: float | None, allreduce_bandwidth: Any = None, tensor_bandwidth: Any = None,
               traced: Any = None) -> tuple[Problem, Plan]:
    """The Piper problem of a profiled training ``graph`` on ``cluster`` and its plan (``traced``:
    the traced model the graph was profiled from, for exact tensor bytes between layers).

    Raises:
        UsageError: devices of more than one kind.
        InfeasibleError: no configuration fits (from the solver).
    """
    from torchplace.profiling.tmpc import fx_outputs, heads_by_module, parameter_shapes, piper_problem

    kind = _alike(cluster)
    memory = [d.memory_bytes for d in cluster.devices if d.memory_bytes is not None]
    bandwidth = _bandwidth(cluster, allreduce_bandwidth)
    problem = piper_problem(
        graph, kind=kind, devices=len(cluster.devices), memory_bytes=float(min(memory)) if memory else UNLIMITED,
        bandwidth=bandwidth, microbatches=microbatches, shapes=parameter_shapes(model), heads=heads_by_module(model),
        tensor_bandwidth=None if tensor_bandwidth is None else float(parse_bandwidth(tensor_bandwidth)),
        fx=None if traced is None else fx_outputs(traced.gm))
    method = "piper" if solver == "auto" else solver
    plan = solvers.solve(problem, method=method, time_limit=time_limit, recompute=recompute)
    plan.meta["piper_devices"] = [d.name for d in cluster.devices]
    return problem, plan


def refuse_to_run(plan: Plan, problem: Problem) -> UnsupportedError:
    """The error :func:`torchplace.place` raises for a Piper plan, which it cannot run in one process."""
    wide = [(i, s.data_parallel, s.tensor_parallel) for i, s in enumerate(plan.stages)
            if s.data_parallel > 1 or s.tensor_parallel > 1]
    what = (f"stage {wide[0][0]} has d={wide[0][1]}, t={wide[0][2]}" if wide
            else "its stages are layer groups of the Piper graph, not the runtime's stages")
    err = UnsupportedError(
        f"place() runs a model in this process, which cannot run this Piper plan ({what}). Plan it with "
        "torchplace.plan_model(..., parallelism='piper') (the plan is also on this error as .plan); "
        "data- and tensor-parallel stages run over many processes with torchplace.distributed.place, which "
        "takes operator-level plans with one d and t for every stage (a Piper plan of layers is not converted "
        "to one yet); parallelism='pipeline' gives a pipeline place() runs here")
    err.plan, err.problem = plan, problem  # type: ignore[attr-defined]
    return err
