"""Co-placement and cycle-safe merging (Baechi, Jeon et al. 2020, Sec. 3.1-3.3).

Baechi groups operators before placing them:

* **Co-placement** (Sec. 3.2, case (i)): "if the output of an operator is only used by its next
  operator, we place both operators on the same device" (:func:`coplace_single_consumer`).
* **Colocation** (Sec. 3.1; Sec. 3.2, case (ii), a backward operator with its forward operator):
  operators of one colocation group share a device. Directly connected members of a group are
  fused (Sec. 3.3 (i), :func:`coplace_colocated`). A forward and a backward node are *not* merged
  into one node, since a :class:`~torchplace.graph.NodeRecord` is either forward or backward (and
  contiguity is checked per direction): their shared ``colocation`` label, which merged records
  keep, is what places them together.
* **Cycle-safe fusion** (Sec. 3.3): merging the ends of an edge ``u -> v`` creates a cycle iff some
  other path ``u ~> v`` exists. Baechi only checks the necessary condition (``u`` has out-degree
  >= 2 *and* ``v`` in-degree >= 2); :meth:`Quotient.cycle_safe` accepts on Baechi's test and
  otherwise searches for the other path, so it misses none of Baechi's Fig. 5 (b, c) fusions.

:class:`Quotient` is the one merging structure (the graph of groups while they are merged edge by
edge) and :func:`merge_nodes` the one way to turn groups into a coarse :class:`OpGraph`; MOIRAI's
GCOF (:mod:`torchplace.fusion.gcof`) uses both.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from torchplace.fusion.rules import op_kind
from torchplace.graph import NodeRecord, OpGraph, union_of_saved

__all__ = [
    "ASSUMED_DEVICES",
    "Quotient",
    "coplace",
    "coplace_colocated",
    "coplace_single_consumer",
    "default_max_group_time",
    "merge_nodes",
    "merge_records",
    "merge_single_successors",
    "node_work",
]

ASSUMED_DEVICES = 8
"""Device count the default co-placement cap assumes when none is given."""


def node_work(record: NodeRecord) -> float:
    """A node's work for balancing: its time on its slowest kind (0 without times)."""
    return max(record.times.values(), default=0.0)


def default_max_group_time(total_work: float, devices: int | None = None) -> float:
    """The co-placement cap: ``total_work / (4 * devices)`` (``devices`` defaults to 8).

    With every group at most ``W / (4k)``, a chain of groups still splits into ``k`` consecutive
    parts of load at most ``W / k + W / (4k)``: coarsening costs at most 25% of a perfectly
    balanced stage on a chain (each part overshoots ``W / k`` by less than one group).
    """
    k = ASSUMED_DEVICES if devices is None else devices
    if k < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return total_work / (4 * k)


# -- the merging structure --------------------------------------------------------------------------
class Quotient:
    """The quotient DAG of an :class:`OpGraph` under a partition that is refined by merging.

    Starts with one group per node; :meth:`merge` fuses two adjacent groups and refuses a merge
    that would close a cycle. A group is named by its *root*, its first member in the graph's
    topological order, which is also its node id in :func:`merge_nodes`.

    Attributes:
        graph: the original graph.
        order: its nodes in topological order.
        merges: how many merges each step made (``"rule"``, ``"colocation"``, ...).
    """

    def __init__(self, graph: OpGraph) -> None:
        self.graph = graph
        self.order = graph.topological_order()
        self.pos = {v: i for i, v in enumerate(self.order)}
        self.merges: Counter[str] = Counter()
        records = dict(graph.records())
        timed = any(r.times for r in records.values())
        outputs = set(graph.meta.get("outputs", ()))
        self._parent = {v: v for v in self.order}
        self._members = {v: [v] for v in self.order}
        self._succ = {v: set(graph.successors(v)) for v in self.order}
        self._pred = {v: set(graph.predecessors(v)) for v in self.order}
        self._work = {v: node_work(r) if timed else 1.0 for v, r in records.items()}
        self._kinds = {v: frozenset(r.times) for v, r in records.items()}
        self._coloc = {v: r.colocation for v, r in records.items()}
        self._backward = {v: r.backward for v, r in records.items()}
        # A model output that is also consumed inside the graph leaves its group twice.
        self._exported = {v: bool(self._succ[v] and outputs.intersection(r.fx_nodes)) for v, r in records.items()}

    # -- reading -------------------------------------------------------------------------------
    def find(self, v: str) -> str:
        """The root of ``v``'s group."""
        root = v
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[v] != root:
            self._parent[v], v = root, self._parent[v]
        return root

    def roots(self) -> list[str]:
        return [v for v in self.order if self._parent[v] == v]

    def members(self, root: str) -> list[str]:
        """Members of a group, in topological order."""
        return list(self._members[root])

    def successors(self, root: str) -> frozenset[str]:
        return frozenset(self._succ[root])

    def work(self, root: str) -> float:
        return self._work[root]

    def total_work(self) -> float:
        return math.fsum(self._work[r] for r in self.roots())

    def colocation(self, root: str) -> str | None:
        return self._coloc[root]

    def groups(self) -> list[tuple[str, ...]]:
        """Every group's members (topological order), groups ordered by root."""
        return [tuple(self._members[r]) for r in self.roots()]

    # -- checks --------------------------------------------------------------------------------
    def compatible(self, a: str, b: str, *, same_kinds: bool = True) -> bool:
        """Whether groups ``a`` and ``b`` may form one record: the same colocation label, one
        direction (forward/backward), and the same device kinds (``same_kinds``) or at least one
        common kind (a merged node runs only where all its members can).

        Stricter than :func:`merge_records`, which lets an unlabelled node join a labelled group:
        that would pull the node into the group's colocation class and change the constraint
        structure the solvers see (e.g. the forward/backward mirror of a training graph that the
        ideals DP relies on, Tarnawski et al. 2020, Sec. 5.3).
        """
        if self._coloc[a] != self._coloc[b]:
            return False
        if self._backward[a] != self._backward[b]:
            return False
        ka, kb = self._kinds[a], self._kinds[b]
        return ka == kb if same_kinds else (ka == kb or bool(ka & kb))

    def valid_connection(self, a: str, b: str) -> bool:
        """MOIRAI Sec. III-B, ``is_valid_conn``: the edge ``a -> b`` is a *direct* or *multi-input*
        connection, i.e. ``b`` is the only reader of ``a``'s output (not a *multi-output* one)."""
        return self._succ[a] == {b} and not self._exported[a]

    def cycle_safe(self, a: str, b: str) -> bool:
        """Whether merging the ends of edge ``a -> b`` keeps the quotient acyclic (Baechi Sec. 3.3):
        true iff no path ``a ~> b`` other than the edge exists."""
        if b not in self._succ[a]:
            raise ValueError(f"groups {a!r} and {b!r} are not joined by an edge {a!r} -> {b!r}")
        if len(self._succ[a]) == 1 or len(self._pred[b]) == 1:
            return True  # Baechi's test: another path needs out-degree >= 2 and in-degree >= 2
        stack, seen = [w for w in self._succ[a] if w != b], set()
        while stack:
            x = stack.pop()
            if x == b:
                return False
            if x not in seen:
                seen.add(x)
                stack.extend(self._succ[x])
        return True

    # -- merging -------------------------------------------------------------------------------
    def merge(self, a: str, b: str, step: str) -> str:
        """Merge the groups of ``a`` and ``b`` (joined by an edge); return the new root.

        Raises:
            ValueError: if the groups are the same, not adjacent, incompatible, or the merge
                would create a cycle.
        """
        a, b = self.find(a), self.find(b)
        if a == b:
            raise ValueError(f"{a!r} and {b!r} are already in one group")
        if a in self._succ[b]:
            a, b = b, a
        if not self.compatible(a, b, same_kinds=False):
            raise ValueError(f"groups {a!r} and {b!r} cannot share a record (colocation, direction or kinds)")
        if not self.cycle_safe(a, b):
            raise ValueError(f"merging {a!r} and {b!r} would create a cycle: another path joins them")
        root, other = (a, b) if self.pos[a] < self.pos[b] else (b, a)
        self._parent[other] = root
        self._members[root] = sorted(self._members[root] + self._members.pop(other), key=self.pos.__getitem__)
        for x in self._succ[other]:
            self._pred[x].discard(other)
            self._pred[x].add(root)
        for x in self._pred[other]:
            self._succ[x].discard(other)
            self._succ[x].add(root)
        self._succ[root] = (self._succ[root] | self._succ.pop(other)) - {root, other}
        self._pred[root] = (self._pred[root] | self._pred.pop(other)) - {root, other}
        self._work[root] += self._work[other]
        self._kinds[root] &= self._kinds[other]
        self._coloc[root] = self._coloc[root] if self._coloc[root] is not None else self._coloc[other]
        self._exported[root] |= self._exported[other]
        self.merges[step] += 1
        return root


# -- building the coarse graph ----------------------------------------------------------------------
def _common_module(modules: Iterable[str]) -> str:
    """The deepest dotted module path that contains every one of ``modules``."""
    paths = [m.split(".") if m else [] for m in modules]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _group_name(records: Sequence[NodeRecord]) -> str:
    names = [r.name for r in records]
    return "+".join(names) if len(names) <= 4 else f"{names[0]}+...+{names[-1]} ({len(names)} nodes)"


def merge_records(graph: OpGraph, members: Sequence[str]) -> NodeRecord:
    """The record of a group of ``graph``'s nodes (``members`` in topological order).

    Times are summed per device kind, over the kinds every member has; parameter, temporary and
    saved bytes are summed (saved storages that several members save once, ``saved_parts``);
    ``output_bytes`` counts, once each, the members whose outputs leave the group
    (read by a node outside it, or a model output); an explicit ``transfer_time`` is the sum over
    the members read outside the group. ``fx_nodes`` are concatenated in topological order.

    Raises:
        ValueError: if the members carry two colocation labels or mix forward and backward nodes.
    """
    records = [graph.record(v) for v in members]
    if len(records) == 1:
        return records[0]
    labels = sorted({r.colocation for r in records if r.colocation is not None})
    if len(labels) > 1:
        raise ValueError(f"cannot merge {list(members)}: they belong to colocation groups {labels}")
    if len({r.backward for r in records}) > 1:
        raise ValueError(f"cannot merge {list(members)}: they mix forward and backward nodes")
    inside, outputs = set(members), set(graph.meta.get("outputs", ()))
    read_outside = [v for v in members if any(w not in inside for w in graph.successors(v))]
    leaving = [
        v for v, r in zip(members, records)
        if v in read_outside or outputs.intersection(r.fx_nodes) or (not outputs and graph.nx.out_degree(v) == 0)
    ]
    kinds = [k for k in records[0].times if all(k in r.times for r in records)]
    # by storage where every member says (else the plain sum, an upper bound)
    keyed = all(r.saved_parts or not r.saved_bytes for r in records)
    saved_parts = union_of_saved(r.saved_parts for r in records) if keyed else {}
    transfer = None
    if any(r.transfer_time is not None for r in records):
        transfer = math.fsum(graph.record(v).transfer_time or 0.0 for v in (read_outside or leaving))
    return NodeRecord(
        name=_group_name(records),
        op="fused:" + "+".join(op_kind(r.op) or "?" for r in records),
        fx_nodes=tuple(n for r in records for n in r.fx_nodes),
        module=_common_module(r.module for r in records),
        param_bytes=sum(r.param_bytes for r in records),
        output_bytes=sum(graph.record(v).output_bytes for v in leaving),
        temp_bytes=sum(r.temp_bytes for r in records),
        times={k: math.fsum(r.times[k] for r in records) for k in kinds},
        transfer_time=transfer,
        colocation=labels[0] if labels else None,
        backward=records[0].backward,
        saved_bytes=sum(saved_parts.values()) if saved_parts else sum(r.saved_bytes for r in records),
        saved_parts=saved_parts,
    )


def _partition(graph: OpGraph, groups: Iterable[Iterable[str]], pos: dict[str, int]) -> list[list[str]]:
    """``groups`` (members sorted topologically) plus a singleton for every node in none of them."""
    owner: dict[str, int] = {}
    parts: list[list[str]] = []
    for group in groups:
        members = list(dict.fromkeys(group))
        for v in members:
            if v not in pos:
                raise ValueError(f"group {members} names {v!r}, which is not a node of the graph")
            if v in owner:
                raise ValueError(f"node {v!r} is in two groups: {parts[owner[v]]} and {members}")
            owner[v] = len(parts)
        if members:
            parts.append(sorted(members, key=pos.__getitem__))
    parts += [[v] for v in pos if v not in owner]
    return sorted(parts, key=lambda m: pos[m[0]])


def merge_nodes(graph: OpGraph, groups: Iterable[Iterable[str]]) -> tuple[OpGraph, dict[str, tuple[str, ...]]]:
    """Contract each group of nodes into one node (see :func:`merge_records`).

    Args:
        graph: the original graph.
        groups: disjoint collections of node ids; nodes in none of them stay as they are.

    Returns:
        ``(coarse, mapping)``: the coarse graph, whose node ids are each group's first member in
        topological order (nodes in topological order of their first member, ``meta`` copied), and
        ``coarse id -> original ids`` in topological order. Every original node is in exactly one
        group.

    Raises:
        ValueError: for an unknown or repeated node, a group that :func:`merge_records` refuses,
            or groups whose contraction has a cycle (naming it).

    Example:
        >>> g = OpGraph()
        >>> for v in "abc": g.add_node(v, NodeRecord(v, times={"cpu": 1.0}))
        >>> g.add_edge("a", "b"); g.add_edge("b", "c")
        >>> coarse, mapping = merge_nodes(g, [["b", "a"]])
        >>> mapping, coarse.record("a").times
        ({'a': ('a', 'b'), 'c': ('c',)}, {'cpu': 2.0})
    """
    pos = {v: i for i, v in enumerate(graph.topological_order())}
    parts = _partition(graph, groups, pos)
    coarse = OpGraph(meta=graph.meta)
    owner = {v: m[0] for m in parts for v in m}
    for members in parts:
        coarse.add_node(members[0], merge_records(graph, members))
    for edge in sorted({(owner[u], owner[v]) for u, v in graph.edges if owner[u] != owner[v]},
                       key=lambda e: (pos[e[0]], pos[e[1]])):
        coarse.add_edge(*edge)
    try:
        coarse.check_dag()
    except ValueError as e:
        raise ValueError(f"these groups cannot be merged: the coarse graph has a cycle ({e})") from e
    mapping = {m[0]: tuple(m) for m in parts}
    if sorted(v for m in mapping.values() for v in m) != sorted(graph):
        raise AssertionError("merge_nodes lost or repeated a node")  # unreachable: _partition covers each once
    return coarse, mapping


# -- Baechi co-placement -----------------------------------------------------------------------------
def coplace_colocated(q: Quotient) -> None:
    """Fuse directly connected groups with the same colocation label where cycle-safe (Sec. 3.3 (i)).

    Repeats passes over the edges in topological order until none merges.
    """
    edges = sorted(q.graph.edges, key=lambda e: (q.pos[e[0]], q.pos[e[1]]))
    changed = True
    while changed:
        changed = False
        for u, v in edges:
            a, b = q.find(u), q.find(v)
            if a == b or q.colocation(a) is None or q.colocation(a) != q.colocation(b):
                continue
            if q.compatible(a, b, same_kinds=False) and q.cycle_safe(a, b):
                q.merge(a, b, "colocation")
                changed = True


def merge_single_successors(
    q: Quotient, step: str, max_group_time: float, accept: Callable[[str, str], bool]
) -> None:
    """Until nothing changes, merge each group ``a`` (in topological order) into its only successor
    ``b`` along a valid connection when ``accept(a, b)`` holds and the merged work is at most
    ``max_group_time`` (merge step ``step``). Such a merge is always cycle-safe: the edge is ``a``'s
    only way out."""
    changed = True
    while changed:
        changed = False
        for v in q.order:
            a = q.find(v)
            successors = q.successors(a)
            if len(successors) != 1:
                continue
            b = next(iter(successors))
            if q.valid_connection(a, b) and q.work(a) + q.work(b) <= max_group_time and accept(a, b):
                q.merge(a, b, step)
                changed = True


def coplace_single_consumer(q: Quotient, max_group_time: float = math.inf) -> None:
    """Baechi Sec. 3.2 (i): a group whose output only its next group reads joins that group,
    unless the merged group's work would exceed ``max_group_time`` (or their kinds differ).

    Groups are visited in topological order, so a chain is cut greedily into runs of at most
    ``max_group_time`` work.
    """
    merge_single_successors(q, "single-consumer", max_group_time,
                            lambda a, b: q.compatible(a, b, same_kinds=True))


def coplace(
    graph: OpGraph,
    *,
    max_group_time: float | None = None,
    devices: int | None = None,
    colocation: bool = True,
    single_consumer: bool = True,
) -> tuple[OpGraph, dict[str, tuple[str, ...]]]:
    """Baechi co-placement on ``graph``: colocation fusion, then capped single-consumer fusion.

    Args:
        graph: the graph to coarsen.
        max_group_time: largest work (slowest-kind seconds; node count for graphs without times) a
            single-consumer merge may create; ``None``: :func:`default_max_group_time` of the total
            for ``devices``; ``math.inf``: Baechi's uncapped rule (a chain becomes one node).
        devices: device count for the default cap.
        colocation, single_consumer: which of the two fusions to run.

    Returns:
        ``(coarse, mapping)`` as :func:`merge_nodes`.
    """
    q = Quotient(graph)
    if colocation:
        coplace_colocated(q)
    if single_consumer:
        cap = default_max_group_time(q.total_work(), devices) if max_group_time is None else max_group_time
        coplace_single_consumer(q, cap)
    return merge_nodes(graph, q.groups())
