"""Time each distinct operator once: signatures of fx nodes and adaptive repeats (issue 16 item 4).

A transformer's blocks repeat the same operators on the same shapes: GPT-2 small's 488 operator
nodes hold about 50 distinct calls. :func:`signature` names what decides a node's time: its
operation (``op`` and target; for a called module its class, ``repr`` and the shapes of its
parameters and buffers), and its arguments with every tensor replaced by its shape, dtype,
strides, device and whether it requires grad (other values by their ``repr``). Nodes with equal
signatures run the same kernels on the same shapes, so one measurement serves them all.

:class:`Sampler` decides how often to run one: ``warmup`` untimed runs (fewer for a long
operator: a warm-up run of :data:`LONG_RUN` seconds ends them, and one of ``budget`` seconds is
itself the sample, first-call costs such as allocation being small next to it), then timed runs
until the median has settled (at least ``min_repeats``,
the median moved by at most ``rtol`` with the last sample), ``max_repeats`` were taken, or the
timed runs add up to ``budget`` seconds (an operator of a second is timed once: the scheduler's
noise averages out within it).
"""
from __future__ import annotations

import statistics
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

__all__ = ["BUDGET", "MIN_REPEATS", "RTOL", "Sampler", "shape_key", "signature"]

MIN_REPEATS = 3
"""Timed runs a signature gets at least (a median of three outlasts one disturbed run)."""

RTOL = 0.05
"""The median is settled when the last sample moved it by at most this share."""

LONG_RUN = 0.05
"""Seconds of a warm-up run after which no further warm-up is needed."""

BUDGET = 0.5
"""Seconds of timed runs after which a signature's timing stops, settled or not."""


def _value_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        layout = value.stride() if value.layout == torch.strided else str(value.layout)
        return ("tensor", tuple(value.shape), str(value.dtype), layout, str(value.device), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_value_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((str(k), _value_key(v)) for k, v in value.items()))
    if isinstance(value, nn.Module):
        return _module_key(value)
    return (type(value).__qualname__, repr(value))


def _module_key(module: nn.Module) -> Hashable:
    state = tuple((name, _value_key(t)) for name, t in (*module.named_parameters(), *module.named_buffers()))
    return (type(module).__qualname__, repr(module), module.training, state)


def signature(node: fx.Node, gm: fx.GraphModule, args: Any, kwargs: Any) -> Hashable:
    """What decides ``node``'s time when called with ``args``/``kwargs`` (see the module docstring)."""
    if node.op == "call_module":
        target: Hashable = _module_key(gm.get_submodule(str(node.target)))
    elif node.op == "call_function":
        target = (getattr(node.target, "__module__", None), getattr(node.target, "__qualname__", None),
                  str(node.target))
    else:
        target = str(node.target)
    return (node.op, target, _value_key(args), _value_key(kwargs))


def shape_key(node: fx.Node, gm: fx.GraphModule) -> Hashable:
    """What the trace knows of ``node``'s :func:`signature` before a run: its operation (for a
    called module, its class, ``repr`` and parameter shapes) and arguments, each input node by the
    shapes and dtypes of its value (``meta["torchplace"]``; without it, by name, a key of its
    own). Nodes with one signature share this key; one key may hold several signatures (strides
    and devices are known only in the run)."""

    def value(a: fx.Node) -> Hashable:
        info = a.meta.get("torchplace")
        return ("value", info.shapes, info.dtypes) if info is not None else ("node", a.name)

    target = _module_key(gm.get_submodule(str(node.target))) if node.op == "call_module" else str(node.target)
    return (node.op, target, repr(fx.node.map_arg((node.args, node.kwargs), value)))


@dataclass
class Sampler:
    """The timed runs of one signature (see the module docstring).

    Example:
        >>> s = Sampler(warmup=1, max_repeats=5)
        >>> for t in (0.009, 0.001, 0.001, 0.001):      # the first run is warm-up
        ...     s.add(t)
        >>> s.done, s.median
        (True, 0.001)
    """

    warmup: int
    max_repeats: int
    min_repeats: int = MIN_REPEATS
    rtol: float = RTOL
    budget: float = BUDGET
    samples: list[float] = field(default_factory=list)
    warm: int = 0
    _settled: bool = False

    def add(self, seconds: float) -> None:
        """Record one run (warm-up runs are counted, not kept)."""
        if self.warm < self.warmup and seconds < self.budget:
            self.warm = self.warmup if seconds >= LONG_RUN else self.warm + 1
            return
        self.warm = self.warmup  # a run of the whole budget is warm enough to count
        before = statistics.median(self.samples) if self.samples else None
        self.samples.append(seconds)
        now = statistics.median(self.samples)
        self._settled = before is not None and abs(now - before) <= self.rtol * now

    @property
    def done(self) -> bool:
        """Whether no more runs are needed."""
        n = len(self.samples)
        if n >= self.max_repeats or (n > 0 and sum(self.samples) >= self.budget):
            return True
        return n >= self.min_repeats and self._settled

    @property
    def runs_to_minimum(self) -> int:
        """Runs still needed before it holds ``min_repeats`` samples (0 once it does, or is :attr:`done`)."""
        if self.done:
            return 0
        return self.warmup - self.warm + max(0, self.min_repeats - len(self.samples))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)
