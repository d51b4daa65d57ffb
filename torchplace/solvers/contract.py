"""Contract a training or inference graph into the forward DAG the ideals DP works on.

Tarnawski et al. 2020, App. E.1 ("DP preprocessing"):

1. contract the forward nodes and the backward nodes of every colocation class separately;
2. give every *orphaned* backward group (one whose class has no forward node) an artificial
   forward image;
3. tie the backward edges into the forward graph: for a backward edge ``u' -> v'`` between two
   classes add the forward edge ``image(v') -> image(u')`` (``backward_order="reverse"``, the
   paper's mirror image) or ``image(u') -> image(v')`` (``"forward"``);
4. contract the strongly connected components of the forward graph (a colocation-respecting
   contiguous split keeps each of them on one device), merging their classes, and repeat.

Every forward supernode then carries its backward sibling, so a contiguous set of forward
supernodes places the matching backward nodes with it (Sec. 5.3).

Step 3 is where this differs from the paper, which mirrors only the edges with an orphaned end and
leaves the backward pieces' order to chance: a backward node feeding one of another class in any
other pattern (both ways between two classes, or across the mirror) then gave backward pieces that
feed each other in a cycle. A contiguous training split (:func:`torchplace.plan.check_contiguity`)
runs its backward pieces in the forward pieces' device order or in its reverse; with every
backward edge tied in one orientation, each chain of ideals of the contraction is exactly such a
split with that orientation, so the DP over both contractions (:func:`contractions`) searches
exactly the contiguous splits.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from torchplace.errors import InvalidPlanError
from torchplace.graph import OpGraph

__all__ = ["BACKWARD_ORDERS", "Contraction", "Supernode", "contract", "contractions", "finest_contraction"]

BACKWARD_ORDERS = ("reverse", "forward")
"""How the backward pieces of a contiguous training split run relative to the forward pieces'
device order: reversed (a backward edge mirrors a forward one, as in the OperatorGraphs
workloads) or in the same order (as the LayerGraphs training workloads draw their backward edges)."""


@dataclass(frozen=True)
class Supernode:
    """A forward group and its backward sibling (either may be empty)."""

    forward: tuple[str, ...]
    backward: tuple[str, ...]

    @property
    def members(self) -> tuple[str, ...]:
        return self.forward + self.backward


@dataclass(frozen=True)
class Contraction:
    """Forward supernodes in topological order and the DAG edges between them (by index)."""

    nodes: tuple[Supernode, ...]
    edges: tuple[tuple[int, int], ...]


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[max(ra, rb)] = min(ra, rb)
        return True


def _base_class(g: OpGraph, v: str) -> str:
    c = g.record(v).colocation
    return f"c:{c}" if c is not None else f"n:{v}"


def _check_no_backward_to_forward(g: OpGraph) -> None:
    for u, v in g.edges:
        if g.record(u).backward and not g.record(v).backward:
            raise InvalidPlanError(f"edge {u!r} -> {v!r} goes from a backward node to a forward node")


def _forward_graph(g: OpGraph, cls: _UnionFind, backward_order: str) -> nx.DiGraph:
    """Forward groups (by class), artificial images of orphaned backward groups, the forward edges
    and every backward edge between classes in ``backward_order``'s orientation (steps 2-3)."""
    fg = nx.DiGraph()
    fg.add_nodes_from(cls.find(_base_class(g, v)) for v, r in g.records() if not r.backward)
    orphan = {cls.find(_base_class(g, v)) for v, r in g.records() if r.backward} - set(fg)
    fg.add_nodes_from(sorted(orphan))  # artificial forward images
    for u, v in g.edges:
        cu, cv = cls.find(_base_class(g, u)), cls.find(_base_class(g, v))
        if cu == cv:
            continue
        bu, bv = g.record(u).backward, g.record(v).backward
        if not bu and not bv:
            fg.add_edge(cu, cv)
        elif bu and bv:
            fg.add_edge(*((cv, cu) if backward_order == "reverse" else (cu, cv)))
    return fg


def _identity(g: OpGraph) -> Contraction | None:
    """The contraction of a graph without backward nodes and colocation (every node its own
    supernode, in topological order), in linear time; None for any other graph. It equals what
    the general steps give, which take over ten seconds on 200,000 nodes."""
    if any(r.backward or r.colocation is not None for _, r in g.records()):
        return None
    order = g.topological_order()
    index = {v: i for i, v in enumerate(order)}
    return Contraction(tuple(Supernode((v,), ()) for v in order), tuple(sorted((index[u], index[v]) for u, v in g.edges)))


def contract(g: OpGraph, backward_order: str = "reverse") -> Contraction:
    """Contract ``g`` as in Tarnawski App. E.1; see the module docstring.

    Args:
        g: a DAG with no edge from a backward node to a forward node.
        backward_order: ``"reverse"`` or ``"forward"`` (:data:`BACKWARD_ORDERS`): how the backward
            pieces of the splits the contraction represents run; irrelevant for inference graphs.

    Raises:
        InvalidPlanError: if an edge goes from a backward node to a forward node.
        ValueError: for another ``backward_order``.
    """
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"backward_order must be one of {BACKWARD_ORDERS}, got {backward_order!r}")
    plain = _identity(g)
    if plain is not None:
        return plain
    _check_no_backward_to_forward(g)
    cls = _UnionFind()
    while True:
        fg = _forward_graph(g, cls, backward_order)
        merged = False
        for scc in nx.strongly_connected_components(fg):
            first, *rest = sorted(scc)
            for c in rest:
                merged |= cls.union(first, c)
        if not merged:
            break
    order_index = {v: i for i, v in enumerate(g.topological_order())}
    fw: dict[str, list[str]] = {c: [] for c in fg}
    bw: dict[str, list[str]] = {c: [] for c in fg}
    for v in order_index:
        (bw if g.record(v).backward else fw)[cls.find(_base_class(g, v))].append(v)
    first_pos = {c: min((order_index[v] for v in fw[c] + bw[c]), default=-1) for c in fg}
    order = list(nx.lexicographical_topological_sort(fg, key=lambda c: (first_pos[c], c)))
    index = {c: i for i, c in enumerate(order)}
    nodes = tuple(Supernode(tuple(fw[c]), tuple(bw[c])) for c in order)
    edges = tuple(sorted((index[a], index[b]) for a, b in fg.edges))
    return Contraction(nodes, edges)


def _has_backward_edges_between_classes(g: OpGraph) -> bool:
    return any(g.record(u).backward and g.record(v).backward and _base_class(g, u) != _base_class(g, v)
               for u, v in g.edges)


def contractions(g: OpGraph) -> dict[str, Contraction]:
    """The distinct contractions of ``g``, by backward order (:data:`BACKWARD_ORDERS`).

    One (``"reverse"``) when the orientation changes nothing (no backward edge between classes,
    e.g. an inference graph, or both give the same contraction), else both.

    Raises:
        InvalidPlanError: if an edge goes from a backward node to a forward node.
    """
    first = contract(g, "reverse")
    if not _has_backward_edges_between_classes(g):
        return {"reverse": first}
    second = contract(g, "forward")
    return {"reverse": first} if second == first else {"reverse": first, "forward": second}


def finest_contraction(g: OpGraph) -> tuple[str, Contraction]:
    """The contraction with the most supernodes (ties: ``"reverse"``), with its backward order.

    For searches that work on one contraction (SliceGraph, BRKGA): the other orientation usually
    merges most of the graph into a few supernodes, leaving little to split (a backward edge that
    mirrors a forward path closes a cycle with it).
    """
    options = contractions(g)
    name = max(options, key=lambda k: (len(options[k].nodes), k == "reverse"))
    return name, options[name]
