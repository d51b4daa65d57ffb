"""What would make a problem with no feasible contiguous split fit (issue 10, item 7).

When the ideals DP (:mod:`torchplace.solvers.dp`) finds no split, it asks the same DP, over the
same pieces, what would change that: each answer is an optimum, not a guess.

- **max_memory**: the smallest per-device memory that fits is itself a min-max split, with each
  piece's bytes as its cost (the fewest it can take: recomputing where that is smaller and
  allowed), on every memory-limited device at once.
- **recomputation** (if the pipeline does not allow it), **1F1B** (instead of GPipe): the DP with
  that pipeline.
- **more micro-batches**, under 1F1B: a device at position ``j`` of ``S`` holds
  ``min(m, S - j)`` micro-batches of ``1/m`` of the batch's activations each, so for ``m >= S``
  its memory can only shrink as ``m`` grows (under GPipe it holds all ``m``: the activations do
  not shrink). The smallest ``m`` that fits, up to :data:`MAX_MICROBATCHES`: each ``m`` below the
  device count is tried, and above it a binary search, exact when only forward nodes keep
  activations.
- **another device**: the DP with one more device of a class.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from torchplace.errors import InfeasibleError, SolverLimitError
from torchplace.problem import Pipeline, Problem
from torchplace.solvers.paircosts import DeviceClass, training_pipeline

__all__ = ["MAX_MICROBATCHES", "explain"]

MAX_MICROBATCHES = 1024
"""The most micro-batches the search for a remedy tries (a micro-batch holds at least one sample)."""

Value = Callable[[Pipeline | None, Sequence[int], str], float]
"""``value(pipeline, device counts per class, "load" | "memory")``: the DP's optimum (``inf``: no split)."""


def explain(problem: Problem, classes: Sequence[DeviceClass], counts: Sequence[int], value: Value) -> InfeasibleError:
    """The error for a problem whose DP found no split: by how much it misses and what would fit.

    ``value`` re-runs the DP (it may raise SolverLimitError when the time limit passes: the
    remedies found by then are named).
    """
    pipeline = training_pipeline(problem)
    try:
        need = value(pipeline, counts, "memory")
    except SolverLimitError:
        return InfeasibleError("no contiguous split fits the devices' memory (the time limit stopped the search for "
                               "what would fit); raise max_memory, add devices, or raise the time limit")
    if math.isinf(need):
        return _no_split(problem, classes, counts, pipeline, value)
    fixes = [f"raise max_memory to at least {int(need)} bytes per device"]
    try:
        fixes += _pipeline_fixes(pipeline, counts, value)
        fixes += _device_fixes(classes, counts, pipeline, value)
    except SolverLimitError:
        fixes.append("(the time limit stopped the search for other remedies)")
    return InfeasibleError(_message(problem, classes, int(need), fixes), min_memory_bytes=int(need))


def kind_fix(problem: Problem, nodes: Sequence[str]) -> str:
    """What to do about ``nodes`` (one colocation group) that no device kind of the cluster can run:
    add a device of a kind all of them have a time for, or give them a time on a kind present.

    Example: with only a CPU, for a node timed on ``"cuda"`` only: "add a device of kind 'cuda'
    (they have times for ['cuda']), or give them a time on 'cpu'"."""
    present = sorted({d.kind for d in problem.cluster.devices})
    timed = [set(problem.graph.record(v).times) for v in nodes]
    common = sorted(set.intersection(*timed)) if timed else []
    on = f"give them a time on {present[0]!r}" if len(present) == 1 else f"give them times on one of {present}"
    if common:
        return f"add a device of kind {common[0]!r} (they have times for {common}), or {on}"
    if any(timed):
        return f"no one kind has a time for all of them (colocated operators share a device): {on}"
    return f"they have no time on any kind: {on}"


def _no_split(problem: Problem, classes: Sequence[DeviceClass], counts: Sequence[int], pipeline: Pipeline | None,
              value: Value) -> InfeasibleError:
    """The error when no contiguous split exists whatever the memory: operators (colocation groups)
    that no device kind present can run, or else no way to give each device one piece, in an order
    in which data flows forward (Tarnawski Fact 5.2), with every operator on a kind that runs it and
    colocated operators together: the operators some kinds cannot run, or a colocation group, are
    interleaved with the rest."""
    kinds = {c.kind for c in classes}
    groups: dict[str, list[str]] = {}
    for v, r in problem.graph.records():
        groups.setdefault(f"c:{r.colocation}" if r.colocation is not None else f"n:{v}", []).append(v)
    stuck = [vs for vs in groups.values()
             if not any(all(k in problem.graph.record(v).times for v in vs) for k in kinds)]
    if stuck:
        return InfeasibleError(
            f"some operators cannot run on any of the given devices (no measured time for their kind, e.g. "
            f"{stuck[0][:5]}, for the kinds {sorted(kinds)}); {kind_fix(problem, stuck[0])}")
    try:
        fixes = _device_fixes(classes, counts, pipeline, value)
    except SolverLimitError:
        fixes = []
    return InfeasibleError(
        "no contiguous split exists, whatever the memory: with one piece per device, in an order in which data "
        "flows forward (Tarnawski Fact 5.2), the operators cannot all be on devices that can run them with "
        "colocated ones together (the operators some device kinds cannot run, or a colocation group, are "
        "interleaved with the others); allow several pieces per device (contiguous=False, --noncontiguous)"
        + "".join(f", or {fix}" for fix in fixes))


def _message(problem: Problem, classes: Sequence[DeviceClass], need: int, fixes: Sequence[str]) -> str:
    caps = sorted({c.memory for c in classes if c.memory is not None})
    what = "for training" if training_pipeline(problem) is not None else ""
    short = f", {need - caps[-1]} bytes more than the largest limit" if caps and need > caps[-1] else ""
    return (f"the model does not fit{' ' + what if what else ''}: the best contiguous split needs {need} bytes "
            f"({need / 2**30:.3f} GiB) on its fullest device, but the memory-limited devices have {caps} "
            f"bytes{short}; any one of these fits: " + "; ".join(fixes))


def _fits(value: Value, pipeline: Pipeline | None, counts: Sequence[int]) -> bool:
    return math.isfinite(value(pipeline, counts, "load"))


def _pipeline_fixes(pipeline: Pipeline | None, counts: Sequence[int], value: Value) -> list[str]:
    """Recomputation, 1F1B and more micro-batches, each that fits."""
    if pipeline is None:
        return []
    fixes = []
    if not pipeline.recompute and _fits(value, dataclasses.replace(pipeline, recompute=True), counts):
        fixes.append("allow activation recomputation (recompute=True)")
    one_f_one_b = dataclasses.replace(pipeline, schedule="1f1b")
    switch = " with schedule='1f1b'" if pipeline.schedule == "gpipe" else ""
    if switch and _fits(value, one_f_one_b, counts):
        fixes.append("schedule='1f1b' (each device holds at most as many micro-batches as pipeline stages from it "
                     "to the end)")
        return fixes  # (more micro-batches under 1F1B fit too: nothing more to say)
    m = fewest_microbatches(one_f_one_b, counts, lambda p: _fits(value, p, counts))
    if m is not None:
        fixes.append(f"microbatches={m}{switch} (or more: a micro-batch needs at least one sample)")
    return fixes


def fewest_microbatches(pipeline: Pipeline, counts: Sequence[int], fits: Callable[[Pipeline], bool]) -> int | None:
    """The fewest micro-batches above ``pipeline``'s that fit under its schedule (module docstring);
    None if none up to :data:`MAX_MICROBATCHES` does."""
    m0, devices = pipeline.microbatches, sum(counts)
    if m0 >= MAX_MICROBATCHES:
        return None
    with_m = lambda m: dataclasses.replace(pipeline, microbatches=m)  # noqa: E731
    for m in range(m0 + 1, min(devices, MAX_MICROBATCHES + 1)):  # below the device count: no order in m
        if fits(with_m(m)):
            return m
    lo = max(m0 + 1, devices)
    if lo > MAX_MICROBATCHES or not fits(with_m(MAX_MICROBATCHES)):
        return None
    hi = MAX_MICROBATCHES  # fits(hi); find the least m in [lo, hi] that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(with_m(mid)) else (mid + 1, hi)
    return hi


def _device_fixes(classes: Sequence[DeviceClass], counts: Sequence[int], pipeline: Pipeline | None,
                  value: Value) -> list[str]:
    """One more device of a class, for each class where that fits."""
    fixes = []
    for c, cls in enumerate(classes):
        more = [n + (i == c) for i, n in enumerate(counts)]
        if _fits(value, pipeline, more):
            limit = f"{cls.memory} bytes" if cls.memory is not None else "no memory limit"
            fixes.append(f"add one more device like {cls.devices[0]!r} ({cls.kind}, {limit})")
    return fixes
