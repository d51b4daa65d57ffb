"""Profile a traced model for training and build its training graph (Tarnawski et al. 2020, Sec. 5.3).

For every compute fx node, :func:`measure_backward` runs the node alone on leaves of its inputs and
times ``torch.autograd.grad`` of its outputs (gradients for its inputs and its parameters), and
records what autograd saves for that backward (``torch.autograd.graph.saved_tensors_hooks``; bytes
of the node's saved activations, parameters excluded, each storage once) and the bytes of the
gradients it sends back to its inputs.

:func:`training_graph` then gives each forward node ``v`` of the (profiled) forward OpGraph a
backward node ``v:backward``, as in the published training workloads: colocated with ``v`` (they
work on the same weights), an edge ``v -> v:backward`` (the saved activations) and, for every
forward edge ``u -> v``, an edge ``v:backward -> u:backward`` (the gradient of ``u``'s output).
The backward node's time is the measured backward time; its ``param_bytes`` hold the gradients and
optimizer state of the trainable parameters ``v`` owns (``optimizer``: ``"sgd"`` 0, ``"momentum"``
1, ``"adam"`` / ``"adamw"`` 2 state tensors per parameter, or a number); its output is the
gradient it sends back. The forward node keeps ``saved_bytes``.

Kinds that are not present here get an estimated backward time of twice the estimated forward
time (a backward pass computes gradients for both inputs and weights: about twice the FLOPs).
"""
from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree
from tqdm.auto import tqdm

from torchplace.errors import UsageError
from torchplace.fxutil import Interpreter, is_compute, pin_arguments
from torchplace.graph import NodeRecord, OpGraph, saved_key, union_of_saved
from torchplace.profiling.effects import StateSnapshot, named_state, storage_address
from torchplace.profiling.trace import Traced

__all__ = ["OPTIMIZER_STATE", "BackwardCost", "measure_backward", "optimizer_state_factor", "training_graph"]

OPTIMIZER_STATE = {"sgd": 0.0, "momentum": 1.0, "sgd+momentum": 1.0, "adam": 2.0, "adamw": 2.0}
"""State tensors an optimizer keeps per parameter (momentum: one buffer; Adam: two moments)."""


def optimizer_state_factor(optimizer: str | float | int) -> float:
    """Bytes of optimizer state per byte of trainable parameter.

    Raises:
        UsageError: for an unknown optimizer name or a negative / non-finite number.
    """
    if isinstance(optimizer, torch.optim.Optimizer) or (isinstance(optimizer, type)
                                                         and issubclass(optimizer, torch.optim.Optimizer)):
        kind = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = kind.__name__.lower()
        if name == "sgd" and not isinstance(optimizer, type):  # its momentum buffer is state too
            name = "momentum" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "sgd"
        fix = f"optimizer={name!r}" if name in OPTIMIZER_STATE else "its bytes of state per parameter byte as a number"
        raise UsageError(f"optimizer= takes the optimizer's name or its bytes of state per parameter byte, for the "
                         f"memory model, not an optimizer object ({kind.__name__}: build it after placing, on "
                         f"placed.parameters()); pass {fix}")
    if isinstance(optimizer, str):
        key = optimizer.lower().replace(" ", "")
        if key not in OPTIMIZER_STATE:
            raise UsageError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATE)}; or give the bytes "
                             "of state per parameter byte as a number (e.g. optimizer=2.0 for Adam)")
        return OPTIMIZER_STATE[key]
    from torchplace.checks import non_negative_float

    return non_negative_float(optimizer, "optimizer")


@dataclass(frozen=True)
class BackwardCost:
    """What one fx node's backward costs: seconds, activations it saves, gradient bytes it sends.

    ``saved_parts`` splits ``saved_bytes`` by the storage each saved tensor lives in, keyed by
    :func:`torchplace.graph.saved_key`: the output of the fx node that made it, or the node's own temporaries.
    Two nodes that save the same tensor (the three projections of attention saving the layer
    norm's output; a ReLU's output saved by the ReLU and by the next linear) name the same key, so
    a device holding both keeps it once (:func:`torchplace.costmodel.saved_union`).
    """

    seconds: float
    grad_bytes: int
    saved_parts: Mapping[str, int] = field(default_factory=dict)

    @property
    def saved_bytes(self) -> int:
        """Bytes of activations it saves for backward (its ``saved_parts`` together)."""
        return sum(self.saved_parts.values())


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class _Probe(Interpreter):
    """Runs the graph (no grad, for the values) and probes each compute node's backward.

    With ``parts`` (a device other than the CPU) the model stays where it is, as in forward
    profiling (:class:`~torchplace.profiling.profile._TimingInterpreter`): the values live on
    ``device``, a ``get_attr`` tensor is copied there when the graph reads it, a called module is
    copied there for its node, and device constants in a node's arguments are pinned to ``device``;
    so a model too big for one device is probed part by part (issue 17 item 6).
    """

    def __init__(self, gm: fx.GraphModule, params: set[int], writers: set[str], device: torch.device,
                 parts: bool) -> None:
        super().__init__(gm)
        self.params, self.writers, self.device, self.parts = params, writers, device, parts
        # model tensors that take no gradient (buffers such as batch norm's running statistics,
        # frozen parameters): the probe passes them as they are (autograd refuses a running mean
        # that requires grad), and neither times nor counts a gradient for them
        self.frozen = {storage_address(t) for t in named_state(gm).values() if not t.requires_grad} - {None}
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.saved: dict[str, dict[str, int]] = {}
        self.grad_bytes: dict[str, int] = {}
        # the storages of each fx node's value, by address, with their saved_key: an address is
        # looked up only while the value is in the environment (read by the node running), so a
        # freed address that a later tensor reuses is never mistaken for it
        self.keys: dict[str, dict[int, str]] = {}
        # the fx nodes whose values require grad in the training forward: a trainable parameter
        # or an input that does flows into them (an argmax's index, and its float, do not)
        self.requiring: set[str] = set()

    def run_node(self, n: fx.Node) -> Any:
        value = self._run_node(n)
        reads = any(a.name in self.requiring for a in n.all_input_nodes)
        if n.op == "call_module":
            reads = reads or any(p.requires_grad for p in self.module.get_submodule(str(n.target)).parameters())
        if n.op in ("placeholder", "get_attr"):
            reads = any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))
        if reads and any(_floating(t) for t in pytree.tree_leaves(value)):
            self.requiring.add(n.name)
        return value

    def _run_node(self, n: fx.Node) -> Any:
        if self.parts and n.op == "get_attr":
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                value = self._weight(value.to(self.device), value.requires_grad)
        elif not is_compute(n):
            value = super().run_node(n)
        else:
            with self._set_current_node(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                if self.parts:
                    args, kwargs = pin_arguments(args, self.device), pin_arguments(kwargs, self.device)
                part = self._part(n)
                value = self._call(n, part, args, kwargs)
                self._name_storages(n, value)  # first: the probe looks the node's own storages up
                self._probe(n, part, args, kwargs, value)
                return value
        self._name_storages(n, value)
        return value

    def _inherited(self, n: fx.Node) -> dict[int, str]:
        """The keys of the storages ``n``'s inputs live in (what a view of an input shares)."""
        keys: dict[int, str] = {}
        for a in n.all_input_nodes:
            keys.update(self.keys.get(a.name, {}))
        return keys

    def _name_storages(self, n: fx.Node, value: Any) -> None:
        """Key each storage of ``n``'s value: an input's key where it is an input's storage (a view
        or a getitem), else ``saved_key(n, i)`` for its ``i``-th new storage; parameters get none."""
        inherited, keys = self._inherited(n), {}
        for t in pytree.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            addr = storage_address(t)
            if addr is None or addr in self.params or addr in keys:
                continue
            made = sum(k.startswith(f"{n.name}#") for k in keys.values())
            keys[addr] = inherited.get(addr) or saved_key(n.name, made)
        self.keys[n.name] = keys

    def _weight(self, t: torch.Tensor, trainable: bool) -> torch.Tensor:
        """A copy of a model tensor on the device: a parameter, not an activation, for the probe
        (``trainable``: whether the model's own tensor takes a gradient)."""
        key = storage_address(t)
        if key is not None:
            self.params.add(key)
            if not trainable:
                self.frozen.add(key)
        return t

    def _part(self, n: fx.Node) -> torch.nn.Module | None:
        """The module node ``n`` calls (with ``parts``, a copy on the device), or ``None``."""
        if n.op != "call_module":
            return None
        module = self.module.get_submodule(str(n.target))
        if not self.parts:
            return module
        copied = copy.deepcopy(module).to(self.device)
        for t in (*copied.parameters(), *copied.buffers()):
            self._weight(t, t.requires_grad)
        return copied

    def _call(self, n: fx.Node, part: torch.nn.Module | None, args: Any, kwargs: Any) -> Any:
        return part(*args, **kwargs) if part is not None else getattr(self, n.op)(n.target, args, kwargs)

    def _probe(self, n: fx.Node, part: torch.nn.Module | None, args: Any, kwargs: Any, value: Any) -> None:
        """Time node ``n``'s backward on its (pinned) arguments, and count what it saves by
        storage (:func:`saved_key`; ``value`` is the node's output from the run without grad)."""
        leaves: list[torch.Tensor] = []
        activations = 0

        writes = n.name in self.writers
        clones: dict[int | None, int | None] = {}  # a writer's copy of an input -> the input's storage

        def copied(t: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
            clones[storage_address(t)] = storage_address(original)
            return t

        grads = {id(t) for a in n.all_input_nodes if a.name in self.requiring
                 for t in pytree.tree_leaves(self.env.get(a)) if isinstance(t, torch.Tensor)}

        def leaf(t: Any) -> Any:
            nonlocal activations
            key = storage_address(t) if isinstance(t, torch.Tensor) else None
            trainable = key in self.params and key not in self.frozen
            if not _floating(t) or not (trainable or id(t) in grads):  # as it is in the forward: no gradient
                return copied(t.clone(), t) if writes and isinstance(t, torch.Tensor) else t
            x = t.detach().requires_grad_(True)
            leaves.append(x)
            if storage_address(t) not in self.params:
                activations += t.numel() * t.element_size()
            return copied(x.clone(), t) if writes else x  # an in-place op may not write a leaf

        with torch.enable_grad():  # a clone made without grad would cut the leaf off (nothing timed or saved)
            args, kwargs = pytree.tree_map_only(torch.Tensor, leaf, (args, kwargs))
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_address(t)
            key = clones.get(key, key)  # what a writer saves of its copy of an input is that input
            if key is not None and key not in self.params:
                saved[key] = max(saved.get(key, 0), t.untyped_storage().nbytes())
            return t

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._call(n, part, args, kwargs)
        outs = [t for t in pytree.tree_leaves(out) if _floating(t) and t.requires_grad]
        parts = self._saved_parts(n, saved, out, value)
        targets = leaves + ([p for p in part.parameters() if p.requires_grad] if part is not None else [])
        seconds = 0.0
        if outs and targets:
            grads = [torch.ones_like(t) for t in outs]
            self._sync()
            start = time.perf_counter()
            torch.autograd.grad(outs, targets, grads, allow_unused=True)
            self._sync()
            seconds = time.perf_counter() - start
        self.seconds[n.name] = seconds
        self.saved[n.name] = parts if outs else {}
        self.grad_bytes[n.name] = activations if outs else 0

    def _saved_parts(self, n: fx.Node, saved: Mapping[int, int], out: Any, value: Any) -> dict[str, int]:
        """``saved`` (storage address in the probe -> bytes) by :func:`saved_key`: a leaf input's
        storage is its producer's (the leaves share the inputs' storages); the probe's ``i``-th
        output storage is the key of ``value``'s ``i``-th (the same node run without grad); what
        is left are ``n``'s temporaries."""
        inherited = self._inherited(n)
        mine = self.keys.get(n.name, {})
        fresh = [storage_address(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        probe = [storage_address(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        as_output = {a: mine[b] for a, b in zip(probe, fresh) if a is not None and b in mine}
        parts: dict[str, int] = {}
        temporaries = saved_key(n.name, None)
        for addr, nbytes in saved.items():
            key = inherited.get(addr) or as_output.get(addr) or temporaries
            parts[key] = parts.get(key, 0) + nbytes if key == temporaries else max(parts.get(key, 0), nbytes)
        return parts

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def measure_backward(traced: Traced, example_inputs: Sequence[Any], example_kwargs: Mapping[str, Any] | None = None,
                     *, kind: str = "cpu", warmup: int = 1, repeats: int = 3,
                     progress: bool = True, parts: bool | None = None) -> dict[str, BackwardCost]:
    """Backward seconds (median of ``repeats`` after ``warmup``), saved and gradient bytes of every
    compute fx node, on the first device of ``kind`` (``"cpu"`` or ``"cuda"``, where CUDA times are
    taken between synchronizations); the model's parameters and buffers are restored afterwards.

    On a device other than the CPU (or with ``parts=True``) the model is never copied there whole:
    each node's part is (:class:`_Probe`), so a model that does not fit the device is profiled.
    """
    gm, device = traced.gm, torch.device("cpu" if kind == "cpu" else f"{kind}:0")
    parts = device.type != "cpu" if parts is None else parts
    params = {storage_address(t) for t in named_state(gm).values()} - {None}
    writers = set(traced.effects.written)
    samples: dict[str, list[float]] = {}
    probe = _Probe(gm, params, writers, device, parts)
    snapshot = StateSnapshot(gm)
    try:
        with torch.no_grad():
            for i in tqdm(range(warmup + repeats), desc=f"profiling backward on {kind}", disable=not progress,
                          leave=False):
                inputs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device),
                                              traced.flat_inputs(example_inputs, example_kwargs))
                probe.run(*inputs)
                if i >= warmup:
                    for name, t in probe.seconds.items():
                        samples.setdefault(name, []).append(t)
    finally:
        snapshot.restore()
    return {
        name: BackwardCost(statistics.median(ts), probe.grad_bytes[name], probe.saved[name])
        for name, ts in samples.items()
    }


def _trainable_owned(graph: OpGraph) -> dict[str, int]:
    """Bytes of trainable parameters each node owns (``meta["state"]``)."""
    out: dict[str, int] = {}
    for entry in (graph.meta.get("state") or {}).values():
        if entry.get("trainable") and entry.get("owner") is not None:
            out[entry["owner"]] = out.get(entry["owner"], 0) + int(entry["bytes"])
    return out


def backward_id(node: str) -> str:
    """The id of forward node ``node``'s backward node."""
    return f"{node}:backward"


def training_graph(graph: OpGraph, backward: Mapping[str, Mapping[str, BackwardCost]], optimizer: str | float,
                   estimated: Iterable[str] = ()) -> OpGraph:
    """The training graph of a profiled forward OpGraph (see the module docstring).

    Args:
        graph: the forward OpGraph with times for every device kind.
        backward: ``{kind: {fx node: BackwardCost}}`` for the kinds measured.
        optimizer: see :func:`optimizer_state_factor`.
        estimated: kinds whose backward time is estimated as twice the forward time.
    """
    factor = optimizer_state_factor(optimizer)
    trainable = _trainable_owned(graph)
    measured = next(iter(backward.values()), {})
    out = OpGraph(meta={**graph.meta, "training": {"optimizer": optimizer, "state_factor": factor}})
    for v, r in graph.records():
        label = r.colocation if r.colocation is not None else f"layer:{v}"
        parts = union_of_saved(measured[f].saved_parts for f in r.fx_nodes if f in measured)
        grads = sum(measured[f].grad_bytes for f in r.fx_nodes if f in measured)
        times = {kind: math.fsum(costs[f].seconds for f in r.fx_nodes if f in costs) for kind, costs in backward.items()}
        times.update({kind: 2.0 * r.times[kind] for kind in estimated if kind in r.times})
        out.add_node(v, replace(r, colocation=label, saved_bytes=sum(parts.values()), saved_parts=parts))
        out.add_node(backward_id(v), NodeRecord(
            name=f"{r.name} (backward)", op=f"backward:{r.op}", module=r.module,
            param_bytes=int(round(trainable.get(v, 0) * (1.0 + factor))), output_bytes=grads, temp_bytes=grads,
            times=times, colocation=label, backward=True,
        ))
    for u, v in graph.edges:
        out.add_edge(u, v)
        out.add_edge(backward_id(v), backward_id(u))
    for v in graph:
        out.add_edge(v, backward_id(v))
    return out

