"""Build the :class:`OpGraph` of a traced GraphModule: grouping, edges, sizes, parameters.

One OpGraph node per compute fx node, or per group of them: at module granularity an exported
graph's aten nodes are grouped per leaf-module instance (from ``node.meta["nn_module_stack"]``),
and groups on a common cycle are merged so the OpGraph stays a DAG. Node ids are the name of the
node's first fx node. Each parameter/buffer is counted once (by storage, so tied weights count
once) on the first node in topological order that reads it, and listed with every node that reads
it (:mod:`torchplace.profiling.tensors`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import torch
from torch import fx, nn

from torchplace.fxutil import is_compute
from torchplace.graph import NodeRecord, OpGraph
from torchplace.profiling.effects import Effects
from torchplace.profiling.tensors import owned_bytes, state_meta, tensor_uses

__all__ = ["build_opgraph"]


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
_Before = Mapping[fx.Node, Sequence[fx.Node]]
"""fx node -> nodes that must run before it without it reading them (in-place ordering edges)."""


def _group_edges(groups: Sequence[_Group], before: _Before) -> set[tuple[int, int]]:
    """Index pairs (i, j): some node of group j uses a node of group i, or must run after one."""
    owner = {n: i for i, g in enumerate(groups) for n in g.nodes}
    edges: set[tuple[int, int]] = set()
    for j, g in enumerate(groups):
        for n in g.nodes:
            for a in (*n.all_input_nodes, *before.get(n, ())):
                if a in owner and owner[a] != j:
                    edges.add((owner[a], j))
    return edges


def _merge_cycles(groups: list[_Group], before: _Before) -> list[_Group]:
    """Merge groups on a common cycle (strongly connected components) so the group graph is a DAG."""
    g = nx.DiGraph(_group_edges(groups, before))
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


def _escaping_bytes(group: _Group) -> int:
    """Bytes of the group's outputs read outside it (by another node or the graph output)."""
    inside = set(group.nodes)
    return sum(
        n.meta["torchplace"].output_bytes for n in group.nodes if any(u not in inside for u in n.users)
    )


def _roots(group: _Group) -> dict[fx.Node, fx.Node]:
    """Each fx node of the group -> the node whose memory it lives in: itself, or for a view
    (``TensorInfo.alias_of``) of a node of the group, that node's root."""
    by_name = {n.name: n for n in group.nodes}
    root: dict[fx.Node, fx.Node] = {}
    for n in group.nodes:  # graph order: a view's base has its root already
        base = by_name.get(n.meta["torchplace"].alias_of or "")
        root[n] = root[base] if base is not None else n
    return root


def _own_peak(group: _Group) -> tuple[int, dict[str, int]]:
    """(peak, resident parts): the most bytes of new memory the group's fx nodes hold at once
    while it runs (in graph order; a node's kernel scratch, ``scratch_bytes``, while it runs), and
    the new memory its outputs keep alive after it, by the fx node that made each memory
    (:func:`_roots`; an output that views memory made outside the group is a part of 0 bytes, so
    that its readers can be told from readers of a size). A view
    takes no new memory but keeps its base's alive; a memory lives from the node that made it
    until the last reader of it or of any view of it in the group, or to the group's end when
    something outside reads one of them."""
    inside = set(group.nodes)
    index = {n: i for i, n in enumerate(group.nodes)}
    end = len(group.nodes)
    root = _roots(group)
    last: dict[fx.Node, int] = {}
    for n in group.nodes:
        use = end if any(u not in inside for u in n.users) else max((index[u] for u in n.users if u in inside), default=-1)
        last[root[n]] = max(last.get(root[n], -1), use)
    frees: dict[int, int] = {}
    resident: dict[str, int] = {}
    live = peak = 0
    for i, n in enumerate(group.nodes):
        size = n.meta["torchplace"].new_bytes
        peak = max(peak, live + size + n.meta["torchplace"].scratch_bytes)
        if root[n] is n and last[n] > i:
            live += size
            frees[last[n]] = frees.get(last[n], 0) + size
            if last[n] == end and (size or n.meta["torchplace"].output_bytes):  # a view of outside memory: 0
                resident[n.name] = size
        live -= frees.pop(i, 0)
    return peak, resident


def _reads(group: _Group, roots: Mapping[fx.Node, fx.Node]) -> tuple[str, ...]:
    """The memories of other groups ``group`` reads: the roots (``roots``, every group's
    :func:`_roots`) of its fx nodes' inputs made outside it, by name."""
    inside = set(group.nodes)
    return tuple(sorted({roots[a].name for n in group.nodes for a in n.all_input_nodes if a not in inside and a in roots}))


def _views(groups: Sequence[_Group]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """Which groups' outputs view another group's output, for
    :func:`torchplace.costmodel.working_memory` to keep the viewed memory alive for their readers:

    - ``aliases`` ``{node id: node id}``: every output of the group (a view, or a module that only
      reshapes its input) views that one node;
    - ``part_aliases`` ``{node id: {part: node id}}``: some outputs do, each a part of 0 bytes
      (:func:`_own_peak`) beside the group's own memories.

    Outputs that hold no bytes (sizes) do not count.
    """
    owner = {n.name: g.nodes[0].name for g in groups for n in g.nodes}
    aliases: dict[str, str] = {}
    parts: dict[str, dict[str, str]] = {}
    for g in groups:
        me, inside, roots = g.nodes[0].name, set(g.nodes), _roots(g)
        escaping = [n for n in g.nodes if n.meta["torchplace"].output_bytes and any(u not in inside for u in n.users)]
        bases = {roots[n].name: owner.get(roots[n].meta["torchplace"].alias_of or "") for n in escaping}
        viewed = set(bases.values())
        if len(viewed) == 1 and None not in viewed and me not in viewed:
            aliases[me] = viewed.pop()  # type: ignore[assignment]
        elif len(g.nodes) > 1:
            views = {part: base for part, base in bases.items() if base is not None and base != me}
            if views:
                parts[me] = views
    return aliases, parts


def _record(group: _Group, param_bytes: int, colocation: str | None, reads: tuple[str, ...]) -> NodeRecord:
    """The :class:`NodeRecord` of a group. ``temp_bytes`` = all outputs of its fx nodes and their
    kernels' scratch (so never below the peak);
    ``peak_bytes`` = the most of them alive at once, ``resident_bytes`` = the new memory its
    outputs keep (:func:`_own_peak`), by part where they are several memories."""
    out = group.nodes[0].meta["torchplace"].output_bytes if len(group.nodes) == 1 else _escaping_bytes(group)
    temp = sum(n.meta["torchplace"].output_bytes + n.meta["torchplace"].scratch_bytes for n in group.nodes)
    peak, resident = _own_peak(group)
    return NodeRecord(
        name=group.label, op=group.op, fx_nodes=tuple(n.name for n in group.nodes),
        module=group.module, param_bytes=param_bytes, output_bytes=out, temp_bytes=temp, colocation=colocation,
        peak_bytes=peak, resident_bytes=sum(resident.values()),
        resident_parts=resident if len(group.nodes) > 1 else {}, reads=reads,
    )


def _build_opgraph(gm: fx.GraphModule, model: nn.Module, groups: list[_Group], method: str,
                   before: _Before, colocation: Mapping[int, str]) -> OpGraph:
    """Nodes, edges (data and in-place ordering), parameter attribution and meta of the OpGraph."""
    edges = _group_edges(groups, before)
    index_graph = nx.DiGraph(edges)
    index_graph.add_nodes_from(range(len(groups)))
    order = list(nx.lexicographical_topological_sort(index_graph, key=lambda i: i))
    uses = tensor_uses([g.nodes for g in groups], order, gm, model)
    params = owned_bytes(uses, len(groups))
    ids = [g.nodes[0].name for g in groups]
    nodes = list(gm.graph.nodes)
    views = _views(groups)
    graph = OpGraph(meta={
        "method": method,
        "inputs": [n.name for n in nodes if n.op == "placeholder"],
        "outputs": [a.name for n in nodes if n.op == "output" for a in n.all_input_nodes],
        "state": state_meta(uses, ids),
        "liveness": True,
        "aliases": views[0],
        "part_aliases": views[1],
    })
    roots = {n: r for g in groups for n, r in _roots(g).items()}
    for i, g in enumerate(groups):
        graph.add_node(ids[i], _record(g, params[i], colocation.get(i), _reads(g, roots)))
    for i, j in sorted(edges):
        graph.add_edge(ids[i], ids[j])
    return graph


def _groups(
    gm: fx.GraphModule, model: nn.Module, leaf_types: tuple[type, ...], module_level: bool, method: str,
    effects: Effects, before: _Before,
) -> list[_Group]:
    """fx graphs already have leaves as call_module nodes; exported graphs are grouped by leaf.
    Accessors of written state become one group; then shape-only computations and dead-end checks
    are folded into their neighbours."""
    if method == "fx" or not (module_level or leaf_types):
        groups = [_singleton(n, gm) for n in gm.graph.nodes if is_compute(n)]
    else:
        groups = _group_by_leaf(gm, model, _leaf_predicate(model, leaf_types, module_level))
    groups = _merge_cycles(_merge_sets(groups, effects.merged, gm), before)
    return _fold_into_neighbours(groups, before)


def _merge_sets(groups: list[_Group], sets: Sequence[frozenset[str]], gm: fx.GraphModule) -> list[_Group]:
    """Merge every group that holds a member of one of ``sets`` into one group per set (overlapping
    sets together). Merging can close cycles through other groups; :func:`_merge_cycles` follows."""
    if not sets:
        return groups
    owner = {n.name: i for i, g in enumerate(groups) for n in g.nodes}
    links = nx.Graph()
    links.add_nodes_from(range(len(groups)))
    for members in sets:
        idx = sorted({owner[m] for m in members if m in owner})
        links.add_edges_from(zip(idx, idx[1:]))
    position = {n: k for k, n in enumerate(gm.graph.nodes)}
    merged = []
    for comp in nx.connected_components(links):
        parts = [groups[i] for i in sorted(comp)]
        if len(parts) == 1:
            merged.append(parts[0])
            continue
        nodes = tuple(sorted((n for p in parts for n in p.nodes), key=position.__getitem__))
        merged.append(_Group(nodes, "+".join(p.label for p in parts), parts[0].module, "group:" + "+".join(p.op for p in parts)))
    return sorted(merged, key=lambda grp: position[grp.nodes[0]])


def _colocation(groups: Sequence[_Group], effects: Effects) -> dict[int, str]:
    """Group index -> colocation label: groups holding members of one colocated set (or of
    overlapping sets) share a device (:mod:`torchplace.profiling.effects`)."""
    owner = {n.name: i for i, g in enumerate(groups) for n in g.nodes}
    links = nx.Graph()
    for members in effects.colocated:
        idx = sorted({owner[m] for m in members if m in owner})
        links.add_nodes_from(idx)
        links.add_edges_from(zip(idx, idx[1:]))
    labels: dict[int, str] = {}
    for comp in nx.connected_components(links):
        if len(comp) > 1:
            first = min(comp)
            labels.update({i: f"inplace:{groups[first].nodes[0].name}" for i in comp})
    return labels


# -- folding ------------------------------------------------------------------------------------
def _returns_tensor(node: fx.Node) -> bool:
    info = node.meta.get("torchplace")
    return info is not None and len(info.shapes) > 0


def _data_dependent(graph: fx.Graph) -> set[fx.Node]:
    """fx nodes whose tensor output depends on the values of the model's inputs (not only shapes)."""
    dependent: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or is_compute(n):
            reads_data = n.op == "placeholder" or any(a in dependent for a in n.all_input_nodes)
            if reads_data and _returns_tensor(n):
                dependent.add(n)
    return dependent


def _fold_roots(groups: Sequence[_Group], dependent: set[fx.Node], before: _Before) -> list[int]:
    """For each group, the index of the group it is folded into (itself if kept).

    Groups are visited in a topological order ``pos``; every kept group is a *root*.

    1. Forward: a group nobody consumes that feeds no model output (export's guards and metadata
       asserts) joins its last producer; one without producers joins the first group.
    2. Backward (reverse topological order): a group that computes only from shapes and constants
       (attention masks, position ids) joins the earliest root among its consumers.
    3. See :func:`_fold_isolated`.

    Every edge then goes from a root of smaller ``pos`` to one of larger ``pos``, so the folded
    graph is still a DAG: a folded group picked the earliest of its consumers' roots, and the
    roots it could reach later all come after it.
    """
    edges = _group_edges(groups, before)
    g = nx.DiGraph(edges)
    g.add_nodes_from(range(len(groups)))
    order = list(nx.lexicographical_topological_sort(g, key=lambda i: i))
    pos = {v: k for k, v in enumerate(order)}
    parent = list(range(len(groups)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    outputs = {a for n in groups[0].nodes[0].graph.nodes if n.op == "output" for a in n.all_input_nodes}
    for i in order:
        if g.out_degree(i) == 0 and not any(n in outputs for n in groups[i].nodes) and len(groups) > 1:
            preds = [find(p) for p in g.predecessors(i)]
            parent[i] = max(preds, key=pos.__getitem__) if preds else find(order[0] if order[0] != i else order[1])
    for i in reversed(order):
        if parent[i] == i and g.out_degree(i) and not any(n in dependent for n in groups[i].nodes):
            roots = {find(c) for c in g.successors(i)} - {i}
            if roots:
                parent[i] = min(roots, key=pos.__getitem__)
    _fold_isolated(g, order, find, parent, outputs, groups)
    return [find(i) for i in range(len(groups))]


def _fold_isolated(g: nx.DiGraph, order: list[int], find: Callable[[int], int], parent: list[int],
                   outputs: set[fx.Node], groups: Sequence[_Group]) -> None:
    """3. A root with no edge to any other root (a shape-only chain that ends in an assert) joins
    the first root: with no edges it cannot close a cycle, and alone it would double the ideals."""
    linked = {find(i) for u, v in g.edges if find(u) != find(v) for i in (u, v)}
    roots = [i for i in order if find(i) == i]
    for r in roots[1:]:
        if r not in linked and not any(n in outputs for i in range(len(groups)) if find(i) == r for n in groups[i].nodes):
            parent[r] = roots[0]


def _fold_into_neighbours(groups: list[_Group], before: _Before) -> list[_Group]:
    """Merge shape-only and dead-end groups into a neighbour (see :func:`_fold_roots`).

    These nodes cost next to nothing, but each independent one multiplies the number of ideals
    (contiguous splits) the exact solver must consider; GPT-2's mask computation alone makes
    tens of thousands. The kept group gives the merged node its label, module and op.
    """
    if len(groups) < 2:
        return groups
    roots = _fold_roots(groups, _data_dependent(groups[0].nodes[0].graph), before)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(roots):
        members.setdefault(r, []).append(i)
    position = {n: k for k, n in enumerate(groups[0].nodes[0].graph.nodes)}
    merged = []
    for r, parts in members.items():
        nodes = tuple(sorted((n for i in parts for n in groups[i].nodes), key=position.__getitem__))
        merged.append(_Group(nodes, groups[r].label, groups[r].module, groups[r].op))
    return sorted(merged, key=lambda grp: position[grp.nodes[0]])


def build_opgraph(
    gm: fx.GraphModule,
    model: nn.Module,
    *,
    leaf_types: tuple[type, ...] = (),
    module_level: bool = False,
    method: str = "fx",
    effects: Effects | None = None,
) -> OpGraph:
    """The OpGraph of ``gm``, whose nodes carry ``meta["torchplace"]`` (a ``TensorInfo``).

    Args:
        gm: the traced module (after shape recording).
        model: the original model (for module classes, children and its parameters).
        leaf_types: module classes kept whole.
        module_level: whether childless modules are leaves too (module granularity).
        method: ``"fx"`` (leaves are already ``call_module`` nodes) or ``"export"`` (grouped here).
        effects: the graph's in-place writes: their ordering edges become edges, accessors of
            written state one node, and colocated accessors share a ``colocation`` label.

    Returns:
        The OpGraph; ``meta`` holds ``method``, ``inputs``, ``outputs`` (fx node names) and
        ``state`` (each parameter, buffer and constant: names, bytes, owner and readers,
        :mod:`torchplace.profiling.tensors`).
    """
    effects = effects or Effects()
    by_name = {n.name: n for n in gm.graph.nodes}
    before = {by_name[v]: [by_name[u] for u in sorted(us)] for v, us in effects.after.items()}
    groups = _groups(gm, model, leaf_types, module_level, method, effects, before)
    return _build_opgraph(gm, model, groups, method, before, _colocation(groups, effects))
