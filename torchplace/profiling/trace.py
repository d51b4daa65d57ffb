"""Trace an ``nn.Module`` into a :class:`torch.fx.GraphModule` and an :class:`OpGraph`.

Two capture methods:

* ``"fx"``: :func:`torch.fx.symbolic_trace` with a tracer whose leaves are the user's
  ``leaf_modules`` (and, at module granularity, every childless or standard ``torch.nn`` module).
  The graph holds ``call_module`` nodes for leaves and Python-level ops elsewhere.
* ``"export"``: ``torch.export.export(model, inputs, strict=False).module()``. The graph holds aten
  ops; module structure survives only in ``node.meta["nn_module_stack"]``, so leaves are formed by
  grouping aten nodes per leaf-module instance.
* ``"auto"`` tries fx, then export.

The :class:`OpGraph` has one node per compute fx node (``call_function``/``call_method``/
``call_module``) or per group of them. Placeholders, ``get_attr`` and ``output`` are runtime
concerns and get no node. **Node ids are fx node names**: the name of the node's first fx node (in
graph order). Each parameter/buffer is counted once (by storage), on the first node in topological
order that reads it; model tensors that no node reads (e.g. BatchNorm's ``num_batches_tracked`` in
eval mode) are reported in ``graph.meta["unattributed_param_bytes"]``.

Caveat: ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` with ``batch_first=True`` take
a fused "fast path" in eval mode under ``no_grad``. Tracing never captures it, so the traced module
matches the model run with grad enabled (or with ``torch.backends.mha.set_fastpath_enabled(False)``)
bitwise, but not the fast path.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.errors import TraceError
from torchplace.graph import NodeRecord, OpGraph

__all__ = ["TensorInfo", "Traced", "flat_inputs", "is_compute", "tensor_bytes", "trace"]

_METHODS = ("auto", "fx", "export")
_GRANULARITIES = ("operator", "module")
_COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class TensorInfo:
    """Shapes and sizes of one fx node's outputs, stored in ``node.meta["torchplace"]``.

    Attributes:
        shapes: shape of each output tensor (pytree leaves of the output, in order).
        dtypes: dtype name of each output tensor.
        output_bytes: sum of ``numel * element_size`` over the output tensors.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    output_bytes: int


@dataclass(frozen=True)
class Traced:
    """A traced model.

    Attributes:
        gm: the module the runtime splits and runs. ``gm(*example_inputs)`` returns what the model
            returns, with the same pytree structure (for ``"export"``, e.g. a Hugging Face
            ``ModelOutput``) and bitwise-equal tensors in eval mode.
        graph: the :class:`OpGraph` over ``gm``'s compute nodes (costs except ``times``).
        method: the capture method actually used, ``"fx"`` or ``"export"``.
    """

    gm: fx.GraphModule
    graph: OpGraph
    method: str

    def flat_inputs(self, example_inputs: Sequence[Any]) -> tuple[Any, ...]:
        """The values of ``gm``'s placeholders, in order (see :func:`flat_inputs`)."""
        return flat_inputs(self.gm, example_inputs)


def flat_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Arguments for :meth:`torch.fx.Interpreter.run` on ``gm``: one value per placeholder.

    An exported module flattens ``(args, kwargs)`` into its placeholders; an fx module takes the
    positional arguments as they are.
    """
    if getattr(gm, "_in_spec", None) is not None:
        return tuple(pytree.tree_leaves((tuple(example_inputs), {})))
    return tuple(example_inputs)


def is_compute(node: fx.Node) -> bool:
    """Whether an fx node becomes (part of) an OpGraph node."""
    return node.op in _COMPUTE_OPS


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor among the pytree leaves of ``value``."""
    return sum(
        t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
    )


# -- capture -----------------------------------------------------------------------------------
class _LeafTracer(fx.Tracer):
    """An fx tracer with user-chosen leaves that remembers the innermost module it failed in."""

    def __init__(self, leaf_types: tuple[type, ...], module_level: bool) -> None:
        super().__init__()
        self.leaf_types = leaf_types
        self.module_level = module_level
        self.failed_in: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types):
            return True
        if self.module_level:
            return not any(True for _ in m.children()) or super().is_leaf_module(m, module_qualified_name)
        return False

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = (self.path_of_module(m), type(m).__qualname__)
            raise


def _fx_capture(model: nn.Module, leaf_types: tuple[type, ...], module_level: bool) -> fx.GraphModule:
    """``symbolic_trace`` with :class:`_LeafTracer`; failures re-raised as :class:`_CaptureFailure`."""
    tracer = _LeafTracer(leaf_types, module_level)
    try:
        graph = tracer.trace(model)
    except Exception as e:
        path, cls = tracer.failed_in or ("", type(model).__qualname__)
        raise _CaptureFailure("fx", path, cls, e) from e
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _export_capture(model: nn.Module, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
    """``torch.export`` (non-strict) then ``.module()``; failures as :class:`_CaptureFailure`."""
    try:
        return torch.export.export(model, tuple(example_inputs), strict=False).module()
    except Exception as e:
        raise _CaptureFailure("export", "", type(model).__qualname__, e) from e


class _CaptureFailure(Exception):
    """One capture method failed, inside module ``path`` of class ``cls``."""

    def __init__(self, method: str, path: str, cls: str, error: Exception) -> None:
        first_line = (str(error).strip().splitlines() or [""])[0]
        super().__init__(f"{method} failed in {path or '<root>'} ({cls}): {type(error).__name__}: {first_line}")
        self.method, self.path, self.cls, self.error = method, path, cls, error


def _trace_error(model: nn.Module, failures: list[_CaptureFailure]) -> TraceError:
    """A :class:`TraceError` naming the failing module, the errors, and what to try."""
    first = failures[0]
    where = f"module '{first.path}' ({first.cls})" if first.path else f"{first.cls} itself"
    hints = [f"pass leaf_modules=({first.cls},) to keep that module whole"]
    if all(f.method != "export" for f in failures):
        hints.append("use method='export'")
    hints.append("for Hugging Face models, build the model with use_cache=False")
    hints.append("data-dependent Python control flow (`if x.sum() > 0:`) must sit inside a leaf module")
    tried = "; ".join(str(f) for f in failures)
    return TraceError(
        f"could not trace {type(model).__qualname__}: it fails in {where}. {tried}. "
        f"Try: {'; '.join(hints)}."
    )


def _capture(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    method: str,
    leaf_types: tuple[type, ...],
    module_level: bool,
) -> tuple[fx.GraphModule, str]:
    """Run the requested capture method(s); return the module and the method used."""
    order = ("fx", "export") if method == "auto" else (method,)
    failures: list[_CaptureFailure] = []
    for m in order:
        try:
            if m == "fx":
                return _fx_capture(model, leaf_types, module_level), "fx"
            return _export_capture(model, example_inputs), "export"
        except _CaptureFailure as f:
            failures.append(f)
    raise _trace_error(model, failures) from failures[-1].error


# -- shapes --------------------------------------------------------------------------------------
class _ShapeRecorder(fx.Interpreter):
    """Runs the graph once and stores a :class:`TensorInfo` in each node's ``meta["torchplace"]``."""

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        n.meta["torchplace"] = TensorInfo(
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
            output_bytes=tensor_bytes(tensors),
        )
        return out


def _record_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Shape propagation on real inputs (no grad), like fx's ``ShapeProp``."""
    with torch.no_grad():
        _ShapeRecorder(gm).run(*flat_inputs(gm, example_inputs))


# -- grouping -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    """fx nodes that form one OpGraph node; ``label`` is the leaf module path or the node name."""

    nodes: tuple[fx.Node, ...]
    label: str
    module: str
    op: str


def _op_name(node: fx.Node, gm: fx.GraphModule) -> str:
    """``"call_function:aten.addmm.default"``, ``"call_method:view"``, ``"call_module:Linear"``."""
    if node.op == "call_module":
        return f"call_module:{type(gm.get_submodule(str(node.target))).__name__}"
    if node.op == "call_method":
        return f"call_method:{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"call_function:{target}"
    return f"call_function:{fx.node._get_qualified_name(target)}"  # type: ignore[arg-type]


def _module_of(node: fx.Node) -> str:
    """Innermost module path of a node: the call_module target or the last nn_module_stack entry."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _leaf_path(node: fx.Node, is_leaf: Callable[[str], bool]) -> str | None:
    """Outermost module on the node's nn_module_stack that is a leaf (``None`` if none is)."""
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        if is_leaf(str(path)):
            return str(path)
    return None


def _leaf_predicate(
    model: nn.Module, leaf_types: tuple[type, ...], module_level: bool
) -> Callable[[str], bool]:
    """Whether the module at a path is a leaf: a ``leaf_types`` instance, or childless at module level."""

    def is_leaf(path: str) -> bool:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            return False
        return isinstance(m, leaf_types) or (module_level and not any(True for _ in m.children()))

    return is_leaf


def _singleton(node: fx.Node, gm: fx.GraphModule) -> _Group:
    return _Group((node,), node.name, _module_of(node), _op_name(node, gm))


def _group_by_leaf(gm: fx.GraphModule, model: nn.Module, is_leaf: Callable[[str], bool]) -> list[_Group]:
    """One group per leaf-module instance (ordered by first node); other nodes alone."""
    buckets: dict[tuple[str, str], list[fx.Node]] = {}
    for node in filter(is_compute, gm.graph.nodes):
        path = _leaf_path(node, is_leaf) if node.op != "call_module" else None
        key = ("node", node.name) if path is None else ("leaf", path)
        buckets.setdefault(key, []).append(node)
    groups = []
    for (kind, path), nodes in buckets.items():
        if kind == "node":
            groups.append(_singleton(nodes[0], gm))
        else:
            cls = type(model.get_submodule(path)).__name__
            groups.append(_Group(tuple(nodes), path or "<root>", path, f"call_module:{cls}"))
    return groups


# -- OpGraph ------------------------------------------------------------------------------------
def _group_edges(groups: Sequence[_Group]) -> set[tuple[int, int]]:
    """Index pairs (i, j): some node of group j uses a node of group i."""
    owner = {n: i for i, g in enumerate(groups) for n in g.nodes}
    edges: set[tuple[int, int]] = set()
    for j, g in enumerate(groups):
        for n in g.nodes:
            edges.update((owner[a], j) for a in n.all_input_nodes if a in owner and owner[a] != j)
    return edges


def _merge_cycles(groups: list[_Group]) -> list[_Group]:
    """Merge groups on a common cycle (strongly connected components) so the group graph is a DAG."""
    g = nx.DiGraph(_group_edges(groups))
    g.add_nodes_from(range(len(groups)))
    comps = [sorted(c) for c in nx.strongly_connected_components(g)]
    if all(len(c) == 1 for c in comps):
        return groups
    position = {n: k for k, n in enumerate(groups[0].nodes[0].graph.nodes)}
    merged = []
    for comp in comps:
        parts = [groups[i] for i in comp]
        if len(parts) == 1:
            merged.append(parts[0])
            continue
        nodes = tuple(sorted((n for p in parts for n in p.nodes), key=position.__getitem__))
        label = "+".join(p.label for p in parts)
        merged.append(_Group(nodes, label, parts[0].module, "group:" + "+".join(p.op for p in parts)))
    return sorted(merged, key=lambda grp: position[grp.nodes[0]])


_Key = tuple[int, int, int]


def _storage_key(t: torch.Tensor) -> _Key:
    """Identity of a tensor's memory: tied weights share it."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), int(t.numel() * t.element_size()))


def _params_used(node: fx.Node, gm: fx.GraphModule) -> Iterator[torch.Tensor]:
    """Parameters/buffers a node reads: its get_attr inputs, or a called module's tensors."""
    if node.op == "call_module":
        sub = gm.get_submodule(str(node.target))
        yield from sub.parameters()
        yield from sub.buffers()
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            value = _fetch_attr(gm, str(a.target))
            if isinstance(value, torch.Tensor):
                yield value


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _escaping_bytes(group: _Group) -> int:
    """Bytes of the group's outputs read outside it (by another node or the graph output)."""
    inside = set(group.nodes)
    return sum(
        n.meta["torchplace"].output_bytes for n in group.nodes if any(u not in inside for u in n.users)
    )


def _record(group: _Group, param_bytes: int) -> NodeRecord:
    """The :class:`NodeRecord` of a group. ``temp_bytes`` = all outputs of its fx nodes."""
    out = group.nodes[0].meta["torchplace"].output_bytes if len(group.nodes) == 1 else _escaping_bytes(group)
    temp = sum(n.meta["torchplace"].output_bytes for n in group.nodes)
    return NodeRecord(
        name=group.label, op=group.op, fx_nodes=tuple(n.name for n in group.nodes),
        module=group.module, param_bytes=param_bytes, output_bytes=out, temp_bytes=temp,
    )


def _attribute_params(
    groups: Sequence[_Group], order: Sequence[int], gm: fx.GraphModule
) -> tuple[dict[int, int], set[_Key]]:
    """Bytes of parameters per group, each tensor counted on its first group in ``order``."""
    seen: set[_Key] = set()
    per_group: dict[int, int] = {}
    for i in order:
        total = 0
        for n in groups[i].nodes:
            for t in _params_used(n, gm):
                key = _storage_key(t)
                if key not in seen:
                    seen.add(key)
                    total += key[2]
        per_group[i] = total
    return per_group, seen


def _unattributed_bytes(model: nn.Module, seen: set[_Key]) -> int:
    """Bytes of the model's parameters and buffers that no node reads."""
    keys = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    return sum(k[2] for k in keys - seen)


def _build_opgraph(gm: fx.GraphModule, model: nn.Module, groups: list[_Group], method: str) -> OpGraph:
    """Nodes, edges, parameter attribution and meta of the OpGraph."""
    edges = _group_edges(groups)
    index_graph = nx.DiGraph(edges)
    index_graph.add_nodes_from(range(len(groups)))
    order = list(nx.lexicographical_topological_sort(index_graph, key=lambda i: i))
    params, seen = _attribute_params(groups, order, gm)
    nodes = list(gm.graph.nodes)
    graph = OpGraph(meta={
        "method": method,
        "inputs": [n.name for n in nodes if n.op == "placeholder"],
        "outputs": [a.name for n in nodes if n.op == "output" for a in n.all_input_nodes],
        "unattributed_param_bytes": _unattributed_bytes(model, seen),
    })
    ids = [g.nodes[0].name for g in groups]
    for i, g in enumerate(groups):
        graph.add_node(ids[i], _record(g, params[i]))
    for i, j in sorted(edges):
        graph.add_edge(ids[i], ids[j])
    return graph


def _groups(
    gm: fx.GraphModule, model: nn.Module, leaf_types: tuple[type, ...], module_level: bool, method: str
) -> list[_Group]:
    """fx graphs already have leaves as call_module nodes; exported graphs are grouped by leaf."""
    if method == "fx" or not (module_level or leaf_types):
        return [_singleton(n, gm) for n in gm.graph.nodes if is_compute(n)]
    return _merge_cycles(_group_by_leaf(gm, model, _leaf_predicate(model, leaf_types, module_level)))


def trace(
    model: nn.Module,
    example_inputs: tuple[Any, ...],
    *,
    granularity: str = "operator",
    leaf_modules: Iterable[type] = (),
    method: str = "auto",
) -> Traced:
    """Trace ``model`` into a GraphModule and an :class:`OpGraph` with sizes (no times yet).

    Args:
        model: the module, in the mode it will run in (eval for inference).
        example_inputs: positional arguments of ``model``.
        granularity: ``"operator"``: one node per op, except that ``leaf_modules`` instances stay
            whole; ``"module"``: one node per leaf module, where leaves are ``leaf_modules``
            instances and modules with no children (with fx also fx's standard ``torch.nn``
            leaves). Ops outside every leaf are their own nodes.
        leaf_modules: module classes never traced into.
        method: ``"fx"``, ``"export"`` or ``"auto"`` (fx, falling back to export).

    Returns:
        A :class:`Traced`; each fx node's :class:`TensorInfo` is in ``node.meta["torchplace"]``.

    Raises:
        ValueError: for an unknown ``granularity`` or ``method``.
        TraceError: if no method can capture the model; names the failing module and what to try.

    Example:
        >>> from torchplace.models import build
        >>> model, inputs = build("mlp")
        >>> len(trace(model, inputs).graph) > 0
        True
    """
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    leaf_types, module_level = tuple(leaf_modules), granularity == "module"
    gm, used = _capture(model, tuple(example_inputs), method, leaf_types, module_level)
    _record_shapes(gm, example_inputs)
    groups = _groups(gm, model, leaf_types, module_level, used)
    return Traced(gm=gm, graph=_build_opgraph(gm, model, groups, used), method=used)
