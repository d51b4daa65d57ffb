"""The ideals DP for min max-load contiguous splits (Tarnawski et al. 2020, Sec. 5.1.1, 5.3, App. E).

    dp[s][I] = min over device classes c with s_c > 0, ideals I' <= I of
               max(dp[s - e_c][I'], cost_c(I \\ I'))

where ``s`` counts the devices of each class still unused (the paper's (k', l') for accelerators
and CPUs, generalised to any number of classes of identical devices) and ``I' = I`` means "leave
this device empty". Training graphs are handled by running the DP on the forward part with each
forward supernode carrying its backward sibling (Sec. 5.3, App. E.1; see ``contract``), once per
orientation of the backward pieces when backward edges join colour classes.

All pair costs are computed at once with numpy. For nested sets ``I' <= I`` and ``S = I \\ I'``,
a producer ``u`` (with ``M(u) = {u} + succ(u)``) pays its transfer iff ``M(u)`` is partly in ``S``.
Writing ``K[J, u] = |M(u) & J|`` and ``P(J) = {u : 0 < K[J, u] < |M(u)|}`` (the frontier of ``J``),

    comm(I \\ I') = B(I') + sum_{u in P(I)} c_u ([K[I', u] = 0] - [K[I', u] = K[I, u]])

with ``B(J) = sum_{u in P(J)} c_u``, so each pair costs O(|frontier of I|) instead of O(|V| + |E|).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from torchplace.errors import InfeasibleError
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.contract import Contraction, contractions
from torchplace.solvers.ideals import DEFAULT_IDEAL_LIMIT, Ideals, enumerate_ideals
from torchplace.solvers.limits import Budget
from torchplace.solvers.ordering import order_stages

__all__ = ["DeviceClass", "device_classes", "pieces_to_stages", "solve", "solve_linearized"]


@dataclass(frozen=True)
class DeviceClass:
    """Identical devices: same kind, memory and transfer rule."""

    kind: str
    memory: int | None
    pays_transfer: bool
    devices: tuple[str, ...]


def device_classes(problem: Problem) -> list[DeviceClass]:
    """Group the cluster's devices into classes of identical devices, in first-seen order."""
    groups: dict[tuple[str, int | None, bool], list[str]] = {}
    for d in problem.cluster.devices:
        groups.setdefault((d.kind, d.memory_bytes, d.pays_transfer), []).append(d.name)
    return [DeviceClass(k, m, p, tuple(names)) for (k, m, p), names in groups.items()]


class _PairCosts:
    """Cost of every contiguous set ``I \\ I'`` on every device class, as flat arrays over pairs."""

    def __init__(
        self, problem: Problem, con: Contraction, ideals: Ideals, classes: Sequence[DeviceClass], measure: str = "load",
        tick: Callable[[], None] = lambda: None,
    ):
        self.problem, self.con, self.ideals, self.tick = problem, con, ideals, tick
        n_ideals = len(ideals)
        self.owner = np.repeat(np.arange(n_ideals), np.diff(ideals.sub_indptr))  # I of each pair
        self.sub = ideals.sub_index  # I' of each pair
        x = ideals.membership.astype(np.float64)
        if measure == "load":
            self.comm = self._comm()
            self.costs = [self._class_cost(c, x) for c in classes]
        else:  # "memory": the bytes each piece needs, ignoring memory limits
            self.costs = [self._class_memory(c, x) for c in classes]

    def _super_sum(self, values: dict[str, float]) -> np.ndarray:
        return np.array([math.fsum(values[v] for v in s.members) for s in self.con.nodes])

    def _diff(self, x: np.ndarray, per_super: np.ndarray) -> np.ndarray:
        prefix = x @ per_super
        return prefix[self.owner] - prefix[self.sub]

    def _memory(self, x: np.ndarray) -> np.ndarray:
        g = self.problem.graph
        return self._diff(x, self._super_sum({v: float(r.param_bytes + r.temp_bytes) for v, r in g.records()}))

    def _unsupported(self, c: DeviceClass, x: np.ndarray) -> np.ndarray:
        bad = self._super_sum({v: float(c.kind not in r.times) for v, r in self.problem.graph.records()})
        return self._diff(x, bad) > 0.5

    def _class_cost(self, c: DeviceClass, x: np.ndarray) -> np.ndarray:
        t = self._super_sum({v: (r.times.get(c.kind, 0.0)) for v, r in self.problem.graph.records()})
        cost = self._diff(x, t)
        if c.pays_transfer:
            cost = cost + self.comm
        infeasible = self._unsupported(c, x)
        if c.memory is not None:
            infeasible |= self._memory(x) > c.memory
        cost[infeasible] = math.inf
        cost[self.owner == self.sub] = 0.0  # an empty device costs nothing
        return cost

    def _class_memory(self, c: DeviceClass, x: np.ndarray) -> np.ndarray:
        cost = self._memory(x) if c.memory is not None else np.zeros(self.sub.size)
        cost[self._unsupported(c, x)] = math.inf
        cost[self.owner == self.sub] = 0.0
        return cost

    def _frontier_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """K (ideals x producers), |M(u)| and c_u for producers with a transfer cost."""
        g, p = self.problem.graph, self.problem
        super_of = {v: i for i, s in enumerate(self.con.nodes) for v in s.members}
        producers = [u for u in g if p.transfer_time(u) > 0 and any(True for _ in g.successors(u))]
        w = np.zeros((len(self.con.nodes), len(producers)), dtype=np.float32)
        size = np.zeros(len(producers), dtype=np.int32)
        for j, u in enumerate(producers):
            for m in (u, *g.successors(u)):
                w[super_of[m], j] += 1
                size[j] += 1
        k = np.rint(self.ideals.membership.astype(np.float32) @ w).astype(np.int32)
        c = np.array([p.transfer_time(u) for u in producers], dtype=np.float64)
        return k, size, c

    def _comm(self) -> np.ndarray:
        k, size, c = self._frontier_counts()
        partial = (k > 0) & (k < size)
        b = partial.astype(np.float64) @ c
        out = np.empty(self.sub.size, dtype=np.float64)
        indptr = self.ideals.sub_indptr
        for i in range(len(self.ideals)):
            self.tick()
            lo, hi = indptr[i], indptr[i + 1]
            subs = self.sub[lo:hi]
            f = np.flatnonzero(partial[i])
            ks = k[np.ix_(subs, f)]
            out[lo:hi] = b[subs] + ((ks == 0).astype(np.float64) - (ks == k[i, f])) @ c[f]
        return out


def _states(counts: Sequence[int]) -> list[tuple[int, ...]]:
    return sorted(itertools.product(*(range(n + 1) for n in counts)), key=sum)


def _run_dp(pc: _PairCosts, counts: Sequence[int],
            check: Callable[[], None] = lambda: None) -> dict[tuple[int, ...], np.ndarray]:
    n = len(pc.ideals)
    starts = pc.ideals.sub_indptr[:-1]
    full = tuple(counts)
    dp: dict[tuple[int, ...], np.ndarray] = {}
    for s in _states(counts):
        check()  # once per state: each is a pass over every pair
        if not any(s):
            dp[s] = np.full(n, math.inf)
            dp[s][0] = 0.0
            continue
        best = np.full(n, math.inf)
        for c, cost in enumerate(pc.costs):
            if s[c] == 0:
                continue
            prev = dp[s[:c] + (s[c] - 1,) + s[c + 1:]]
            if s == full:  # only the whole graph matters in the last state
                lo, hi = pc.ideals.sub_indptr[-2], pc.ideals.sub_indptr[-1]
                best[-1] = min(best[-1], np.maximum(prev[pc.sub[lo:hi]], cost[lo:hi]).min())
            else:
                best = np.minimum(best, np.minimum.reduceat(np.maximum(prev[pc.sub], cost), starts))
        dp[s] = best
    return dp


def _backtrack(pc: _PairCosts, dp: dict[tuple[int, ...], np.ndarray], counts: Sequence[int]):
    """Pieces (class index, forward-supernode indices) from the first to the last."""
    s, i = tuple(counts), len(pc.ideals) - 1
    target = dp[s][i]
    pieces: list[tuple[int, list[int]]] = []
    while i != 0:
        lo, hi = pc.ideals.sub_indptr[i], pc.ideals.sub_indptr[i + 1]
        for c, cost in enumerate(pc.costs):
            if s[c] == 0:
                continue
            prev_s = s[:c] + (s[c] - 1,) + s[c + 1:]
            cand = np.maximum(dp[prev_s][pc.sub[lo:hi]], cost[lo:hi])
            hits = np.flatnonzero(cand <= target)
            if hits.size:
                j = int(pc.sub[lo + hits[0]])
                if j != i:
                    diff = pc.ideals.membership[i] & ~pc.ideals.membership[j]
                    pieces.append((c, np.flatnonzero(diff).tolist()))
                s, i = prev_s, j
                break
        else:  # pragma: no cover - dp values always come from some candidate
            raise AssertionError("DP backtrack found no candidate")
    return pieces[::-1]


def pieces_to_stages(con: Contraction, classes: Sequence[DeviceClass], pieces) -> list[Stage]:
    """Stages from pieces ``(class index, supernode indices)``, first to last.

    Each piece takes the next unused device of its class and becomes a forward stage and, for
    training graphs, a backward stage (the supernodes' backward siblings, Tarnawski App. E.1).
    Stage order is not yet the execution order: pass the result to ``order_stages``.
    """
    used = [0] * len(classes)
    stages: list[Stage] = []
    for c, supers in pieces:
        device = classes[c].devices[used[c]]
        used[c] += 1
        fw = tuple(v for i in supers for v in con.nodes[i].forward)
        bw = tuple(v for i in supers for v in con.nodes[i].backward)
        stages += [Stage(device, part) for part in (fw, bw) if part]
    return stages


@dataclass(frozen=True)
class _Run:
    """The DP over one contraction (one backward order, :func:`~torchplace.solvers.contract.contractions`)."""

    backward_order: str
    con: Contraction
    ideals: Ideals
    pc: _PairCosts
    dp: dict[tuple[int, ...], np.ndarray]
    value: float  # the optimum over this contraction's splits


def _infeasible(problem: Problem, runs: Sequence[_Run], classes: Sequence[DeviceClass],
                counts: Sequence[int]) -> InfeasibleError:
    """The error for a problem with no feasible split, stating the smallest memory that would fit.

    The smallest per-device memory is itself a min-max contiguous split, with each piece's bytes as
    its cost; the same DP finds it (over every contraction searched).
    """
    need = min(
        float(_run_dp(_PairCosts(problem, r.con, r.ideals, classes, measure="memory"), counts)[tuple(counts)][-1])
        for r in runs
    )
    caps = sorted({c.memory for c in classes if c.memory is not None})
    if math.isinf(need):
        return InfeasibleError(
            "some operators cannot run on any of the given devices (no measured time for their kind); "
            "add a device of a kind that can run them, e.g. 'cpu'"
        )
    return InfeasibleError(
        f"the model does not fit: the best contiguous split needs {int(need)} bytes "
        f"({need / 2**30:.3f} GiB) on its fullest device, but the memory-limited devices have {caps} bytes; "
        f"raise max_memory to at least {int(need)} bytes per device or add devices",
        min_memory_bytes=int(need),
    )


def _dfs_order(con: Contraction) -> list[int]:
    """A topological order by depth-first traversal (Tarnawski Sec. 5.1.2): a node is taken as soon
    as all its predecessors are, newest ready node first, so branches stay together."""
    indegree = [0] * len(con.nodes)
    succ: list[list[int]] = [[] for _ in con.nodes]
    for u, v in con.edges:
        indegree[v] += 1
        succ[u].append(v)
    ready = [v for v in reversed(range(len(con.nodes))) if indegree[v] == 0]
    order: list[int] = []
    while ready:
        u = ready.pop()
        order.append(u)
        for v in sorted(succ[u], reverse=True):
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    return order


def _linearized(con: Contraction) -> Contraction:
    """The contraction with its supernodes renumbered along a DFS order and chained by it.

    A chain has ``n + 1`` ideals; each piece is an interval of a topological order, which is
    contiguous in the original graph (a path leaving an interval and coming back would pass a node
    ordered inside it).
    """
    order = _dfs_order(con)
    new = {old: i for i, old in enumerate(order)}
    chain = [(i, i + 1) for i in range(len(order) - 1)]
    edges = sorted({(new[u], new[v]) for u, v in con.edges} | set(chain))
    return Contraction(tuple(con.nodes[old] for old in order), tuple(edges))


_WAY_OUT = ("use method 'slicegraph' or 'auto' (--method auto), or coarsen the graph (place(..., fuse=True) or "
            "granularity='module')")


def _table_bytes(n: int, ideals: int, pairs: int, n_classes: int) -> int:
    """Bytes of the DP's tables: per pair its ideals' indices and one cost per class (with numpy
    temporaries), per ideal its membership as bool, float32 and float64 rows (measured: 60 bytes a
    pair with two classes, on BERT operator graphs)."""
    return pairs * (32 + 16 * n_classes) + ideals * n * 13 + 8 * n * n


def _admit(budget: Budget, n: int, ideals: int, pairs: int, n_classes: int) -> None:
    """Refuse tables that would not fit the memory budget (ModelTooLargeError)."""
    need = _table_bytes(n, ideals, pairs, n_classes)
    budget.admit_memory(need, f"the DP over {n:,} supernodes, {ideals:,} ideals and {pairs:,} ideal pairs")


def _runs(problem: Problem, classes: Sequence[DeviceClass], counts: Sequence[int], ideal_limit: int,
          linearize: bool, budget: Budget) -> list[_Run]:
    """The DP over every distinct contraction of the graph (one unless backward edges join classes)."""
    runs = []
    contracted = contractions(problem.graph)
    budget.check("contracting the graph")
    for order, con in contracted.items():
        if linearize:
            con = _linearized(con)
        n = len(con.nodes)
        if n < ideal_limit:  # (else enumerate_ideals refuses it at once) a chain's tables, the smallest there are
            _admit(budget, n, n + 1, (n + 1) * (n + 2) // 2, len(classes))
        ideals = enumerate_ideals(n, con.edges, ideal_limit, tick=budget.ticks("enumerating ideals", every=64))
        _admit(budget, n, len(ideals), ideals.pairs, len(classes))
        pc = _PairCosts(problem, con, ideals, classes, tick=budget.ticks("computing the pieces' costs", every=64))
        dp = _run_dp(pc, counts, lambda: budget.check("running the DP"))
        runs.append(_Run(order, con, ideals, pc, dp, float(dp[tuple(counts)][-1])))
    return runs


def solve(problem: Problem, *, ideal_limit: int = DEFAULT_IDEAL_LIMIT, linearize: bool = False,
          time_limit: float | None = None) -> Plan:
    """Optimal contiguous max-load split (Tarnawski Sec. 5.1.1), training included (Sec. 5.3).

    A training graph whose backward edges join colour classes is solved over both contractions
    (backward pieces in the forward pieces' device order, and in its reverse; see
    :mod:`~torchplace.solvers.contract`), which together are exactly the contiguous splits; the
    better wins (ties: the reverse order, the paper's mirror image).

    Args:
        problem: a throughput problem; devices are grouped into classes of identical devices.
        ideal_limit: stop with TooManyIdealsError past this many ideals (per contraction).
        linearize: DPL (Sec. 5.1.2): search only the splits along one DFS topological order,
            in O(|V|^2) pairs; the plan is contiguous but not proven optimal (status "feasible").
        time_limit: seconds for everything (contraction, ideals, pair costs, the DP); the DP has no
            plan before it ends, so the limit raises SolverLimitError. ``None``: no limit.

    Returns:
        A Plan whose objective is the optimal max-load among contiguous splits (status
        ``"optimal"``) and whose lower bound is the simple bound of :mod:`bounds`. ``meta`` holds
        the winning contraction's ``ideals``, ``ideal_pairs`` and ``backward_order``.

    Raises:
        TooManyIdealsError: if a contraction of the graph has more than ``ideal_limit`` ideals.
        InfeasibleError: if no contiguous split fits (memory, supported devices).
        SolverLimitError: if the time limit passed first.
        ModelTooLargeError: if the tables would not fit in the solver memory budget
            (:data:`torchplace.solvers.limits.MEMORY_BUDGET`).
    """
    budget = Budget("ideals DP", time_limit, way_out=_WAY_OUT)
    classes = device_classes(problem)
    counts = [len(c.devices) for c in classes]
    runs = _runs(problem, classes, counts, ideal_limit, linearize, budget)
    run = min(runs, key=lambda r: r.value)  # first on ties
    best = run.value
    if math.isinf(best):
        raise _infeasible(problem, runs, classes, counts)
    pieces = _backtrack(run.pc, run.dp, counts)
    stages = order_stages(problem.graph, pieces_to_stages(run.con, classes, pieces))
    plan = Plan.build(
        problem, stages, solver="dpl" if linearize else "dp", seconds=budget.elapsed(),
        lower_bound=simple_lower_bound(problem), status="feasible" if linearize else "optimal",
        meta={"ideals": len(run.ideals), "ideal_pairs": run.ideals.pairs, "dp_value": best, "contiguous": True,
              "backward_order": run.backward_order},
    )
    if not math.isclose(plan.objective, best, rel_tol=1e-9, abs_tol=1e-12):
        raise AssertionError(f"DP value {best} differs from the cost model's {plan.objective}")
    plan.seconds = budget.elapsed()
    return plan


def solve_linearized(problem: Problem, *, time_limit: float | None = None) -> Plan:
    """DPL (Tarnawski Sec. 5.1.2): :func:`solve` over the splits of one DFS topological order."""
    return solve(problem, linearize=True, time_limit=time_limit)
