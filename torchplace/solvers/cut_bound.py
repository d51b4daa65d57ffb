"""A lower bound on the optimal max-load that prices transfers: minimum cuts around each group.

The simple bound (:func:`~torchplace.solvers.bounds.simple_lower_bound`, Archer et al. 2024,
Lemma 3.3) and guess-the-bottleneck ignore transfers, so on graphs whose tensors cost more to move
than to compute (ResNet-50's operator graph moves 7.7x its compute) they stay far below every plan
as devices are added. This bound charges what a device holding a group must pay.

**The load of a node set.** Under the cost model (Tarnawski et al. 2020, App. C, Fig. 7,
(18)-(21); :func:`torchplace.costmodel.device_cost`), a device ``d`` that pays transfers and holds
the node set ``X`` has load at least

    load_d(X) = sum_{v in X} t_v(d) + sum_{p : X cuts e_p} c_p,

where ``e_p`` is producer ``p`` with its consumers and ``X`` *cuts* ``e_p`` when ``e_p`` has
members in and out of ``X``: then ``p``'s output leaves ``X`` (``p`` in ``X``) or enters it, once
(``p`` out). Recomputation only adds compute. A device that pays no transfers (a CPU) has load at
least its compute.

**Per group.** Let ``U`` be a colocation group (or a single node). Whatever the plan, the device
holding ``U`` holds some ``X`` containing ``U``, so if it pays transfers and is of kind ``k``, the
max-load is at least

    need_k(U) = min over node sets X containing U of load_k(X),

a minimum ``U``-sink cut: each group is a node with an edge to the sink of its time (``X``'s side
pays it), and each ``e_p`` is Lawler's hyperedge gadget (two nodes joined by an edge of ``c_p``;
unbounded edges from every member to the first and from the second to every member: the edge of
``c_p`` is cut exactly when ``e_p`` has members on both sides). Capacities are rounded down to
integer multiples of a small unit, so the cut found never exceeds the true one.

A cheaper relaxation gives every group a first value (*one hop*): each neighbouring group ``W``
either is in ``X`` (it adds ``t_W``) or not (``X`` then pays the inputs ``W`` sends to ``U``, and
for each output of ``U`` with ``n`` consumer groups, ``1/n`` of it per consumer group left out:
the output is paid once if any is left out, which is at least its share of those left out):

    need_k(U) >= t_U + sum_W min(t_W, in_W + out-share_W).

Exact cuts then replace one-hop values, largest first, for the groups that can still raise the
bound, within the time limit; the bound is valid whenever it stops (a group not reached keeps its
own time, then its one-hop value). Each cut is solved on a small network: an optimal ``X`` can be
taken connected through shared tensors (a part of ``X`` sharing none with the rest adds its own
load), so it holds only groups within ``load({U}) - t_U`` of ``U`` by the time of the groups on
the way; the tensors of farther groups are outside ``X``.

**Combined.** With ``a_U`` the least ``need_k(U)`` over the kinds of devices that pay transfers and
``b_U`` the least time of ``U`` on a device that pays none (``n_0`` such devices), a max-load ``L``
is reachable only if every group with ``a_U > L`` runs on one of those: each ``b_U <= L`` and
their sum ``<= n_0 L``. The least such ``L`` is computed exactly (groups sorted by ``a``: with the
``j`` largest forced, ``L = max(a_(j+1), max b, sum b / n_0)``, the least over ``j``).

**Packed.** Groups that share a device add their compute (transfers between them vanish, so only
compute counts). With ``p_U`` the least time of ``U`` on a device that pays transfers and ``n_p``
such devices, a max-load ``L`` lets each of them hold at most ``j`` groups with ``p_U > L/(j+1)``
(``j + 1`` of them would exceed ``L``): of those groups (``a_U <= L``), at least their number
minus ``j n_p`` run on devices that pay none, next to the forced ones, within the same ``b_U <= L``
and ``n_0 L`` (the cheapest by ``b`` taken). This is the pigeonhole bound of scheduling on
identical machines (``P||C_max``: ``n_p + 1`` jobs on ``n_p`` machines put two on one), which
neither the sum of work nor a single group sees: 24 transformer layers on 16 devices put two
layers on one. ``L`` is found by bisection to a relative ``1e-12``; each value returned is one at
which the conditions fail, so it stays a proof.

Memory, contiguity and the pipeline are ignored (a relaxation): the bound holds for contiguous
and non-contiguous plans alike, and under a training pipeline on its relaxed problem
(:func:`~torchplace.solvers.pipelined.bounding_problem`).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import defaultdict

import networkx as nx
import numpy as np
from networkx.algorithms.flow import build_residual_network, preflow_push

from torchplace.problem import Problem

__all__ = ["cut_lower_bound"]

_RESOLUTION = 2.0**-40  # the cut's capacity unit, as a share of the largest finite capacity
_SECONDS_PER_ELEMENT = 12e-6  # reading a graph into groups, per node and edge (measured: 9-10 us)
_GLOBAL_SHARE = 4  # a cut over more than 1/4 of the groups reuses one network of them all
_PACK_ROUNDS = 8  # the packing conditions (values of j) checked per candidate L, most violated first


def cut_lower_bound(problem: Problem, time_limit: float | None = 5.0) -> float:
    """A proven lower bound on the optimal max-load of ``problem`` (module docstring).

    Args:
        problem: a throughput problem (max-load); Piper problems and latency problems get 0.
        time_limit: seconds for the one-hop values and the exact cuts (each group's own time is
            always counted); ``None``: every group that can raise the bound gets its exact cut.

    Returns:
        The bound in seconds (``inf`` when some group can run on no device).
    """
    if problem.objective == "latency" or problem.parallel is not None:
        return 0.0
    from torchplace.solvers.pipelined import bounding_problem

    deadline = None if time_limit is None else time.perf_counter() + time_limit
    g = problem.graph
    if time_limit is not None and _SECONDS_PER_ELEMENT * (len(g) + g.nx.number_of_edges()) > time_limit:
        return 0.0  # reading the graph alone would take longer

    def left() -> float:
        return math.inf if deadline is None else deadline - time.perf_counter()

    groups = _Groups(bounding_problem(problem))
    paying = sorted({d.kind for d in problem.cluster.devices if d.pays_transfer})
    free = [d.kind for d in problem.cluster.devices if not d.pays_transfer]
    b = [min((groups.time(u, k) for k in free), default=math.inf) for u in range(groups.n)]
    p = [min((groups.time(u, k) for k in paying), default=math.inf) for u in range(groups.n)]
    a = list(p)
    for u in range(groups.n):
        if u % 1024 == 0 and left() <= 0:
            break
        a[u] = max(a[u], min((groups.one_hop(u, k) for k in paying), default=math.inf))
    bound = _least_load(a, b, len(free))
    upper = [min((groups.alone(u, k) for k in paying), default=math.inf) for u in range(groups.n)]
    for u in sorted(range(groups.n), key=lambda u: -a[u]):
        if left() <= 0 or math.isinf(bound):
            break
        if upper[u] <= bound or a[u] >= upper[u]:
            continue  # its exact value could not raise the bound
        exact = min(groups.need(u, k, upper[u]) for k in paying)
        if exact > a[u]:
            a[u] = exact
            if exact > bound:
                bound = _least_load(a, b, len(free))
    return _packed_load(a, p, b, sum(d.pays_transfer for d in problem.cluster.devices), len(free), bound)


def _least_load(a: list[float], b: list[float], free_devices: int) -> float:
    """The least ``L`` with every group whose ``a > L`` on a device paying no transfers (module
    docstring, "Combined")."""
    order = sorted(range(len(a)), key=lambda u: -a[u])
    best, most, total = math.inf, 0.0, 0.0
    for j in range(len(order) + 1):  # the j groups of largest a are forced off the paying devices
        floor = a[order[j]] if j < len(order) else 0.0
        if j:
            u = order[j - 1]
            most, total = max(most, b[u]), total + b[u]
            if math.isinf(b[u]) or free_devices == 0:
                break
        best = min(best, max(floor, most, total / free_devices if j else 0.0))
    return best


def _packed_load(a: list[float], p: list[float], b: list[float], paying: int, free: int, lo: float) -> float:
    """The least ``L >= lo`` (to a relative 1e-12, from below) meeting the packing conditions
    (module docstring, "Packed"); ``lo`` must be a proven bound."""
    av, pv, bv = (np.asarray(x, dtype=float) for x in (a, p, b))
    p_sorted = np.sort(pv)

    def fits(load: float) -> bool:
        return _packs(load, av, pv, bv, p_sorted, paying, free)

    if paying == 0 or math.isinf(lo) or fits(lo):
        return lo
    hi = max(2 * lo, float(np.max(pv, where=np.isfinite(pv), initial=1e-300)))
    while not fits(hi):  # finite times fit under a large enough L
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid  # the conditions fail at mid: every plan's max-load exceeds it
    return lo


def _packs(load: float, a: np.ndarray, p: np.ndarray, b: np.ndarray, p_sorted: np.ndarray,
           paying: int, free: int) -> bool:
    """False when no plan has max-load ``<= load`` by the conditions of "Combined" and "Packed"
    (the ``_PACK_ROUNDS`` values of ``j`` that the counts say are most violated)."""
    forced = a > load
    base = 0.0
    if forced.any():
        if free == 0 or bool((b[forced] > load).any()):
            return False
        base = float(b[forced].sum())
        if base > free * load:
            return False
    n = len(p)
    j = np.arange(1, max(1, -(-n // paying)))  # j * paying < n: more than j per device is possible
    excess = n - np.searchsorted(p_sorted, load / (j + 1), side="right") - j * paying
    for i in np.argsort(-excess, kind="stable")[:_PACK_ROUNDS]:
        if excess[i] <= 0:
            break
        big = ~forced & (p > load / (j[i] + 1))
        extra = int(big.sum()) - int(j[i]) * paying  # these must run on devices that pay nothing
        if extra <= 0:
            continue
        if free == 0:
            return False
        cheapest = np.partition(b[big], extra - 1)[:extra]
        if float(cheapest.max()) > load or base + float(cheapest.sum()) > free * load:
            return False
    return True


class _Groups:
    """Colocation groups, their times per kind and the tensors that cross groups."""

    def __init__(self, problem: Problem) -> None:
        g = problem.graph
        index: dict[str, int] = {}
        self.of: dict[str, int] = {}
        members: list[list[str]] = []
        for v, r in g.records():
            key = r.colocation if r.colocation is not None else f"\0{v}"
            if key not in index:
                index[key] = len(members)
                members.append([])
            members[index[key]].append(v)
            self.of[v] = index[key]
        self.n = len(members)
        kinds = {d.kind for d in problem.cluster.devices}
        self._time = [{k: math.fsum(g.record(v).time_on(k) for v in m) for k in kinds} for m in members]
        # each crossing tensor: (its producer's group, the other groups reading it, transfer seconds)
        self.edges: list[tuple[int, frozenset[int], float]] = []
        for v in g:
            readers = frozenset(self.of[w] for w in g.successors(v)) - {self.of[v]}
            c = problem.transfer_time(v) if readers else 0.0
            if c > 0:
                self.edges.append((self.of[v], readers, c))
        self._touching: list[list[int]] = [[] for _ in range(self.n)]  # group -> its tensors
        self._inputs: list[dict[int, float]] = [defaultdict(float) for _ in range(self.n)]
        self._shares: list[dict[int, float]] = [defaultdict(float) for _ in range(self.n)]
        self._crossing = [0.0] * self.n  # what the group alone pays
        for i, (owner, readers, c) in enumerate(self.edges):
            self._crossing[owner] += c
            self._touching[owner].append(i)
            for w in readers:
                self._touching[w].append(i)
                self._inputs[w][owner] += c
                self._shares[owner][w] += c / len(readers)
                self._crossing[w] += c
        finite = [t for times in self._time for t in times.values() if math.isfinite(t) and t > 0]
        finite += [c for _, _, c in self.edges]
        self._unit = max(finite, default=1.0) * _RESOLUTION  # cut capacities are multiples of it
        self._global: dict[str, tuple[nx.DiGraph, nx.DiGraph]] = {}

    def time(self, u: int, kind: str) -> float:
        return self._time[u][kind]

    def one_hop(self, u: int, kind: str) -> float:
        """The one-hop lower bound on ``need_kind(u)``."""
        own = self._time[u][kind]
        if math.isinf(own):
            return math.inf
        near = set(self._inputs[u]) | set(self._shares[u])
        return own + math.fsum(min(self._time[w][kind], self._inputs[u].get(w, 0.0) + self._shares[u].get(w, 0.0))
                               for w in sorted(near))

    def alone(self, u: int, kind: str) -> float:
        """``load_kind({u})``: an upper bound on ``need_kind(u)``."""
        return self._time[u][kind] + self._crossing[u]

    def need(self, u: int, kind: str, upper: float) -> float:
        """``need_kind(u)`` by a minimum cut over the groups within ``upper - t_u`` of ``u``
        (module docstring), never above the true value (capacities rounded down)."""
        own = self._time[u][kind]
        if math.isinf(own):
            return math.inf
        ball = self._ball(u, kind, upper - own)
        if len(ball) * _GLOBAL_SHARE > self.n:
            return self._global_need(u, kind)
        sink, net = ("sink",), nx.DiGraph()
        for w in ball:
            net.add_edge(w, sink, capacity=self._down(self._time[w][kind]))
        tensors = {i for w in ball for i in self._touching[w]}
        for i in sorted(tensors):
            owner, readers, c = self.edges[i]
            first, second = ("in", i), ("out", i)
            net.add_edge(first, second, capacity=self._down(c))
            for m in (owner, *readers):
                if m in ball:
                    net.add_edge(m, first, capacity=math.inf)
                    net.add_edge(second, m, capacity=math.inf)
                else:  # out of X: the tensor is paid as soon as one member is in
                    net.add_edge(second, sink, capacity=math.inf)
        if net.number_of_nodes() <= 2:
            return own
        flow = preflow_push(net, u, sink, value_only=True)
        return flow.graph["flow_value"] * self._unit

    def _global_need(self, u: int, kind: str) -> float:
        """``need_kind(u)`` on the network of every group, built once per kind (its residual
        network is reused by every cut)."""
        if kind not in self._global:
            sink, net = ("sink",), nx.DiGraph()
            for w in range(self.n):
                t = self._time[w][kind]
                net.add_edge(w, sink, capacity=self._down(t) if math.isfinite(t) else math.inf)
            for i, (owner, readers, c) in enumerate(self.edges):
                net.add_edge(("in", i), ("out", i), capacity=self._down(c))
                for m in (owner, *readers):
                    net.add_edge(m, ("in", i), capacity=math.inf)
                    net.add_edge(("out", i), m, capacity=math.inf)
            self._global[kind] = (net, build_residual_network(net, "capacity"))
        net, residual = self._global[kind]
        flow = preflow_push(net, u, ("sink",), residual=residual, value_only=True)
        return flow.graph["flow_value"] * self._unit

    def _ball(self, u: int, kind: str, budget: float) -> set[int]:
        """Groups reachable from ``u`` through shared tensors with the groups on the way (``u``
        not counted) taking at most ``budget`` seconds."""
        dist, heap = {u: 0.0}, [(0.0, u)]
        slack = budget * (1 + 1e-9) + 1e-12
        while heap:
            d, w = heapq.heappop(heap)
            if d > dist.get(w, math.inf):
                continue
            for i in self._touching[w]:
                owner, readers, _ = self.edges[i]
                for m in (owner, *readers):
                    nd = d + self._time[m][kind]
                    if nd <= slack and nd < dist.get(m, math.inf):
                        dist[m] = nd
                        heapq.heappush(heap, (nd, m))
        return set(dist)

    def _down(self, x: float) -> int:
        return int(math.floor(x / self._unit))
