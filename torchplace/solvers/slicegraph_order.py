"""One topological order sliced optimally: Archer et al. 2024, Algorithm 1 with App. B.2's segment
costs, over classes of identical devices (see :mod:`torchplace.solvers.slicegraph` for the
recursion, the transfer sweep and the window pruning); the searches over orders are there.
"""
from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from torchplace.errors import UsageError
from torchplace.problem import Problem
from torchplace.solvers.contract import Contraction, finest_contraction
from torchplace.solvers.paircosts import DeviceClass, device_classes

_TOL = 1e-9


class _Timeout(Exception):
    """The deadline passed while an order was being sliced."""


@dataclass(frozen=True)
class _Instance:
    """Per-problem arrays over the contraction's supernodes, shared by every order."""

    con: Contraction
    classes: list[DeviceClass]
    times: np.ndarray  # (classes, n) seconds; 0 where the class cannot run the supernode
    bad: np.ndarray  # (classes, n) True where it cannot
    mem: np.ndarray  # (n,) bytes
    xfer: np.ndarray  # (producers,) transfer seconds
    xfer_indptr: np.ndarray  # CSR: distinct supernodes of {u} + succ(u), per producer
    xfer_supers: np.ndarray
    succ: list[list[int]]
    indegree: list[int]

    @property
    def n(self) -> int:
        return len(self.con.nodes)


def _prepare(problem: Problem, tick: Callable[[], None] = lambda: None) -> _Instance:
    """The instance's arrays; ``tick`` is called once per supernode and producer (a time limit's check)."""
    if problem.objective != "throughput":
        raise UsageError(f"slicegraph minimises max load; objective {problem.objective!r} is not supported")
    g, (_, con) = problem.graph, finest_contraction(problem.graph)
    classes = device_classes(problem)
    times = np.zeros((len(classes), len(con.nodes)))
    mem = np.zeros(len(con.nodes), dtype=np.int64)
    record = dict(g.records())  # one lookup per node (graphs of 10^5 nodes are prepared within a limit)
    for i, s in enumerate(con.nodes):
        tick()
        mem[i] = sum(record[v].param_bytes + record[v].temp_bytes for v in s.members)
        for c, cl in enumerate(classes):
            times[c, i] = math.fsum(record[v].time_on(cl.kind) for v in s.members)
    if (times < 0).any():
        raise UsageError("node times must be non-negative")
    bad = ~np.isfinite(times)
    times[bad] = 0.0
    super_of = {v: i for i, s in enumerate(con.nodes) for v in s.members}
    costs: list[float] = []
    indptr, supers = [0], []
    for u in g:
        tick()
        cost = problem.transfer_time(u)
        group = sorted({super_of[u], *(super_of[w] for w in g.successors(u))})
        if cost > 0 and len(group) > 1:  # a producer whose consumers all share its supernode never pays
            costs.append(cost)
            supers += group
            indptr.append(len(supers))
    succ: list[list[int]] = [[] for _ in con.nodes]
    indegree = [0] * len(con.nodes)
    for a, b in con.edges:
        succ[a].append(b)
        indegree[b] += 1
    return _Instance(con, classes, times, bad, mem, np.array(costs, dtype=np.float64),
                     np.array(indptr, dtype=np.int64), np.array(supers, dtype=np.int64), succ, indegree)


def _kahn(inst: _Instance, priority: Sequence[float]) -> np.ndarray:
    """Archer App. B.1, Algorithm 3: Kahn's algorithm taking the ready supernode of highest priority."""
    indegree = list(inst.indegree)
    heap = [(-priority[v], v) for v in range(inst.n) if indegree[v] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, u = heapq.heappop(heap)
        order.append(u)
        for v in inst.succ[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                heapq.heappush(heap, (-priority[v], v))
    return np.array(order, dtype=np.int64)


# -- one order: segment costs (App. B.2) -----------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Segment-cost data along one order; segments are ``order[i:j]`` for prefix lengths i < j."""

    order: np.ndarray
    base: np.ndarray  # (classes, n+1) prefix sums of the monotone part of each class's cost
    lo: np.ndarray  # (classes, n+1) smallest start i allowed for end j (support, memory)
    comm: tuple[bool, ...]  # whether each class pays transfers
    ev_indptr: np.ndarray  # transfer events D[index] += delta, applied when position r is added
    ev_index: np.ndarray
    ev_delta: np.ndarray


def _transfer_events(inst: _Instance, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point-mass updates of ``D_r`` (module docstring), grouped by the position that triggers them."""
    n = inst.n
    prod = np.repeat(np.arange(inst.xfer.size), np.diff(inst.xfer_indptr))
    p = pos[inst.xfer_supers]
    idx = np.lexsort((p, prod))
    prod, p = prod[idx], p[idx]
    c = inst.xfer[prod]
    first = np.r_[True, prod[1:] != prod[:-1]] if prod.size else np.zeros(0, dtype=bool)
    last = np.r_[prod[1:] != prod[:-1], True] if prod.size else np.zeros(0, dtype=bool)
    p_first = p[np.maximum.accumulate(np.where(first, np.arange(p.size), 0))] if p.size else p
    inner = ~first
    trig = np.concatenate([p, p[inner], p[last]])  # q_u moves to p_t; leaves p_{t-1}; u fully inside
    index = np.concatenate([p, p[np.flatnonzero(inner) - 1], p_first[last]])
    delta = np.concatenate([c, -c[inner], -c[last]])
    by = np.argsort(trig, kind="stable")
    indptr = np.searchsorted(trig[by], np.arange(n + 1), side="left")
    return indptr, index[by], delta[by]


def _layout(inst: _Instance, order: np.ndarray, measure: str) -> _Layout:
    n = inst.n
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    mem = np.concatenate([[0], np.cumsum(inst.mem[order])])
    base = np.zeros((len(inst.classes), n + 1))
    lo = np.zeros((len(inst.classes), n + 1), dtype=np.int64)
    for c, cl in enumerate(inst.classes):
        lo[c, 1:] = np.maximum.accumulate(np.where(inst.bad[c, order], np.arange(1, n + 1), 0))
        if measure == "load":
            base[c, 1:] = np.cumsum(inst.times[c, order])
            if cl.memory is not None:
                lo[c] = np.maximum(lo[c], np.searchsorted(mem, mem - cl.memory, side="left"))
        elif cl.memory is not None:  # "memory": the bytes of each segment, ignoring the limits
            base[c] = mem
    comm = tuple(measure == "load" and cl.pays_transfer for cl in inst.classes)
    events = _transfer_events(inst, pos) if any(comm) else (np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    return _Layout(order, base, lo, comm, *events)


# -- one order: the DP (Algorithm 1 over device classes) ------------------------------------------


class _Lattice:
    """States ``s`` (unused devices per class) as flat indices; ``full`` is every device unused."""

    def __init__(self, counts: Sequence[int]):
        self.shape = tuple(k + 1 for k in counts)
        self.size = int(np.prod(self.shape))
        self.full = self.size - 1
        self.stride = [int(np.prod(self.shape[c + 1:])) for c in range(len(counts))]
        states = np.array(list(np.ndindex(*self.shape)), dtype=np.int64).reshape(self.size, len(counts))
        self.moves = []  # per class: (targets, sources) with s_c > 0, for inner rows and the last row
        for c in range(len(counts)):
            tgt = np.flatnonzero(states[:, c] > 0)
            inner = tgt[tgt != self.full]
            self.moves.append(((inner, inner - self.stride[c]), (tgt, tgt - self.stride[c])))
        self.states = states

    def closure(self, row: np.ndarray) -> np.ndarray:
        """``min_{s' <= s} row[s']``: devices may stay empty."""
        r = row.reshape(self.shape)
        for axis in range(r.ndim):
            r = np.minimum.accumulate(r, axis=axis)
        return r.reshape(-1)

    def below(self, s: int) -> list[int]:
        """Flat states ``s' <= s``, fewest devices first."""
        cap = self.states[s]
        idx = np.flatnonzero((self.states <= cap).all(axis=1))
        return sorted(idx.tolist(), key=lambda t: (int(self.states[t].sum()), t))


@dataclass
class _Sliced:
    """The DP tables of one order; ``value`` is exact when ``exact``, else an upper bound."""

    lay: _Layout
    lattice: _Lattice
    value: float
    exact: bool
    g: np.ndarray = field(repr=False)
    f: np.ndarray = field(repr=False)
    arg_i: np.ndarray = field(repr=False)
    arg_c: np.ndarray = field(repr=False)

    def pieces(self) -> list[tuple[int, list[int]]]:
        """(class, supernodes) of the optimal segments, first to last (backtracking the tables)."""
        s, j, out = self.lattice.full, self.lay.order.size, []
        while j > 0:
            s2 = next(t for t in self.lattice.below(s) if self.g[t, j] <= self.f[s, j])
            c, i = int(self.arg_c[s2, j]), int(self.arg_i[s2, j])
            out.append((c, self.lay.order[i:j].tolist()))
            s, j = s2 - self.lattice.stride[c], i
        return out[::-1]


def _run(lay: _Layout, lattice: _Lattice, bound: float, deadline: float | None) -> _Sliced:
    """Algorithm 1 on one order, scanning only starts whose monotone cost part is ``<= bound``."""
    n, n_cls = lay.order.size, len(lay.comm)
    f = np.full((lattice.size, n + 1), math.inf)
    f[:, 0] = 0.0
    g = np.full((lattice.size, n + 1), math.inf)
    g[0, 0] = 0.0
    arg_i = np.zeros((lattice.size, n + 1), dtype=np.int64)
    arg_c = np.full((lattice.size, n + 1), -1, dtype=np.int64)
    cut = bound * (1 + _TOL) + _TOL
    lo = np.maximum(lay.lo, np.stack([np.searchsorted(b, b - cut, side="left") for b in lay.base]))
    d = np.zeros(n)
    paying = [c for c in range(n_cls) if lay.comm[c]]
    for j in range(1, n + 1):
        if deadline is not None and j % 128 == 0 and time.monotonic() > deadline:
            raise _Timeout
        a, b = lay.ev_indptr[j - 1], lay.ev_indptr[j]
        if a < b:
            np.add.at(d, lay.ev_index[a:b], lay.ev_delta[a:b])
        if paying:  # comm[i] = sum_{x=i}^{j-1} D[x], for starts from the smallest window start
            lo_comm = min(int(lo[c, j]) for c in paying)
            suffix = np.cumsum(d[lo_comm:j][::-1])[::-1]
        col = g[:, j].copy()
        for c in range(n_cls):
            start = int(lo[c, j])
            if start >= j:
                continue
            cost = lay.base[c, j] - lay.base[c, start:j]
            if lay.comm[c]:
                cost = cost + suffix[start - lo_comm:]
            tgt, src = lattice.moves[c][j == n]
            cand = np.maximum(f[src, start:j], cost)
            best = cand.argmin(axis=1)
            val = cand[np.arange(src.size), best]
            better = val < col[tgt]
            t = tgt[better]
            col[t], arg_i[t, j], arg_c[t, j] = val[better], start + best[better], c
        g[:, j] = col
        f[:, j] = lattice.closure(col)
    value = float(f[lattice.full, n])
    return _Sliced(lay, lattice, value, value <= cut, g, f, arg_i, arg_c)


def _slice(inst: _Instance, order: np.ndarray, *, bound: float = math.inf, guess: float = 0.0,
           deadline: float | None = None, measure: str = "load") -> _Sliced:
    """Slice ``order`` optimally; with a finite ``bound`` the value is exact only if it is ``<= bound``.

    Without a bound the window bound grows from ``guess`` (a lower bound): doubled while nothing is
    found, then set to the value found, which makes the next pass exact.
    """
    lay, lattice = _layout(inst, order, measure), _Lattice([len(c.devices) for c in inst.classes])
    if math.isfinite(bound):
        return _run(lay, lattice, bound, deadline)
    widest = float((lay.base[:, -1] - lay.base[:, 0]).max(initial=0.0))
    t = guess if guess > 0 else math.inf
    while True:
        res = _run(lay, lattice, t, deadline)
        if res.exact or math.isinf(t):
            return res
        t = res.value if math.isfinite(res.value) else (2 * t if 2 * t < widest else math.inf)
