"""Contiguity in assignment MILPs (Lemma A.1's witness, an order of the devices) and in plans.

A *place* is what a node is assigned to: a device (:mod:`~torchplace.solvers.milp.maxload`) or a
subgraph slot (:mod:`~torchplace.solvers.milp.latency`); ``x(v, p)`` is the 0/1 expression "v is
on p", or the constant 0 where ``v`` cannot go to ``p``.

**Contiguity** (Tarnawski et al. 2020, Def. 3.1: no path leaves a place's set and comes back),
App. A, Lemma A.1: the set ``S = {v : x(v, p) = 1}`` is contiguous iff some ``z[., p]`` in
``[0, 1]`` satisfies

    (11) z[v,p] >= x(v,p)               for every node v
    (12) z[v,p] <= z[u,p]               for every edge (u, v)
    (13) z[v,p] <= x(v,p) - x(u,p) + 1  for every edge (u, v)

(the proof's witness: ``z[v,p]`` = "some node of ``S`` is reachable from ``v``", :func:`reach_values`).
For a training graph the rows go over the forward-induced and the backward-induced subgraph
separately (App. A, "Non-pipelined model-parallel training"; Sec. 5.3): a path between forward
nodes stays forward, one from a backward node stays backward (:func:`side_edges`).

**Ordered contiguity** (what the ideals DP searches: Sec. 5.1.1, Fact 5.2, a chain of ideals whose
differences are the places' sets; Archer et al. 2024, Sec. 2.2, the acyclic quotient graph): the
sets can moreover be ordered so that data only flows forward. Per-place contiguity alone is
weaker: with ``1 -> 4`` and ``2 -> 5``, ``{1, 5}`` and ``{2, 4}`` are contiguous yet feed each
other. :func:`add_device_order` states it per side ``s`` with a tournament ``o[s,i,j]`` for
``i < j`` ("``i`` first") without 3-cycles (``o[i,j] + o[j,l] - o[i,l] <= 1``,
``o[i,l] - o[i,j] - o[j,l] <= 0``; a tournament without 3-cycles has no cycle), which every path
follows: ``before(s,i,j) >= x(v,i) + z[v,j] - 1`` for ``j != i``. That covers every edge ``v -> w``
(``z[v,j] >= z[w,j] >= x(w,j)``) and is tighter in the LP than the edge rule
``o[i,j] >= x(u,i) + x(v,j) - 1`` (BERT-3 operators: 2.4 s against 19 s). The backward order is
not implied by the forward one and colocation: with ``f1 -> f2``, ``f3 -> f4``, ``b1 -> b2``,
``b4 -> b3`` and ``(f_i, b_i)`` colocated, ``{1, 3}`` and ``{2, 4}`` have a forward order but feed
each other backward; so each side has its own ``o``. The two are tied, though: the backward order
is the forward one or its reverse (:func:`torchplace.plan.check_contiguity`, Sec. 5.3, App. E.1:
what the DP searches), one binary ``reverse`` and ``o[b,i,j] = o[f,i,j] XOR reverse``
(:func:`add_device_order`). The order alone already implies per-place contiguity (a path leaving
a set and coming back is a cycle of the quotient); Lemma A.1's ``z`` is there for the LP bound.

**Any assignment as contiguous stages** (Sec. 5.2, "virtual devices"):
:func:`stages_from_assignment` cuts each device's nodes into pieces whose stage order is acyclic.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

import networkx as nx
import pyomo.environ as pyo

from torchplace.errors import InvalidPlanError
from torchplace.plan import Stage
from torchplace.problem import Problem

__all__ = [
    "SIDES", "XFn", "add_device_order", "add_lemma_a1", "device_order", "device_orders", "order_values",
    "reach_values", "reach_var", "side_edges", "side_of", "stages_from_assignment",
]

SIDES = ("forward", "backward")

XFn = Callable[[Any, Any], Any]
"""``x(v, p)``: node ``v``'s 0/1 assignment expression on place ``p``, or the constant 0."""


def side_of(problem: Problem) -> dict[str, str]:
    """Node -> ``"forward"`` or ``"backward"`` (Sec. 5.3).

    Raises:
        InvalidPlanError: if an edge goes from a backward node to a forward node.
    """
    g = problem.graph
    side = {v: SIDES[g.record(v).backward] for v in g}
    if any(side[u] == "backward" and side[v] == "forward" for u, v in g.edges):
        raise InvalidPlanError("an edge goes from a backward node to a forward node; contiguity is undefined")
    return side


def side_edges(problem: Problem, unit_of: Mapping[str, int]) -> dict[str, list[tuple[int, int]]]:
    """Per side with any, the edges between distinct units (``unit_of``: node -> unit) of that
    side's induced subgraph, sorted."""
    g = problem.graph
    out: dict[str, set[tuple[int, int]]] = {}
    for u, v in g.edges:
        backward = g.record(u).backward
        if backward == g.record(v).backward and unit_of[u] != unit_of[v]:
            out.setdefault(SIDES[backward], set()).add((unit_of[u], unit_of[v]))
    return {s: sorted(out[s]) for s in SIDES if s in out}


def _is_zero(expr: object) -> bool:
    return isinstance(expr, (int, float)) and expr == 0


def reach_var(nodes: pyo.Set, places: pyo.Set) -> pyo.Var:
    """``z[v, p]`` in ``[0, 1]``: some node on ``p`` is reachable from ``v`` (Lemma A.1)."""
    return pyo.Var(nodes, places, bounds=(0, 1), doc="contiguity witness of Lemma A.1")


def add_lemma_a1(
    m: pyo.ConcreteModel, *, z: pyo.Var, x: XFn, nodes: pyo.Set, edges: pyo.Set, places: pyo.Set
) -> None:
    """Add Tarnawski App. A, Lemma A.1 (11)-(13) to ``m``: each place's set is contiguous.

    Adds ``m.z_above`` (11) over ``nodes x places`` and ``m.z_down`` (12), ``m.z_cut`` (13) over
    ``edges x places``. Rows that no assignment can violate are skipped: (11) where ``x(v, p)`` is
    the constant 0, (13) where ``x(u, p)`` is the constant 0 or the same variable as ``x(v, p)``
    (``u`` and ``v`` colocated).

    Args:
        m: the model (holds ``z``).
        z: the witness, indexed by ``nodes x places`` (:func:`reach_var`).
        x: ``x(v, p)``, see the module docstring.
        nodes, edges, places: index sets; ``edges`` are the pairs (u, v) that (12), (13) follow
            (every edge, or each side's own for a training graph).
    """
    def above(m: pyo.ConcreteModel, v: Hashable, p: Hashable) -> Any:
        xv = x(v, p)
        return pyo.Constraint.Skip if _is_zero(xv) else z[v, p] >= xv

    def cut(m: pyo.ConcreteModel, u: Hashable, v: Hashable, p: Hashable) -> Any:
        xu, xv = x(u, p), x(v, p)
        return pyo.Constraint.Skip if _is_zero(xu) or xu is xv else z[v, p] <= xv - xu + 1

    m.z_above = pyo.Constraint(nodes, places, rule=above)  # (11)
    m.z_down = pyo.Constraint(edges, places, rule=lambda m, u, v, p: z[v, p] <= z[u, p])  # (12)
    m.z_cut = pyo.Constraint(edges, places, rule=cut)  # (13): a path that left p's set cannot reach it again


def add_device_order(
    m: pyo.ConcreteModel,
    *,
    z: pyo.Var,
    x: XFn,
    sides: Mapping[str, Sequence[tuple[Hashable, Hashable]]],
    sources: Iterable[tuple[str, Hashable]],
    places: Sequence[int],
    fixed: Iterable[tuple[int, int]] = (),
) -> None:
    """Add an order of the places per side that data follows (Fact 5.2; Archer Sec. 2.2).

    Adds the sets ``m.S`` (sides), ``m.PAIR`` (``i < j``), ``m.TRI`` (``i < j < l``), ``m.ORD``;
    the binaries ``m.o[s, i, j]`` (side ``s`` of ``i`` comes before that of ``j``); the rows
    ``m.order_ijl``, ``m.order_ilj`` (no 3-cycle) and ``m.order_reach`` (``v`` on ``i`` reaching
    ``j``'s set puts ``i`` first); ``m.side_edges`` (``sides``) and ``m.order_fixed`` for
    :func:`device_orders` and :func:`order_values`. With both sides, also the binary ``m.reverse``
    (the backward order is the forward one reversed) and the rows ``m.order_same_lo``,
    ``m.order_same_hi``, ``m.order_rev_lo``, ``m.order_rev_hi`` (:func:`_link_sides`). Needs ``z``
    from :func:`add_lemma_a1` over each side's own edges.

    Args:
        m: the model.
        z, x: Lemma A.1's witness and the assignment, see :func:`add_lemma_a1`.
        sides: per side that gets an order, the edges between its units (:func:`side_edges`);
            a side without such edges needs none.
        sources: ``(side, v)`` for each node ``v`` with a successor on its side, in node order.
        places: the places ``0 .. n - 1``.
        fixed: pairs ``(i, j)``, ``i < j``, fixed to ``i`` first on the first side (valid when
            ``i`` and ``j`` are interchangeable: relabel them by their position in the order).
    """
    m.side_edges = dict(sides)
    m.S = pyo.Set(initialize=list(sides))  # sides with edges between units
    m.PAIR = pyo.Set(dimen=2, initialize=list(itertools.combinations(places, 2)))  # places i < j
    m.TRI = pyo.Set(dimen=3, initialize=list(itertools.combinations(places, 3)))  # places i < j < l
    m.ORD = pyo.Set(dimen=4, initialize=[  # (side, node v, place i, place j != i), v may go on i
        (s, v, i, j) for s, v in sources if s in sides
        for i in places for j in places if i != j and not _is_zero(x(v, i))])
    m.o = pyo.Var(m.S, m.PAIR, domain=pyo.Binary)  # side s of place i comes before that of place j

    def before(m: pyo.ConcreteModel, s: str, i: int, j: int) -> Any:
        return m.o[s, i, j] if i < j else 1 - m.o[s, j, i]

    m.order_ijl = pyo.Constraint(  # no cycle i -> j -> l -> i
        m.S, m.TRI, rule=lambda m, s, i, j, l: m.o[s, i, j] + m.o[s, j, l] - m.o[s, i, l] <= 1)
    m.order_ilj = pyo.Constraint(  # no cycle i -> l -> j -> i
        m.S, m.TRI, rule=lambda m, s, i, j, l: m.o[s, i, l] - m.o[s, i, j] - m.o[s, j, l] <= 0)
    m.order_reach = pyo.Constraint(  # v on i reaches j's set, so i comes before j
        m.ORD, rule=lambda m, s, v, i, j: before(m, s, i, j) >= x(v, i) + z[v, j] - 1)
    fixed = list(fixed) if sides else []
    m.order_fixed = bool(fixed)
    for i, j in fixed:
        m.o[m.S.first(), i, j].fix(1)
    if len(m.S) == len(SIDES):
        _link_sides(m)


def _link_sides(m: pyo.ConcreteModel) -> None:
    """The backward order is the forward one (``reverse = 0``) or its reverse (``reverse = 1``):
    ``o[b,i,j] = o[f,i,j] XOR reverse``, four rows per pair (Sec. 5.3, App. E.1; see the module
    docstring)."""
    f, b = SIDES
    m.reverse = pyo.Var(domain=pyo.Binary)  # the backward pieces run in the reverse device order
    m.order_same_lo = pyo.Constraint(m.PAIR, rule=lambda m, i, j: m.o[b, i, j] >= m.o[f, i, j] - m.reverse)
    m.order_same_hi = pyo.Constraint(m.PAIR, rule=lambda m, i, j: m.o[b, i, j] <= m.o[f, i, j] + m.reverse)
    m.order_rev_lo = pyo.Constraint(m.PAIR, rule=lambda m, i, j: m.o[b, i, j] >= m.reverse - m.o[f, i, j])
    m.order_rev_hi = pyo.Constraint(m.PAIR, rule=lambda m, i, j: m.o[b, i, j] <= 2 - m.reverse - m.o[f, i, j])


def reach_values(
    nodes: Sequence[Hashable], edges: Iterable[tuple[Hashable, Hashable]], places: Iterable[Hashable],
    place_of: Mapping[Hashable, Hashable],
) -> dict[tuple[Hashable, Hashable], float]:
    """Lemma A.1's witness for an assignment ("only if" direction): ``z[v, p] = 1`` iff a node on
    ``p`` is reachable from ``v`` along ``edges`` (``nodes`` in topological order)."""
    succ: dict[Hashable, list[Hashable]] = {}
    for u, v in edges:
        succ.setdefault(u, []).append(v)
    places = list(places)
    z: dict[tuple[Hashable, Hashable], float] = {}
    for v in reversed(nodes):
        for p in places:
            z[v, p] = float(place_of[v] == p or any(z[w, p] for w in succ.get(v, ())))
    return z


def device_order(
    edges: Iterable[tuple[int, int]], places: Iterable[int], unit_place: Mapping[int, int]
) -> list[int] | None:
    """The places in a topological order (ties: smallest first) of the quotient graph of ``edges``
    (between units, e.g. ``m.side_edges[side]``) under ``unit_place`` (unit -> place); None if it
    has a cycle (then the assignment is not ordered contiguous)."""
    quotient = nx.DiGraph()
    quotient.add_nodes_from(places)
    quotient.add_edges_from((unit_place[a], unit_place[b]) for a, b in edges if unit_place[a] != unit_place[b])
    if not nx.is_directed_acyclic_graph(quotient):
        return None
    return list(nx.lexicographical_topological_sort(quotient))


def device_orders(
    sides: Mapping[str, Sequence[tuple[int, int]]], places: Iterable[int], unit_place: Mapping[int, int]
) -> dict[str, list[int] | None]:
    """Each side's place order (:func:`device_order`) under the rows of :func:`add_device_order`:
    with both sides, one order that the forward edges follow and the backward edges all follow or
    all go against (tried in that order); None for a side (both sides) without one."""
    places = list(places)
    if len(sides) < len(SIDES):
        return {s: device_order(edges, places, unit_place) for s, edges in sides.items()}
    f, b = SIDES
    for reverse in (False, True):
        backward = [(w, v) if reverse else (v, w) for v, w in sides[b]]
        order = device_order([*sides[f], *backward], places, unit_place)
        if order is not None:
            return {f: order, b: order[::-1] if reverse else order}
    return {f: None, b: None}


def order_values(m: pyo.ConcreteModel, orders: Mapping[str, Sequence[int] | None]) -> None:
    """Set ``m.o`` (not the fixed entries) to follow ``orders`` (side -> places in order, from
    :func:`device_orders`; None: leave that side unset), and ``m.reverse`` where there is one."""
    f, b = SIDES
    if hasattr(m, "reverse") and orders.get(f) is not None and orders.get(b) is not None:
        m.reverse.value = float(list(orders[f]) != list(orders[b]))
    for s, order in orders.items():
        if order is None:
            continue
        pos = {p: k for k, p in enumerate(order)}
        for i, j in m.PAIR:
            if not m.o[s, i, j].fixed:
                m.o[s, i, j].value = float(pos[i] < pos[j])


def stages_from_assignment(problem: Problem, assignment: Mapping[str, str]) -> list[Stage]:
    """Cut each device's nodes into stages whose order sends every edge forward (Sec. 5.2).

    Forward and backward nodes go to separate stages. Repeatedly, for each (device, part) the
    largest *ready* piece is its unplaced nodes whose unplaced ancestors are all in the piece
    (found in one topological walk); a piece that is all of its (device, part) is taken first,
    else the largest piece (ties: the earliest node). When the (device, part) sets have an acyclic
    quotient graph (every contiguous split from the DP or :mod:`~torchplace.solvers.milp.mtpp`)
    this gives one stage each; otherwise a set is cut where it must wait for another device.
    """
    g = problem.graph
    order = g.topological_order()
    pos = {v: i for i, v in enumerate(order)}
    remaining: dict[tuple[str, bool], list[str]] = {}
    for v in order:
        remaining.setdefault((assignment[v], g.record(v).backward), []).append(v)
    placed: set[str] = set()
    stages: list[Stage] = []
    while remaining:
        best: tuple[tuple[int, int], tuple[str, bool], list[str]] | None = None
        for key, todo in remaining.items():
            piece: set[str] = set()
            for v in todo:
                if all(u in placed or u in piece for u in g.predecessors(v)):
                    piece.add(v)
            if piece:
                ready = [v for v in todo if v in piece]
                rank = (int(len(ready) == len(todo)), len(ready))
                if best is None or (rank, -pos[ready[0]]) > (best[0], -pos[best[2][0]]):
                    best = (rank, key, ready)
        assert best is not None, "the earliest unplaced node is always ready"
        _, key, ready = best
        stages.append(Stage(key[0], tuple(ready)))
        placed.update(ready)
        remaining[key] = [v for v in remaining[key] if v not in placed]
        if not remaining[key]:
            del remaining[key]
    return stages
