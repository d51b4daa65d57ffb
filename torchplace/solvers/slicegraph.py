"""SliceGraph: optimal slicing of topological orders, and a random search over orders.

Archer et al. 2024 (papers/archer2024-pipeline-bounds.txt), Sec. 4: a segmentation of a
topological order into consecutive blocks is a contiguous split whose blocks run as a chain of
stages, so optimising over orders replaces the acyclicity constraint. For one order ``pi`` of the
contracted graph (training graphs: forward supernodes carrying their backward siblings, Tarnawski
App. E.1, as the ideals DP uses; of the two orientations of the backward pieces the one with more
supernodes, :func:`~torchplace.solvers.contract.finest_contraction`) Algorithm 1 is generalised to
classes of identical devices:

    f[s][j] = min( min_{c : s_c > 0} min_{i < j} max(f[s - e_c][i], cost_c(pi[i:j])),   (Alg. 1, l. 10-13)
                   min_{s' < s} f[s'][j] )                                              (empty devices)

with ``s`` the unused devices per class (the ideals DP's states) and ``j`` a prefix length.

Segment costs (App. B.2, Lemma 4.1, counted with :mod:`torchplace.costmodel`'s rules): compute and
memory are prefix-sum differences; for transfers, producer ``u`` with distinct positions
``p_1 < ... < p_d`` of ``{u} + succ(u)`` pays on segment ``[l, r]`` iff

    [l <= q_u(r)] - [r >= p_d][l <= p_1],      q_u(r) = max{p_t <= r},

so for a fixed end ``r`` the transfer cost of every start is a suffix sum of a point-mass array
``D_r`` that changes in O(deg(u)) places over the whole sweep (the paper's io_struct rectangle
updates; here a sliding sweep over ``r`` in O(n) per row instead of a 2-D Fenwick tree).

Speed (exact, no monotonicity assumed): a segment's cost is at least its compute (memory) prefix
difference, which is monotone in the start. With a bound ``T`` only starts whose compute is at most
``T`` are scanned; every value ``<= T`` is then still exact (its witnessing split only uses such
segments), so the order's optimum is exact whenever it is ``<= T``. The first order starts with
``T`` = the simple lower bound, doubles it while no split is found, and repeats once with ``T`` =
the value found (now exact); later orders use the best objective so far (BRKGA,
:mod:`torchplace.solvers.brkga`: the elite threshold) and are abandoned cheaply when they cannot
beat it. Per row the costs of all window starts are one numpy expression per class and the
max/min over starts one expression over all states: O(n * window) segment costs per class,
O(n^2) at worst (no pruning), never more.
"""
from __future__ import annotations

import hashlib
import heapq
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from torchplace.errors import InfeasibleError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.contract import Contraction, finest_contraction
from torchplace.solvers.dp import DeviceClass, device_classes, pieces_to_stages
from torchplace.solvers.limits import Budget
from torchplace.solvers.ordering import order_stages
from torchplace.solvers.pipelined import solve_pipelined, training_pipeline

__all__ = ["Search", "progress_bar", "slice_graph", "solve"]

_TOL = 1e-9
_WAY_OUT = "coarsen the graph (place(..., fuse=True) or granularity='module')"


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
        raise ValueError(f"slicegraph minimises max load; objective {problem.objective!r} is not supported")
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
        raise ValueError("node times must be non-negative")
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


def _supernode_order(problem: Problem, inst: _Instance, order: Sequence[str]) -> np.ndarray:
    """The supernode order closest to a node order: Kahn with earlier first position first."""
    position = {v: i for i, v in enumerate(order)}
    if len(position) != len(order) or set(position) != set(problem.graph):
        raise ValueError(f"an order must list every node of the graph once ({len(problem.graph)} nodes), got {len(order)}")
    return _kahn(inst, [-min(position[v] for v in s.members) for s in inst.con.nodes])


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


# -- searching over orders (Sec. 4.2, App. C.1) ---------------------------------------------------


class Search:
    """Slices orders one by one and keeps the best split; stops at the deadline.

    Every order, the first included, is abandoned when the deadline passes (``timed_out``); the
    plan is then the best split found (status ``"time_limit"``), and without one the search raises
    SolverLimitError. Orders already seen are answered from a cache. Searches over orders
    (:func:`solve`, :func:`torchplace.solvers.brkga.solve`) propose orders with :meth:`order`,
    score them with :meth:`evaluate`, and finish with :meth:`plan`.

    Args:
        problem: a throughput problem.
        time_limit: seconds from construction (preparation included); ``None`` for no limit.
        name: the search, for messages.

    Raises:
        ValueError: for a latency problem or negative node times.
        SolverLimitError: if the time limit passes while the graph is prepared.
    """

    def __init__(self, problem: Problem, time_limit: float | None, name: str = "SliceGraph"):
        self.budget = Budget(name, time_limit, way_out=_WAY_OUT)  # covers the preparation too
        self.t0, self.deadline = self.budget.start, self.budget.deadline
        self.problem, self.inst = problem, _prepare(problem, self.budget.ticks("preparing the graph", every=4096))
        self.guess = simple_lower_bound(problem)
        self.budget.check("preparing the graph")
        self.best_value = math.inf
        self.best_pieces: list[tuple[int, list[int]]] | None = None
        self.first_order: np.ndarray | None = None
        self.evaluated, self.timed_out = 0, False
        self.history: list[list[float]] = []  # [orders sliced, seconds, objective] at each improvement
        self.cache: dict[bytes, float] = {}

    @property
    def n(self) -> int:
        """Supernodes of the contracted graph: the length of an order (and of a priority vector)."""
        return self.inst.n

    def order(self, priority: Sequence[float]) -> np.ndarray:
        """The supernode order of Kahn's algorithm taking the ready supernode of highest ``priority``."""
        return _kahn(self.inst, priority)

    def evaluate(self, order: np.ndarray, bound: float = math.inf) -> float:
        """Objective of the best split of ``order`` (an upper bound on it when it exceeds ``bound``)."""
        key = hashlib.blake2b(order.tobytes(), digest_size=16).digest()
        if key in self.cache:
            return self.cache[key]
        if self.first_order is None:
            self.first_order = order
        bound = min(bound, self.best_value)
        try:
            res = _slice(self.inst, order, bound=bound, guess=self.guess, deadline=self.deadline)
        except _Timeout:
            self.timed_out = True
            return math.inf
        self.evaluated += 1
        self.cache[key] = res.value
        if math.isfinite(res.value) and (self.best_pieces is None or res.value < self.best_value * (1 - 1e-12)):
            self.best_value, self.best_pieces = res.value, res.pieces()
            self.history.append([self.evaluated, round(time.monotonic() - self.t0, 4), res.value])
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
        return res.value

    def plan(self, solver: str, interrupted: bool, meta: dict[str, Any]) -> Plan:
        """The best split found as a Plan (the simple lower bound; status ``"time_limit"`` when
        the deadline cut the search short, else ``"feasible"``).

        ``meta`` adds to the search's own (``orders``, ``history``, ``interrupted``, ``timed_out``).

        Raises:
            InfeasibleError: if no evaluated order has a split that fits (what would make one fit).
            SolverLimitError: if the deadline passed before any split was found.
        """
        if self.best_pieces is None and self.timed_out:
            raise self.budget.time_error("slicing the first topological order", " before any split was found")
        if self.best_pieces is None:
            raise _infeasible(self.problem, self.inst, self.first_order, self.evaluated)
        stages = order_stages(self.problem.graph, pieces_to_stages(self.inst.con, self.inst.classes, self.best_pieces))
        seconds = time.monotonic() - self.t0
        plan = Plan.build(
            self.problem, stages, solver=solver, seconds=seconds, lower_bound=self.guess,
            status="time_limit" if self.timed_out else "feasible",
            meta={"orders": self.evaluated, "history": self.history, "interrupted": interrupted,
                  "timed_out": self.timed_out, "contiguous": True, **meta},
        )
        # prefix sums and the sweep over D cancel terms: round-off grows with the graph's total cost
        scale = float(self.inst.xfer.sum() + self.inst.times.sum(axis=1).max(initial=0.0))
        if not math.isclose(plan.objective, self.best_value, rel_tol=1e-9, abs_tol=1e-11 * (1 + scale)):
            raise AssertionError(f"SliceGraph value {self.best_value} differs from the cost model's {plan.objective}")
        plan.seconds = time.monotonic() - self.t0
        return plan

    def done(self) -> bool:
        """Whether the search should stop: the deadline has passed (or an order was cut off by it)."""
        return self.timed_out or (self.deadline is not None and time.monotonic() > self.deadline)


def _infeasible(problem: Problem, inst: _Instance, order: np.ndarray | None, searched: int) -> InfeasibleError:
    """The error when no searched order has a split that fits, with what would make one fit."""
    stuck = [i for i in range(inst.n) if inst.bad[:, i].all()]
    kinds = sorted({c.kind for c in inst.classes})
    if stuck:
        names = [v for i in stuck[:3] for v in inst.con.nodes[i].members][:5]
        return InfeasibleError(
            f"operators {names} (with their colocated group) cannot run on any device kind of the cluster "
            f"{kinds}; add a device of a kind that can run them, e.g. 'cpu'"
        )
    caps = sorted({c.memory for c in inst.classes if c.memory is not None})
    need = _slice(inst, order, measure="memory").value if order is not None else math.inf
    if math.isinf(need):
        return InfeasibleError(
            f"along the {searched} topological order(s) searched, operators that only some device kinds "
            f"({kinds}) can run alternate more often than there are devices; add devices, or use solver 'dp'"
        )
    return InfeasibleError(
        f"the model does not fit: no split along the {searched} topological order(s) searched fits the "
        f"memory-limited devices' {caps} bytes; along the first order a split fits once every device has "
        f"{int(need)} bytes ({need / 2**30:.3f} GiB): raise max_memory or add devices (solver 'dp' states the "
        "smallest memory that fits when the graph has few ideals)"
    )


def progress_bar(progress: bool | None, total: int, desc: str) -> tqdm:
    """A tqdm bar counting orders; ``progress=None`` shows it when stderr is a terminal."""
    disable = not sys.stderr.isatty() if progress is None else not progress
    return tqdm(total=total, desc=desc, unit="order", disable=disable, leave=False)


def slice_graph(problem: Problem, order: Sequence[str]) -> Plan:
    """Archer et al. 2024, Algorithm 1: the best contiguous split along one topological order.

    Args:
        problem: a throughput problem (devices are grouped into classes of identical devices).
        order: every node id of the graph once, in a topological order. Colocated and training
            graphs are sliced over the contracted graph: supernodes in the order of their first
            member, made topological by Kahn's algorithm where needed.

    Returns:
        A Plan (status ``"feasible"``) whose objective is the minimum max load over all
        segmentations of the order into at most one consecutive block per device.

    Raises:
        InfeasibleError: if no segmentation fits (memory, devices that can run the operators).

    A training problem with a :class:`~torchplace.problem.Pipeline` is sliced through its
    per-node memory relaxation and restriction (:mod:`torchplace.solvers.pipelined`): the plan
    always fits, but the order's best split under the pipeline's memory may be missed.
    """
    if training_pipeline(problem) is not None:
        return solve_pipelined(problem, lambda p, time_limit=None: slice_graph(p, order), None)
    search = Search(problem, None)
    inst = search.inst
    search.evaluate(_supernode_order(problem, inst, order))
    return search.plan("slicegraph", False, {})


def solve(problem: Problem, *, orders: Iterable[Sequence[str]] = (), seed: int = 0, random_orders: int = 16,
          time_limit: float | None = None, progress: bool | None = None) -> Plan:
    """SliceGraph over ``orders`` and then ``random_orders`` random ones (Archer Sec. 4.2, App. C.1 "Random").

    Random orders are Kahn's algorithm with i.i.d. U(0, 1) node priorities drawn from
    ``numpy.random.default_rng(seed)``; the result is the best segmentation found.

    Args:
        problem: a throughput problem.
        orders: topological orders (node ids) to slice first, e.g. a DFS order.
        seed: seeds the random priorities (same seed, same plan).
        random_orders: how many random orders to slice after ``orders``.
        time_limit: seconds for everything (preparation included); the search stops when it passes.
        progress: show a tqdm bar (default: when stderr is a terminal).

    Returns:
        A Plan with status ``"feasible"`` (``"time_limit"`` when the limit cut the search short) and
        the simple lower bound; ``meta`` holds ``orders`` (sliced), ``history`` ([orders, seconds,
        objective] at each improvement), ``timed_out`` and ``interrupted`` (Ctrl-C returns the
        best plan so far).

    Training with a :class:`~torchplace.problem.Pipeline`: segment memory here is a sum over
    nodes, so such a problem is searched through its relaxation (a node's activations of one
    micro-batch; the plan re-costed at its pipeline positions, recomputing where needed) and, if
    that plan does not fit as it is, its restriction (all ``m`` micro-batches in flight on every
    device, no recomputation): :mod:`torchplace.solvers.pipelined`. The plan always fits; its
    lower bound is the simple bound, which recomputation cannot undercut.

    Raises:
        InfeasibleError: if no searched order has a split that fits.
        SolverLimitError: if the time limit passed before any split was found.
    """
    if training_pipeline(problem) is not None:
        given_orders = [list(o) for o in orders]
        return solve_pipelined(problem, solve, time_limit, orders=given_orders, seed=seed,
                               random_orders=random_orders, progress=progress)
    search = Search(problem, time_limit)
    inst = search.inst
    given = [list(o) for o in orders]
    rng = np.random.default_rng(seed)

    def candidates() -> Iterator[np.ndarray]:
        for o in given:
            yield _supernode_order(problem, inst, o)
        for _ in range(random_orders):
            yield _kahn(inst, rng.random(inst.n).tolist())

    interrupted = False
    with progress_bar(progress, len(given) + random_orders, "slicegraph") as bar:
        try:
            for order in candidates():
                search.evaluate(order)
                bar.update()
                bar.set_postfix(best=f"{search.best_value:.6g}")
                if search.done():
                    break
        except KeyboardInterrupt:
            if search.best_pieces is None:
                raise
            interrupted = True
    return search.plan("slicegraph", interrupted, {"seed": seed})
