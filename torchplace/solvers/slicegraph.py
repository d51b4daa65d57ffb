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

One order's tables are :mod:`torchplace.solvers.slicegraph_order`; under a training
:class:`~torchplace.problem.Pipeline` an order is sliced from its end, at the pieces' 1F1B
positions and with recomputation, by :mod:`torchplace.solvers.slicegraph_pipeline`. This module
searches over orders.
"""
from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from torchplace.errors import InfeasibleError, UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.dp import pieces_to_stages
from torchplace.solvers.dp_infeasible import kind_fix
from torchplace.solvers.limits import Budget
from torchplace.solvers.ordering import order_stages
from torchplace.solvers.paircosts import training_pipeline
from torchplace.solvers.slicegraph_order import _Instance, _kahn, _prepare, _slice, _Timeout
from torchplace.solvers.slicegraph_pipeline import prepare as prepare_pipeline
from torchplace.solvers.slicegraph_pipeline import slice_order

__all__ = ["Search", "progress_bar", "slice_graph", "solve"]

_WAY_OUT = "coarsen the graph (place(..., fuse=True) or granularity='module')"


def _supernode_order(problem: Problem, inst: _Instance, order: Sequence[str]) -> np.ndarray:
    """The supernode order closest to a node order: Kahn with earlier first position first."""
    position = {v: i for i, v in enumerate(order)}
    if len(position) != len(order) or set(position) != set(problem.graph):
        raise UsageError(f"an order must list every node of the graph once ({len(problem.graph)} nodes), got {len(order)}")
    return _kahn(inst, [-min(position[v] for v in s.members) for s in inst.con.nodes])


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
        UsageError: (a ValueError) for a latency problem or negative node times.
        SolverLimitError: if the time limit passes while the graph is prepared.
    """

    def __init__(self, problem: Problem, time_limit: float | None, name: str = "SliceGraph"):
        self.budget = Budget(name, time_limit, way_out=_WAY_OUT)  # covers the preparation too
        self.t0, self.deadline = self.budget.start, self.budget.deadline
        self.problem, self.inst = problem, _prepare(problem, self.budget.ticks("preparing the graph", every=4096))
        self.pipe = prepare_pipeline(problem, self.inst) if training_pipeline(problem) is not None else None
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
            res = self._slice(order, bound)
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

    def _slice(self, order: np.ndarray, bound: float) -> Any:
        """The order's best split (:func:`_slice`, or under a training pipeline
        :func:`torchplace.solvers.slicegraph_pipeline.slice_order`)."""
        if self.pipe is not None:
            return slice_order(self.inst, self.pipe, order, bound=bound, guess=self.guess, deadline=self.deadline)
        return _slice(self.inst, order, bound=bound, guess=self.guess, deadline=self.deadline)

    def plan(self, solver: str, interrupted: bool, meta: dict[str, Any]) -> Plan:
        """The best split found as a Plan (the simple lower bound; status ``"optimal"`` when the
        split meets it, ``"time_limit"`` when the deadline cut the search short, else ``"feasible"``).

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
            status="optimal" if self.proven else "time_limit" if self.timed_out else "feasible",
            meta={"orders": self.evaluated, "history": self.history, "interrupted": interrupted,
                  "timed_out": self.timed_out, "contiguous": True, **meta},
        )
        # prefix sums and the sweep over D cancel terms: round-off grows with the graph's total cost
        scale = float(self.inst.xfer.sum() + self.inst.times.sum(axis=1).max(initial=0.0))
        if not math.isclose(plan.objective, self.best_value, rel_tol=1e-9, abs_tol=1e-11 * (1 + scale)):
            raise AssertionError(f"SliceGraph value {self.best_value} differs from the cost model's {plan.objective}")
        if plan.status == "optimal" and plan.objective > plan.lower_bound * (1 + 1e-9):
            plan.status = "feasible"  # the search's sums met the bound, the cost model's value does not (huge times)
        plan.seconds = time.monotonic() - self.t0
        return plan

    @property
    def proven(self) -> bool:
        """Whether the best split meets the lower bound: no order can give a better one."""
        return self.best_pieces is not None and self.best_value <= self.guess * (1 + 1e-9)

    def done(self) -> bool:
        """Whether the search should stop: the best split meets the lower bound (:attr:`proven`),
        or the deadline has passed (or an order was cut off by it).

        Stopping for the deadline marks the search ``timed_out`` here too: the clock can cross the
        deadline after :meth:`evaluate`'s own check, and the plan must still say the limit cut it short.
        """
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.timed_out = True
        return self.timed_out or self.proven


def _infeasible(problem: Problem, inst: _Instance, order: np.ndarray | None, searched: int) -> InfeasibleError:
    """The error when no searched order has a split that fits, with what would make one fit."""
    stuck = [i for i in range(inst.n) if inst.bad[:, i].all()]
    kinds = sorted({c.kind for c in inst.classes})
    if stuck:
        names = [v for i in stuck[:3] for v in inst.con.nodes[i].members][:5]
        return InfeasibleError(
            f"operators {names} (with their colocated group) cannot run on any device kind of the cluster "
            f"{kinds}; {kind_fix(problem, inst.con.nodes[stuck[0]].members)}"
        )
    caps = sorted({c.memory for c in inst.classes if c.memory is not None})
    if training_pipeline(problem) is not None:
        return InfeasibleError(
            f"the model does not fit for training: no split along the {searched} topological order(s) searched fits "
            f"the memory-limited devices' {caps} bytes at its pipeline positions, recomputing where allowed; use "
            "method 'dp' to learn the smallest memory that fits and whether recomputation, 1F1B, more micro-batches "
            "or another device would (on a coarser graph if it has too many ideals), or raise max_memory")
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

    Under a training :class:`~torchplace.problem.Pipeline` the order is sliced exactly at the
    pieces' 1F1B positions, each piece recomputing where keeping its activations does not fit
    (:mod:`torchplace.solvers.slicegraph_pipeline`).
    """
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

    Training with a :class:`~torchplace.problem.Pipeline`: every order is sliced exactly under
    the pipeline's memory (the pieces' 1F1B positions, recomputation where keeping activations
    does not fit and it is allowed: :mod:`torchplace.solvers.slicegraph_pipeline`); the lower
    bound is the simple bound, which recomputation cannot undercut.

    Raises:
        InfeasibleError: if no searched order has a split that fits.
        SolverLimitError: if the time limit passed before any split was found.
    """
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
