"""Safe contractions of the DP's supernode DAG: fewer supernodes, the same optimum (issue 16).

Zero-cost structure (views, reshapes, getitems, a training graph's bookkeeping nodes) multiplies
a DAG's ideals without changing what a split costs. Three rules shrink the contraction
(:mod:`torchplace.solvers.contract`) before the ideals DP, each applied while any applies (a
fixpoint). Each keeps the optimum over contiguous splits *exactly*: from any split of the larger
graph a split of the smaller one costs no more on every device (so the optimum cannot rise),
and every split of the smaller one maps back to a split of the larger one with the same cost on
every device (so it cannot fall). Plans are mapped back to the original nodes with
:meth:`Reduced.expand`, then costed and validated like any plan (``Plan.build``), and the DP
asserts that the cost model agrees with its value.

Notation. A supernode is a set of graph nodes (forward and backward siblings, Tarnawski App. E.1).
``c_u`` is the transfer time of ``u``'s output (paid once per side when some consumer of ``u``
is on another device that pays transfers, :mod:`torchplace.costmodel`). A *crossing edge* of a
supernode ``V`` is a graph edge with exactly one end in ``V``; edges into eliminated free nodes
(rule 3) are zero-cost and ignored. ``kinds(M)`` are the device kinds every member of ``M`` can
run on. A supernode is *weightless* when its members have no parameter or working bytes and touch
no shared tensor, or when memory can never bind (the whole graph fits the smallest memory
limit); moving it then never raises a device's memory.

The rules need no training :class:`~torchplace.problem.Pipeline` (whose memory depends on pipeline
positions and recomputation); the DP applies them only without one.

1. **Leaf merge** (:func:`_leaf_target`): merge ``N`` into ``M`` when ``M`` is ``N``'s only
   neighbour in the DAG, every crossing edge of ``N`` ends in ``M``, every member of ``N`` takes
   zero time on every kind in ``kinds(M)``, and ``N`` is weightless.
   *Proof.* Take any split with ``N`` on device ``A`` and ``M`` on ``B != A``; move ``N`` to
   ``B``. ``A`` loses ``N``: its compute does not rise (times are non-negative); it no longer
   pays ``N``'s outputs (their consumers are in ``M``, off ``A``), and the outputs of ``M`` it
   reads it may stop reading; nothing of ``A`` reads or is read by ``N`` otherwise, so no term
   appears. ``B`` gains ``N``: compute ``+0``; ``N`` reads only from and feeds only ``M``, so no
   transfer appears and ``M``'s outputs to ``N`` stop crossing. Other devices see no edge of
   ``N``. Memory: ``N`` is weightless. Contiguity: ``N``'s only neighbour is ``M``, so no path
   passes through ``N`` (it would enter and leave through ``M``, a cycle), so removing ``N``
   keeps ``A``'s piece convex, and ``N`` joins ``M``'s piece as a source or a sink of it. So an
   optimal split exists with ``N`` beside ``M``: exactly the splits of the merged DAG.
2. **Chain merge** (:func:`_chain_target`): merge ``V`` into ``U`` when, in the DAG, ``U -> V``,
   ``U`` is ``V``'s only predecessor and ``V`` is ``U``'s only successor; every crossing edge into
   ``V`` starts in ``U`` and every crossing edge out of ``U`` ends in ``V``; ``V`` takes zero time
   on ``kinds(U)`` and is weightless; and ``out(V) <= out(U)``, where ``out(V)`` sums ``c_y`` over
   members of ``V`` with a consumer outside ``V`` and ``out(U)`` sums ``c_x`` over members of
   ``U`` feeding ``V``.
   *Proof.* Split with ``U`` on ``B``, ``V`` on ``A != B``; move ``V`` to ``B``. ``A`` stops
   reading ``U``'s outputs (they feed nothing outside ``U`` but ``V``): ``-out(U)``; it may now
   read ``V``'s outputs: ``+ <= out(V)``; it stops paying ``V``'s outputs; no other node of ``A``
   feeds ``V``. ``B``: compute ``+0``; ``U``'s outputs to ``V`` stop crossing: ``-out(U)``;
   ``V``'s outputs may cross: ``+ <= out(V)``; ``V`` reads only from ``U``. Other devices read
   ``V``'s outputs exactly as before and feed nothing into ``V``. So no load rises (a CPU pays no
   transfers at all). Contiguity: a new cycle through ``V``, or a path from ``A``'s rest through
   ``V`` back to it, would enter ``V`` from ``U`` and so give a cycle ``B -> A -> ... -> B`` in the
   old quotient. The cost condition is needed: a cheap producer feeding a free node with a costly
   output is better cut before the free node.
3. **Free-node elimination** (:func:`_is_free`): delete ``N`` when its members take zero time on
   every device kind of the cluster, it is weightless, and every crossing edge has a zero-cost
   producer; connect its DAG predecessors to its successors. Map back: ``N`` joins the piece of
   its latest predecessor (in the chain's order of pieces), else of its earliest successor.
   *Proof.* ``N`` adds nothing to any load or memory wherever it is: no compute, no bytes, and
   every transfer through its boundary is free (a producer outside ``N`` feeding it pays nothing,
   and so do ``N``'s outputs). A split of the graph restricted to the rest is contiguous in the
   rest with the new edges (each new edge ``p -> s`` is the path ``p -> N -> s``, so a cycle of
   the new quotient is a closed walk in the old one) and costs the same. Conversely, placing ``N``
   with its latest predecessor ``p*`` keeps the pieces' order topological: its inputs come from
   pieces no later than ``p*``'s, and each successor ``s`` has the edge ``p* -> s``, so is no
   earlier.

The authors' C++ merges every zero-cost node into a neighbour, ignoring memory, unsupported
kinds, backward edges and the cost condition of rule 2; tests/test_reduce.py shows instances
where each dropped condition changes the optimum.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchplace.problem import Problem
from torchplace.solvers.contract import Contraction, Supernode

__all__ = ["Reduced", "reduce_contraction"]


@dataclass(frozen=True)
class Reduced:
    """A reduced contraction and how to map its splits back.

    Attributes:
        con: the reduced contraction (topological order kept) that the DP runs on.
        original: the contraction it came from.
        groups: per supernode of ``con``, the indices of ``original``'s supernodes it holds.
        freed: eliminated supernodes in elimination order: ``(group, predecessors, successors)``,
            where the neighbours are indices of ``original`` standing for their groups then.
    """

    con: Contraction
    original: Contraction
    groups: tuple[tuple[int, ...], ...]
    freed: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    def expand(self, pieces: Sequence[Sequence[int]]) -> list[list[int]]:
        """Pieces over ``con`` (first to last in the chain's order) as pieces over ``original``."""
        piece_of: dict[int, int] = {}
        for p, supers in enumerate(pieces):
            for i in supers:
                piece_of.update((j, p) for j in self.groups[i])
        for group, preds, succs in reversed(self.freed):
            if preds:
                p = max(piece_of[j] for j in preds)
            else:
                p = min((piece_of[j] for j in succs), default=0)
            piece_of.update((j, p) for j in group)
        out: list[list[int]] = [[] for _ in pieces]
        for j in sorted(piece_of):
            out[piece_of[j]].append(j)
        return out


class _State:
    """The DAG being reduced: live groups by representative (an index of the original), their
    members, DAG neighbours, and the graph facts the rules read."""

    def __init__(self, problem: Problem, con: Contraction):
        self.problem, self.g = problem, problem.graph
        self.members = {i: list(s.members) for i, s in enumerate(con.nodes)}
        self.group = {i: [i] for i in range(len(con.nodes))}
        self.owner = {v: i for i, s in enumerate(con.nodes) for v in s.members}  # node -> live rep
        self.preds: dict[int, set[int]] = {i: set() for i in self.group}
        self.succs: dict[int, set[int]] = {i: set() for i in self.group}
        for u, v in con.edges:
            self.succs[u].add(v)
            self.preds[v].add(u)
        self.kinds = {d.kind for d in problem.cluster.devices}
        shared = {v for t in self.g.shared_tensors() for v in (t.owner, *t.readers)}
        roomy = _memory_never_binds(problem)
        self.weightless_node = {v: roomy or (r.param_bytes == 0 and r.temp_bytes == 0 and v not in shared)
                                for v, r in self.g.records()}
        self.freed: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []

    # -- facts -----------------------------------------------------------------------------
    def crossing(self, i: int) -> list[tuple[str, str]]:
        """Graph edges with exactly one end in group ``i`` and the other in a live group."""
        out = []
        for v in self.members[i]:
            out += [(u, v) for u in self.g.predecessors(v) if self.owner.get(u, i) != i]
            out += [(v, w) for w in self.g.successors(v) if self.owner.get(w, i) != i]
        return out

    def runs_on(self, i: int) -> set[str]:
        return {k for k in self.kinds if all(self.g.record(v).time_on(k) < math.inf for v in self.members[i])}

    def zero_time_on(self, i: int, kinds: set[str]) -> bool:
        return all(self.g.record(v).time_on(k) == 0.0 for v in self.members[i] for k in kinds)

    def weightless(self, i: int) -> bool:
        return all(self.weightless_node[v] for v in self.members[i])

    def cost(self, u: str) -> float:
        return self.problem.transfer_time(u)

    # -- changes ---------------------------------------------------------------------------
    def merge(self, n: int, m: int) -> None:
        """Merge group ``n`` into group ``m`` (DAG edges between them vanish)."""
        for v in self.members[n]:
            self.owner[v] = m
        self.members[m] += self.members.pop(n)
        self.group[m] += self.group.pop(n)
        for p in self.preds.pop(n):
            self.succs[p].discard(n)
            if p != m:
                self.succs[p].add(m)
                self.preds[m].add(p)
        for s in self.succs.pop(n):
            self.preds[s].discard(n)
            if s != m:
                self.preds[s].add(m)
                self.succs[m].add(s)

    def eliminate(self, n: int) -> None:
        """Delete free group ``n``, joining its DAG predecessors to its successors."""
        preds, succs = self.preds.pop(n), self.succs.pop(n)
        for p in preds:
            self.succs[p].discard(n)
            self.succs[p] |= succs
        for s in succs:
            self.preds[s].discard(n)
            self.preds[s] |= preds
        for v in self.members.pop(n):
            del self.owner[v]
        self.freed.append((tuple(self.group.pop(n)), tuple(sorted(preds)), tuple(sorted(succs))))


def _memory_never_binds(problem: Problem) -> bool:
    """Whether every set of nodes fits every device: all parameter, working and shared bytes
    together fit the smallest memory limit (no limit: always)."""
    limits = [d.memory_bytes for d in problem.cluster.devices if d.memory_bytes is not None]
    if not limits:
        return True
    g = problem.graph
    total = sum(r.param_bytes + r.temp_bytes for _, r in g.records()) + sum(t.nbytes for t in g.shared_tensors())
    return total <= min(limits)


def _leaf_target(s: _State, n: int) -> int | None:
    """Rule 1: the group ``n`` merges into, or None."""
    neighbours = s.preds[n] | s.succs[n]
    if len(neighbours) != 1:
        return None
    (m,) = neighbours
    if not _touches_only(s, n, m) or not s.weightless(n) or not s.zero_time_on(n, s.runs_on(m)):
        return None
    return m


def _touches_only(s: _State, n: int, m: int) -> bool:
    """Whether every crossing edge of group ``n`` ends in group ``m``."""
    return all(s.owner[x] in (n, m) for e in s.crossing(n) for x in e)


def _chain_target(s: _State, v: int) -> int | None:
    """Rule 2: the group ``v`` merges into (its only predecessor ``u``), or None."""
    if len(s.preds[v]) != 1:
        return None
    (u,) = s.preds[v]
    if s.succs[u] != {v} or not s.weightless(v) or not s.zero_time_on(v, s.runs_on(u)):
        return None
    if not _feeds_only(s, u, v) or not _chain_pays_off(s, u, v):
        return None
    return u


def _feeds_only(s: _State, u: int, v: int) -> bool:
    """Whether every crossing edge into ``v`` starts in ``u`` and every one out of ``u`` ends in ``v``."""
    into_v = all(s.owner[a] == u for a, b in s.crossing(v) if s.owner[b] == v)
    return into_v and all(s.owner[b] == v for a, b in s.crossing(u) if s.owner[a] == u)


def _chain_pays_off(s: _State, u: int, v: int) -> bool:
    """``out(V) <= out(U)``: what ``V``'s outputs may cost across is at most what cutting before
    ``V`` costs (rule 2)."""
    out_v = math.fsum(s.cost(y) for y in sorted({a for a, _ in s.crossing(v) if s.owner[a] == v}))
    out_u = math.fsum(s.cost(x) for x in sorted({a for a, _ in s.crossing(u) if s.owner[a] == u}))
    return out_v <= out_u


def _is_free(s: _State, n: int) -> bool:
    """Rule 3: whether group ``n`` can be eliminated."""
    return s.weightless(n) and s.zero_time_on(n, s.kinds) and _crossing_is_free(s, n)


def _crossing_is_free(s: _State, n: int) -> bool:
    """Whether every crossing edge of group ``n`` has a zero-cost producer."""
    return all(s.cost(u) == 0.0 for u, _ in s.crossing(n))


def reduce_contraction(problem: Problem, con: Contraction, tick: Callable[[], None] = lambda: None) -> Reduced:
    """Apply the three rules of the module docstring to ``con`` until none applies.

    Supernodes are visited in topological order, again after any change near them, so the result
    is deterministic. The last live supernode is never eliminated.

    Args:
        problem: a throughput problem without a training pipeline (the rules' proofs assume the
            cost model without one).
        con: a contraction of ``problem.graph`` (:func:`~torchplace.solvers.contract.contractions`).
        tick: called once per supernode visited (a time limit's check); what it raises propagates.

    Returns:
        The reduced contraction and the map back (:class:`Reduced`).
    """
    if not any(0.0 in r.times.values() for _, r in problem.graph.records()):
        # every rule moves or drops only nodes with zero time somewhere: nothing to do (and a
        # 200,000-node graph is not walked for nothing)
        return Reduced(con, con, tuple((i,) for i in range(len(con.nodes))), ())
    s = _State(problem, con)
    work = list(range(len(con.nodes)))[::-1]  # a stack: pops in topological order
    queued = set(work)
    while work:
        tick()
        n = work.pop()
        queued.discard(n)
        if n not in s.group:
            continue
        around = s.preds[n] | s.succs[n]
        target = _leaf_target(s, n)
        if target is None:
            target = _chain_target(s, n)
        if target is not None:
            s.merge(n, target)
            touched = {target} | around
        elif len(s.group) > 1 and _is_free(s, n):
            s.eliminate(n)
            touched = around
        else:
            continue
        for t in sorted(touched - queued, reverse=True):
            if t in s.group:
                work.append(t)
                queued.add(t)
    return _rebuild(con, s)


def _rebuild(con: Contraction, s: _State) -> Reduced:
    """The reduced contraction, its groups in a topological order (ties: first original index)."""
    key = {r: min(g) for r, g in s.group.items()}
    indegree = {r: len(s.preds[r]) for r in s.group}
    ready = [(key[r], r) for r in s.group if indegree[r] == 0]
    heapq.heapify(ready)
    reps: list[int] = []
    while ready:
        _, r = heapq.heappop(ready)
        reps.append(r)
        for t in s.succs[r]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, (key[t], t))
    if len(reps) != len(s.group):
        raise AssertionError("reducing the contraction made a cycle")  # pragma: no cover - proofs above
    index = {r: i for i, r in enumerate(reps)}
    nodes = []
    for r in reps:
        ids = sorted(s.group[r])
        nodes.append(Supernode(tuple(v for j in ids for v in con.nodes[j].forward),
                               tuple(v for j in ids for v in con.nodes[j].backward)))
    edges = tuple(sorted((index[a], index[b]) for a in reps for b in s.succs[a]))
    groups = tuple(tuple(sorted(s.group[r])) for r in reps)
    return Reduced(Contraction(tuple(nodes), edges), con, groups, tuple(s.freed))
