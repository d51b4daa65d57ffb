"""Measure the time of every OpGraph node on each device kind of this machine.

The traced GraphModule runs node by node in an :class:`torch.fx.Interpreter` that times compute
nodes (``time.perf_counter_ns`` on the CPU, CUDA events on a GPU). By default the graph runs once
(a small one again, as often as its first run fits in half a second), every node timed in its
place, and the nodes of one operator signature (:mod:`.signature`: operation, argument shapes,
dtypes and strides) pool their timings: the first ``warmup`` warm up, the median of the rest is
the time of each (a transformer's repeated blocks are timed by their twelve layers in one run). A
signature too rare to get ``MIN_REPEATS`` samples in its places over the runs (the head of a
model that runs once) is timed in a loop of its own on the first of its nodes after which too few
are left: ``warmup`` untimed runs, then timed runs until the median settles or ``repeats`` were
taken. A node that writes a tensor in place (:mod:`.effects`) cannot run twice on the same
inputs: it runs once per run of the graph, and shares with no other. With ``exhaustive=True``
every node is timed instead over ``warmup`` untimed and ``repeats`` timed runs of the whole
graph. An OpGraph node's time is the sum of its fx nodes' medians. Times are seconds for one
call on the example inputs, the unit of work of a profiled graph (see
:class:`~torchplace.graph.NodeRecord`).

Kinds asked for but not present here get a roofline estimate from :mod:`.estimate`.
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from tqdm.auto import tqdm

from torchplace.fxutil import Interpreter, is_compute, on_meta_device, pin_arguments
from torchplace.graph import OpGraph
from torchplace.machine import intra_op_threads
from torchplace.profiling.effects import StateSnapshot
from torchplace.profiling.estimate import estimate_times
from torchplace.profiling.signature import BUDGET, Sampler, shape_key, signature
from torchplace.profiling.trace import Traced

__all__ = ["present_kinds", "profile"]


class _CpuTimer:
    """Wall-clock timer; ``elapsed()`` returns seconds per fx node name."""

    def __init__(self) -> None:
        self._t: dict[str, float] = {}

    def start(self) -> int:
        return time.perf_counter_ns()

    def stop(self, name: str, token: int) -> None:
        self._t[name] = (time.perf_counter_ns() - token) * 1e-9

    def elapsed(self) -> dict[str, float]:
        return dict(self._t)


class _CudaTimer:
    """CUDA-event timer; ``elapsed()`` synchronizes, then returns seconds per fx node name.

    A node's time is the larger of its GPU time (between two events) and the host time spent
    launching it: a small kernel finishes before the host has launched the next one, so a chain of
    them runs at the host's pace (measured on an H100: a 3-node stage predicted at 0.03 ms from
    GPU time alone took 0.45 ms).
    """

    def __init__(self) -> None:
        self._events: dict[str, tuple[Any, Any, int]] = {}

    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev, time.perf_counter_ns()

    def stop(self, name: str, token: Any) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        start, host_start = token
        self._events[name] = (start, end, time.perf_counter_ns() - host_start)

    def elapsed(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {n: max(s.elapsed_time(e) * 1e-3, host * 1e-9) for n, (s, e, host) in self._events.items()}


class _TimingInterpreter(Interpreter):
    """Runs the graph, timing each compute node with ``timer``.

    With ``device`` (a kind other than the CPU) the model stays where it is and each node runs on
    ``device`` with only its own part there: a ``get_attr`` tensor is copied over when the graph
    reads it (and dropped after its last reader), a called module is copied over for its call, and
    device constants in a node's arguments (``arange(..., device=cpu)``) are pinned to ``device``
    (:func:`~torchplace.fxutil.pin_arguments`) as :func:`~torchplace.fxutil.pin_devices` does for a stage. Copies happen outside the timed
    region; nothing of the model is moved or changed, so a model too big for one device is timed
    part by part (issue 17).
    """

    def __init__(self, gm: fx.GraphModule, timer: _CpuTimer | _CudaTimer, device: torch.device | None = None) -> None:
        super().__init__(gm)
        self.timer, self.device = timer, device

    def run_node(self, n: fx.Node) -> Any:
        if self.device is not None:
            return self._run_on_device(n, self.device)
        if not is_compute(n):
            return super().run_node(n)
        token = self.timer.start()
        out = super().run_node(n)
        self.timer.stop(n.name, token)
        return out

    def _run_on_device(self, n: fx.Node, device: torch.device) -> Any:
        if n.op == "get_attr":
            value = super().run_node(n)
            return value.to(device) if isinstance(value, torch.Tensor) else value
        if not is_compute(n):
            return super().run_node(n)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = self._call(n, pin_arguments(args, device), pin_arguments(kwargs, device))
            token = self.timer.start()
            out = call()
        self.timer.stop(n.name, token)
        return out

    def _call(self, n: fx.Node, args: Any, kwargs: Any) -> Callable[[], Any]:
        """Node ``n``'s call on ``args``, ``kwargs``; with ``device``, a called module is copied
        there first (outside any timed region)."""
        if self.device is not None and n.op == "call_module":
            part = copy.deepcopy(self.module.get_submodule(str(n.target))).to(self.device)
            return lambda: part(*args, **kwargs)
        return lambda: getattr(self, n.op)(n.target, args, kwargs)


class _SharingInterpreter(_TimingInterpreter):
    """Runs the graph, timing every compute node in its place, and pools the timings of the nodes
    that share a signature in one :class:`~torchplace.profiling.signature.Sampler` (the first of
    them warm it up), over as many runs as it is given; each node gets its signature's median.

    In its place a node runs as a whole run meets it, on caches as the operators before it left
    them; looped on its own, an operator runs on warm caches and is timed low (a CNN's first
    batch norm, looped: 0.17 ms; in its place: 0.98 ms). So a signature is looped only when the
    nodes of its kind still to come cannot give it ``min_repeats`` samples: those later in this
    run and in the ``runs`` planned after it (counted before the run by
    :func:`~torchplace.profiling.signature.shape_key`; a model's head, a CNN stage's first block
    when the graph runs once). With ``runs=None`` (the first run of a profile whose number of
    runs its first run decides) more runs are assumed to follow until ``deadline``
    (``time.perf_counter``) has passed. A node in ``once`` (one that writes in place: run again
    on the inputs it wrote, it would compute something else) runs once per run, timed there, and
    shares with none. :attr:`times` gives seconds per compute fx node after a :meth:`run`;
    ``looped`` the nodes timed in a loop."""

    def __init__(self, gm: fx.GraphModule, timer: type[_CpuTimer] | type[_CudaTimer], device: torch.device | None,
                 warmup: int, repeats: int, tick: Callable[[], Any] = lambda: None,
                 once: Iterable[str] = (), runs: int | None = 1, deadline: float = 0.0) -> None:
        super().__init__(gm, timer(), device)
        self.timer_type, self.warmup, self.repeats, self.tick = timer, warmup, repeats, tick
        self.once = frozenset(once)
        self.runs, self.deadline = runs, deadline
        self.samplers: dict[Hashable, Sampler] = {}
        self.last: dict[Hashable, float] = {}  # each signature's latest timing (warm-up runs included)
        self.key_of: dict[str, Hashable] = {}
        self.looped: list[str] = []
        self._shape = {n.name: shape_key(n, gm) for n in gm.graph.nodes if is_compute(n)}  # fixed: keyed once
        self._per_run = Counter(self._shape.values())
        self._left: Counter[Hashable] = Counter()
        self._run = 0  # runs started

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """One run of the graph; every run adds to the same pools."""
        self._left = Counter(self._per_run)
        self._run += 1
        return super().run(*args, **kwargs)

    @property
    def times(self) -> dict[str, float]:
        """Seconds per compute fx node: its signature's median (its latest timing while the
        signature has no sample past its warm-up)."""
        def seconds(key: Hashable) -> float:
            sampler = self.samplers.get(key)
            return sampler.median if sampler is not None and sampler.samples else self.last[key]

        return {name: seconds(key) for name, key in self.key_of.items()}

    def run_node(self, n: fx.Node) -> Any:
        if not is_compute(n):
            return super().run_node(n)
        self.tick()
        shape = self._shape[n.name]
        self._left[shape] -= 1
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if self.device is not None:
                args, kwargs = pin_arguments(args, self.device), pin_arguments(kwargs, self.device)
            call = self._call(n, args, kwargs)
            key = n.name if n.name in self.once else signature(n, self.module, args, kwargs)
            self.key_of[n.name] = key
            out, seconds = self._timed(call)
            self.last[key] = seconds
            sampler = self.samplers.setdefault(key, Sampler(self.warmup, self.repeats))
            sampler.add(seconds)
            if n.name not in self.once and not sampler.done and self._too_few_to_come(shape, sampler):
                self.looped.append(n.name)
                while not sampler.done:
                    extra, seconds = self._timed(call)
                    del extra
                    sampler.add(seconds)
        return out

    def _too_few_to_come(self, shape: Hashable, sampler: Sampler) -> bool:
        """Whether the nodes of ``shape`` still to run, in this run and the planned ones after it,
        cannot give ``sampler`` its ``min_repeats`` samples (samples enough in their places, a
        median that has not settled is kept: a loop would add warm-cache samples to it)."""
        if self.runs is None:
            if time.perf_counter() < self.deadline:
                return False  # more runs follow
            later = 0
        else:
            later = self._per_run[shape] * max(0, self.runs - self._run)
        return self._left[shape] + later < sampler.runs_to_minimum

    def _timed(self, call: Callable[[], Any]) -> tuple[Any, float]:
        timer = self.timer_type()
        token = timer.start()
        out = call()
        timer.stop("run", token)
        return out, timer.elapsed()["run"]


def present_kinds() -> set[str]:
    """Device kinds this machine can measure: ``"cpu"``, plus ``"cuda"`` when a GPU is visible."""
    return {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"}


def _device_of(kind: str) -> torch.device:
    """The device a kind is timed on: its first (``cuda:0``)."""
    return torch.device(f"{kind}:0") if kind == "cuda" else torch.device(kind)


def _inputs_on(inputs: tuple[Any, ...], kind: str) -> tuple[Any, ...]:
    """The inputs on the device ``kind`` is timed on (as they are for cpu)."""
    if kind == "cpu":
        return inputs
    device = _device_of(kind)
    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, inputs)


@contextmanager
def _restoring(snapshot: StateSnapshot) -> Iterator[None]:
    try:
        yield
    finally:
        snapshot.restore()


def _measure(
    traced: Traced, example_inputs: Sequence[Any], example_kwargs: Mapping[str, Any], kind: str,
    warmup: int, repeats: int, progress: bool, grad: bool = False,
) -> dict[str, float]:
    """Median seconds per compute fx node over ``repeats`` runs after ``warmup`` runs.

    Every run gets fresh copies of the inputs (a graph may write them in place); the model's
    parameters and buffers are restored afterwards (a graph may update buffers). A kind other than
    the CPU is timed node by node with only that node's part on its device (:class:`_TimingInterpreter`)."""
    gm = traced.gm
    device = None if kind == "cpu" else _device_of(kind)
    samples: dict[str, list[float]] = {}
    bar = tqdm(range(warmup + repeats), desc=f"profiling on {kind}", disable=not progress, leave=False)
    snapshot = StateSnapshot(gm)
    with torch.set_grad_enabled(grad), _restoring(snapshot):
        for i in bar:
            inputs = _inputs_on(traced.flat_inputs(example_inputs, example_kwargs), kind)
            timer = _CudaTimer() if kind == "cuda" else _CpuTimer()
            _TimingInterpreter(gm, timer, device).run(*inputs)
            if i >= warmup:
                for name, t in timer.elapsed().items():
                    samples.setdefault(name, []).append(t)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def _measure_shared(
    traced: Traced, example_inputs: Sequence[Any], example_kwargs: Mapping[str, Any], kind: str,
    warmup: int, repeats: int, progress: bool, grad: bool = False,
) -> dict[str, float]:
    """Seconds per compute fx node, the nodes of each signature pooled (:class:`_SharingInterpreter`).

    The graph runs once, and again as often as its first run fits in
    :data:`~torchplace.profiling.signature.BUDGET` seconds (at most ``warmup + repeats`` runs, as
    exhaustive profiling takes), every run adding to the same pools: the samples of one run lie
    within its few milliseconds for a small model, where one stall of the machine moves them all
    together, and a rare signature is then timed in its places over the runs, not in a loop. Each
    run gets fresh copies of the inputs; the model's parameters and buffers are restored
    afterwards."""
    gm = traced.gm
    device = None if kind == "cpu" else _device_of(kind)
    compute = sum(1 for n in gm.graph.nodes if is_compute(n))
    bar = tqdm(total=compute, desc=f"profiling on {kind}", disable=not progress, leave=False)
    timer = _CudaTimer if kind == "cuda" else _CpuTimer
    start = time.perf_counter()
    interpreter = _SharingInterpreter(gm, timer, device, warmup, repeats, tick=bar.update, once=traced.effects.written,
                                      runs=None, deadline=start + BUDGET)
    with torch.set_grad_enabled(grad), _restoring(StateSnapshot(gm)), bar:
        interpreter.run(*_inputs_on(traced.flat_inputs(example_inputs, example_kwargs), kind))
        interpreter.tick = lambda: None  # the bar counts the first run
        first = time.perf_counter() - start
        interpreter.runs = 1 if first >= BUDGET else min(max(1, warmup + repeats), math.ceil(BUDGET / max(first, 1e-9)))
        for _ in range(interpreter.runs - 1):
            interpreter.run(*_inputs_on(traced.flat_inputs(example_inputs, example_kwargs), kind))
    return interpreter.times


def _node_times(graph: OpGraph, fx_times: Mapping[str, float]) -> dict[str, float]:
    """Seconds per OpGraph node: the sum over its fx nodes."""
    return {node_id: sum(fx_times[n] for n in r.fx_nodes) for node_id, r in graph.records()}


def _with_times(graph: OpGraph, times: Mapping[str, Mapping[str, float]]) -> OpGraph:
    """A new OpGraph like ``graph`` whose records carry ``times[kind][node_id]`` for every kind."""
    return graph.with_records(lambda v, r: replace(r, times={**r.times, **{kind: t[v] for kind, t in times.items()}}))


def profile(
    traced: Traced,
    example_inputs: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    kinds: Iterable[str] = ("cpu",),
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
    grad: bool = False,
    threads: Mapping[str, int | None] | None = None,
    exhaustive: bool = False,
) -> OpGraph:
    """Time every node of ``traced.graph`` on each device kind.

    Args:
        traced: the output of :func:`torchplace.profiling.trace` (model in eval mode).
        example_inputs: the inputs to time with (normally those it was traced with).
        example_kwargs: keyword inputs to time with.
        kinds: device kinds to fill in. Kinds present here (:func:`present_kinds`) are measured;
            the others are estimated with :func:`torchplace.profiling.estimate.estimate_times`, and
            so is every kind for a model on the meta device (weights without values).
        warmup: untimed runs before measuring.
        repeats: timed runs; each fx node's time is the median over them. By signature (the
            default) the most a signature gets: it stops once the median settles
            (:class:`~torchplace.profiling.signature.Sampler`).
        progress: show a tqdm bar over the runs.
        grad: time with autograd recording, as a training forward pass runs.
        threads: intra-op threads to time each kind with, as its devices' workers will run
            (``Device.threads``; missing: the process's setting).
        exhaustive: time every node in each of ``warmup + repeats`` runs of the whole graph,
            instead of each distinct signature once (module docstring).

    Returns:
        A new :class:`OpGraph` with the same nodes, edges and meta, and ``times`` filled in.

    Raises:
        ValueError: for ``repeats < 1``, ``warmup < 0``, or an absent kind with no device spec.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    present = set() if on_meta_device(traced.gm) else present_kinds()  # the meta device has nothing to time
    times: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(kinds):
        if kind in present:
            with intra_op_threads((threads or {}).get(kind)):
                measure = _measure if exhaustive else _measure_shared
                fx_times = measure(traced, example_inputs, example_kwargs or {}, kind, warmup, repeats, progress, grad)
            times[kind] = _node_times(traced.graph, fx_times)
        else:
            times[kind] = estimate_times(traced, example_inputs, kind, example_kwargs)
    return _with_times(traced.graph, times)
