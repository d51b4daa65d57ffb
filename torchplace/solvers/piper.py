"""Piper: data x tensor x pipeline parallelism with activation recomputation (Tarnawski,
Narayanan, Phanishayee, NeurIPS 2021, Sec. 3-4, App. A-D).

    dp[D][k][s] = min over downsets D' < D, d | N, t of
                  max(dp[D'][k - t d][s - d], TPS(D \\ D', t, d, s))

over downsets ``D`` (closed under successors, Def. 4.1: the ideals of the reversed graph, so
``D \\ D'`` is the *first* stage of the pipeline over ``D`` and ``s`` counts the data-parallel
degrees of it and every later stage), ``k`` devices and ``s <= min(N, K)``. Like the authors'
code, ``dp`` means "at most ``k`` devices and at most ``s``" (a monotone closure after each
``D``), which also makes one run answer every smaller device count.

``TPS(S, t, d, s)`` (Sec. 4) picks one TMPC per node by the knapsack of
:mod:`~torchplace.solvers.piper_knapsack` (the paper's heuristic, or HiGHS exactly); the stage
costs are :func:`torchplace.costmodel.piper_stage`'s, computed here for all ``t, d, y = ceil(s/d)``
at once. The table update for one ``(D, D', t, d)`` is one numpy ``maximum``/``minimum`` over the
``(k, s)`` grid (App. D's innermost loop, vectorised).

Baselines of Sec. 5 are options: ``data_parallel=False`` (no DP), ``tensor_parallel=False`` (no
TP), ``recompute=False`` (no AR); :mod:`~torchplace.solvers.piper_equi` is *equi*.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchplace import costmodel
from torchplace.errors import InfeasibleError, TooManyIdealsError, UsageError
from torchplace.plan import Plan, Stage
from torchplace.problem import Parallel, Problem
from torchplace.solvers import piper_knapsack
from torchplace.solvers.ideals import DEFAULT_IDEAL_LIMIT, enumerate_ideals
from torchplace.solvers.limits import Budget

__all__ = ["Tables", "run_dp", "solve", "work_lower_bound"]

_BLOCK = 256  # rows of the (k, s) grid updated at once

Knapsack = Callable[[np.ndarray, np.ndarray, np.ndarray, float, np.ndarray], tuple[np.ndarray, np.ndarray]]
KNAPSACKS: dict[str, Knapsack] = {"heuristic": piper_knapsack.heuristic, "exact": piper_knapsack.exact,
                                  "brute-force": piper_knapsack.brute_force}


@dataclass(frozen=True)
class _Arrays:
    """The TMPCs of one degree ``t`` as arrays over (node, slot); unusable slots cost ``inf``."""

    time: np.ndarray
    w: np.ndarray
    a: np.ndarray
    b: np.ndarray
    edge_in: np.ndarray  # (n, slots, n): 2 (c(u, v) + c^fw(u, v)) at [v, slot, u]
    edge_out: np.ndarray  # (n, slots, n): 2 (c(v, w) + c^bw(v, w)) at [v, slot, w]
    has: np.ndarray  # (n,) the node has a usable TMPC for t
    ids: list[list[str]]


def _arrays(problem: Problem, order: list[str], t: int, recompute: bool) -> _Arrays:
    g = problem.graph
    index = {v: i for i, v in enumerate(order)}
    n = len(order)
    lists = [[x for x in g.record(v).tmpcs.get(t, ()) if recompute or not x.recompute] for v in order]
    slots = max(1, max(len(xs) for xs in lists))
    time_ = np.full((n, slots), np.inf)
    w, a, b = (np.zeros((n, slots)) for _ in range(3))
    e_in, e_out = np.zeros((n, slots, n)), np.zeros((n, slots, n))
    for i, (v, xs) in enumerate(zip(order, lists)):
        for j, x in enumerate(xs):
            time_[i, j], w[i, j], a[i, j], b[i, j] = x.time, x.param_bytes, x.mem_a, x.mem_b
            for u in g.predecessors(v):
                e_in[i, j, index[u]] = 2.0 * (g.edge_bytes(u, v) + x.sync_in.get(u, 0.0))
            for u in g.successors(v):
                e_out[i, j, index[u]] = 2.0 * (g.edge_bytes(v, u) + x.sync_out.get(u, 0.0))
    has = np.array([bool(xs) for xs in lists])
    return _Arrays(time_, w, a, b, e_in, e_out, has, [[x.id for x in xs] for xs in lists])


@dataclass
class Tables:
    """What one run of the DP leaves: ``dp[i]`` is the ``(K + 1, S + 1)`` table of downset ``i``
    (``downsets.sets[i]``, bitsets over ``order``); ``dp[-1][k, s]`` is the best time per sample
    with at most ``k`` devices and data-parallel degrees summing to at most ``s``."""

    order: list[str]
    downsets: object
    dp: list[np.ndarray]
    options: list[tuple[int, int]]  # the (t, d) pairs searched
    seconds: float


class _Stages:
    """``TPS(D \\ D', t, d, y)`` for all ``(t, d)`` and ``y``, and the TMPC picks behind them."""

    def __init__(self, problem: Problem, order: list[str], *, data_parallel: bool, tensor_parallel: bool,
                 recompute: bool, knapsack: Knapsack) -> None:
        par = problem.parallel
        assert par is not None
        self.par, self.knapsack = par, knapsack
        self.smax = par.max_in_flight
        degrees = sorted({t for v in order for t in problem.graph.record(v).tmpcs})
        if not tensor_parallel:
            degrees = [t for t in degrees if t == 1]
        self.arrays = {t: _arrays(problem, order, t, recompute) for t in degrees if t <= par.devices}
        ds = [d for d in range(1, self.smax + 1) if par.microbatches % d == 0] if data_parallel else [1]
        self.options = [(t, d) for t in self.arrays for d in ds if t * d <= par.devices]
        # the knapsack's columns for degree t: one per (d, y), y = 1..ceil(S/d)
        self.columns: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for t in self.arrays:
            dt = np.array([d for tt, d in self.options if tt == t], dtype=np.int64)
            if dt.size == 0:
                continue
            ny = -(-self.smax // dt)
            col_d = np.repeat(np.arange(dt.size), ny)
            col_y = np.concatenate([np.arange(1, m + 1) for m in ny]).astype(np.float64)
            self.columns[t] = (dt, col_d, col_y, np.concatenate([[0], np.cumsum(ny)]))

    def _costs(self, arr: _Arrays, idx: np.ndarray, outside: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Each node's time per sample in each TMPC for each ``d``: (nodes, slots, len(d))."""
        edge = (arr.edge_in[idx] @ outside) + (arr.edge_out[idx] @ outside)
        resync = costmodel.piper_resync_bytes(arr.w[idx][:, :, None], d, self.par.microbatches)
        return arr.time[idx][:, :, None] / d + (edge[:, :, None] / d + resync) / self.par.bandwidth

    def table(self, members: np.ndarray) -> dict[tuple[int, int], np.ndarray]:
        """``{(t, d): TPS over y = 1..ceil(S/d)}`` (``inf`` where nothing fits), feasible ones only.

        One knapsack call covers every ``(t, d, y)``: the columns of all degrees side by side."""
        idx = np.flatnonzero(members)
        outside = (~members).astype(np.float64)
        degrees = [t for t in self.columns if self.arrays[t].has[idx].all()]
        if not degrees:
            return {}
        width = sum(len(self.columns[t][1]) for t in degrees)
        slots = max(self.arrays[t].time.shape[1] for t in degrees)
        cost = np.full((idx.size, slots, width), np.inf)
        a, b = np.zeros_like(cost), np.zeros_like(cost)
        ys = np.empty(width)
        at = 0
        for t in degrees:
            arr, (dt, col_d, col_y, _) = self.arrays[t], self.columns[t]
            k, end = arr.time.shape[1], at + len(col_d)
            cost[:, :k, at:end] = self._costs(arr, idx, outside, dt.astype(np.float64))[:, :, col_d]
            a[:, :k, at:end] = arr.a[idx][:, :, None]
            b[:, :k, at:end] = arr.b[idx][:, :, None]
            ys[at:end] = col_y
            at = end
        values, _ = self.knapsack(cost, a, b, self.par.memory_limit, ys)
        out: dict[tuple[int, int], np.ndarray] = {}
        offset = 0
        for t in degrees:
            dt, _, _, starts = self.columns[t]
            for i, d in enumerate(dt):
                v = values[offset + starts[i]:offset + starts[i + 1]]
                if np.isfinite(v[0]):
                    out[t, int(d)] = v
            offset += int(starts[-1])
        return out

    def picks(self, members: np.ndarray, t: int, d: int, y: int, order: list[str]) -> dict[str, str]:
        """The TMPC id chosen for each node of the stage at ``(t, d, y)``."""
        idx = np.flatnonzero(members)
        arr = self.arrays[t]
        cost = self._costs(arr, idx, (~members).astype(np.float64), np.array([float(d)]))
        _, picks = self.knapsack(cost, arr.a[idx], arr.b[idx], self.par.memory_limit,
                                 np.array([float(y)]))
        return {order[i]: arr.ids[i][int(picks[j, 0])] for j, i in enumerate(idx)}


def _downsets(problem: Problem, order: list[str], ideal_limit: int):  # -> Ideals
    index = {v: i for i, v in enumerate(order)}
    reversed_edges = [(index[v], index[u]) for u, v in problem.graph.edges]  # ideals of G^R = downsets of G
    try:
        return enumerate_ideals(len(order), reversed_edges, ideal_limit)
    except TooManyIdealsError as e:  # its advice names solvers that take no Piper problem
        raise TooManyIdealsError(
            f"Piper's graph has more than {e.limit} downsets, too many for its DP; raise ideal_limit= (--ideal-limit), "
            "use method 'piper-equi' (equal stages, no downsets), or give a graph with fewer parallel branches",
            e.limit) from None


def run_dp(problem: Problem, stages: _Stages, order: list[str], ideal_limit: int = DEFAULT_IDEAL_LIMIT,
           budget: Budget | None = None, upper_bound: float = math.inf) -> Tables:
    """Fill ``dp`` for every downset (module docstring).

    ``upper_bound``: the time per sample of a known plan of this search space; entries above it
    are dropped (set to ``inf``), which skips most of the grid. ``dp[-1][K, S]`` stays exact, the
    other entries of the last table only where they are at most the bound.
    """
    start = time.perf_counter()
    par = stages.par
    K, S = par.devices, stages.smax
    cut = upper_bound * (1 + 1e-9)
    downsets = _downsets(problem, order, ideal_limit)
    if budget is not None:  # every table stays for the walk back; one of K = N = 65536 alone is 32 GiB
        budget.admit_memory((len(downsets) + 1) * (K + 1) * (S + 1) * 8, "Piper's (devices x in-flight) tables")
    member = downsets.membership
    dp: list[np.ndarray] = [np.zeros((K + 1, S + 1))]
    first = [(0, 0)]  # the first row (devices) and column (in flight) with a finite entry, per downset
    tmp = np.empty((K + 1, S + 1))
    for i in range(1, len(downsets)):
        if budget is not None:
            budget.check("filling Piper's table")
        cur = np.full((K + 1, S + 1), np.inf)
        subs = downsets.sub_index[downsets.sub_indptr[i]:downsets.sub_indptr[i + 1] - 1]  # self is last
        for j in subs:
            k0, s0 = first[j]
            if k0 > K:
                continue
            if budget is not None:
                budget.check("filling Piper's table")
            prev = dp[j]
            for (t, d), values in stages.table(member[i] & ~member[j]).items():
                kd = t * d
                # the largest y whose value is within the cut (the heuristic's values need not grow with y)
                within = np.flatnonzero(values <= cut)
                finite = int(within[-1]) + 1 if within.size else 0
                s_hi = min(S, d * finite)
                lo_k, lo_s = kd + k0, d + s0
                if lo_k > K or s_hi < lo_s:
                    continue
                s = np.arange(lo_s, s_hi + 1)
                row = values[(s + d - 1) // d - 1]
                # rows in blocks, each only up to s <= k: no plan has more in flight than devices,
                # and the closure over s fills the rest
                for r0 in range(lo_k, K + 1, _BLOCK):
                    r1 = min(K + 1, r0 + _BLOCK)
                    top = min(s_hi, r1 - 1)
                    if top < lo_s:
                        continue
                    view = tmp[r0:r1, lo_s:top + 1]
                    np.maximum(prev[r0 - kd:r1 - kd, lo_s - d:top + 1 - d], row[:top + 1 - lo_s], out=view)
                    target = cur[r0:r1, lo_s:top + 1]
                    np.minimum(target, view, out=target)
        np.minimum.accumulate(cur, axis=0, out=cur)
        np.minimum.accumulate(cur, axis=1, out=cur)
        if math.isfinite(upper_bound):
            cur[cur > cut] = np.inf
        fin = np.isfinite(cur)
        rows, cols = np.flatnonzero(fin[:, -1]), np.flatnonzero(fin[-1, :])
        first.append((int(rows[0]), int(cols[0])) if rows.size else (K + 1, S + 1))
        dp.append(cur)
    return Tables(order, downsets, dp, stages.options, time.perf_counter() - start)


def _reconstruct(tables: Tables, stages: _Stages, k: int, s: int) -> list[Stage]:
    """Walk back from ``dp[V][k][s]``: at each downset find a first stage whose value matches."""
    downsets, dp, order = tables.downsets, tables.dp, tables.order
    member = downsets.membership  # type: ignore[attr-defined]
    i, out, used = len(dp) - 1, [], 0
    while i != 0:
        target = dp[i][k, s]
        found = None
        subs = downsets.sub_index[downsets.sub_indptr[i]:downsets.sub_indptr[i + 1] - 1]  # type: ignore[attr-defined]
        for j in subs:
            members = member[i] & ~member[j]
            for (t, d), values in stages.table(members).items():
                if t * d > k or d > s:
                    continue
                sp = np.arange(d, s + 1)
                val = np.maximum(dp[j][k - t * d, sp - d], values[np.minimum((sp + d - 1) // d, len(values)) - 1])
                hit = np.flatnonzero(val <= target)
                if hit.size:
                    found = (j, t, d, int(sp[hit[0]]), members)
                    break
            if found:
                break
        if found is None:
            raise AssertionError(f"Piper reconstruction found no stage for downset {i} at k={k}, s={s}")
        j, t, d, s_used, members = found
        y = -(-s_used // d)
        nodes = tuple(v for v in order if members[order.index(v)])
        out.append(Stage(f"dev[{used}:{used + t * d}]", nodes, data_parallel=d, tensor_parallel=t,
                         tmpcs=stages.picks(members, t, d, y, order)))
        used += t * d
        i, k, s = j, k - t * d, s_used - d
    return out


def work_lower_bound(problem: Problem) -> float:
    """A proven bound on any plan's time per sample: every node needs at least
    ``min over t, X of t * X.p`` device-seconds per sample, shared by at most ``K`` devices."""
    par = problem.parallel
    assert par is not None
    total = math.fsum(min(t * x.time for t, xs in r.tmpcs.items() for x in xs) for _, r in problem.graph.records())
    return total / par.devices


def solve(problem: Problem, *, data_parallel: bool = True, tensor_parallel: bool = True, recompute: bool = True,
          knapsack: str = "heuristic", prune: bool = True, ideal_limit: int = DEFAULT_IDEAL_LIMIT,
          time_limit: float | None = None) -> Plan:
    """Piper's plan: stages with data-parallel degree ``d``, tensor-parallel degree ``t`` and a
    TMPC per node, minimising the time per sample (module docstring).

    Args:
        problem: a problem with a :class:`~torchplace.problem.Parallel` setting and TMPCs on its
            nodes (e.g. :func:`torchplace.workloads.read_piper`).
        data_parallel, tensor_parallel, recompute: ``False`` gives the paper's no-DP, no-TP and
            no-AR baselines (d = 1; t = 1; no TMPC that recomputes).
        knapsack: ``"heuristic"`` (the paper's), ``"exact"`` (HiGHS MIP per subproblem; slow) or
            ``"brute-force"`` (tiny stages only).
        prune: drop table entries worse than the best *equi* plan of the same search space
            (:mod:`~torchplace.solvers.piper_equi`): the answer is the same, found faster.
        ideal_limit: stop with TooManyIdealsError past this many downsets.
        time_limit: seconds; past it SolverLimitError.

    Returns:
        A validated Plan (objective = :func:`torchplace.costmodel.evaluate`); status
        ``"optimal"`` (among Piper's configurations) with an exact knapsack, ``"feasible"`` with the
        heuristic; the lower bound is :func:`work_lower_bound`. ``meta``: ``dp_value``,
        ``devices_used``, ``in_flight``, ``downsets``, ``pairs``, ``dp_seconds``.

    Raises:
        UsageError: for a problem without a Parallel setting or an unknown knapsack.
        InfeasibleError: when no configuration fits in memory.
    """
    if problem.parallel is None:
        raise UsageError("method 'piper' needs a Piper problem (Problem.parallel, e.g. from "
                         "torchplace.workloads.read_piper); use another method for this problem")
    if knapsack not in KNAPSACKS:
        raise UsageError(f"unknown knapsack {knapsack!r}; choose one of {sorted(KNAPSACKS)}")
    start = time.perf_counter()
    budget = Budget("Piper DP", time_limit, way_out="use fewer devices or micro-batches")
    order = problem.graph.topological_order()
    stages = _Stages(problem, order, data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                     recompute=recompute, knapsack=KNAPSACKS[knapsack])
    bound = _equi_bound(problem, data_parallel, tensor_parallel, recompute) if prune else math.inf
    tables = run_dp(problem, stages, order, ideal_limit, budget, bound)
    par: Parallel = problem.parallel
    best = tables.dp[-1]
    if math.isfinite(bound) and not np.isfinite(best[par.devices, stages.smax]):
        # the heuristic knapsack found nothing within the equi plan's time: the bound pruned it all
        tables = run_dp(problem, stages, order, ideal_limit, budget)
        best = tables.dp[-1]
    if not np.isfinite(best[par.devices, stages.smax]):
        raise InfeasibleError(f"no Piper configuration fits in {par.memory_bytes / 2**30:.3g} GiB per device with "
                              f"{par.devices} devices and {par.microbatches} micro-batches; allow more memory, "
                              "more devices, recomputation or tensor parallelism")
    k, s = _smallest(best, par.devices, stages.smax)
    plan_stages = _reconstruct(tables, stages, k, s)
    exact = knapsack != "heuristic"
    return Plan.build(
        problem, plan_stages, solver="piper", seconds=time.perf_counter() - start,
        lower_bound=work_lower_bound(problem), status="optimal" if exact else "feasible",
        meta={"dp_value": float(best[par.devices, stages.smax]), "devices_used": k, "in_flight": s,
              "downsets": len(tables.dp), "pairs": int(tables.downsets.pairs) - len(tables.dp),  # type: ignore[attr-defined]
              "dp_seconds": tables.seconds, "knapsack": knapsack, "contiguous": True,
              "baseline": {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel,
                           "recompute": recompute}})


def _equi_bound(problem: Problem, data_parallel: bool, tensor_parallel: bool, recompute: bool) -> float:
    """The time per sample of the best equi plan that Piper's search space (with these options)
    contains, or ``inf`` if none fits."""
    from torchplace.solvers import piper_equi

    try:
        return piper_equi.solve(problem, data_parallel=data_parallel, tensor_parallel=tensor_parallel,
                                recompute=recompute).objective
    except InfeasibleError:
        return math.inf


def _smallest(best: np.ndarray, k: int, s: int) -> tuple[int, int]:
    """The fewest devices, then the smallest in-flight sum, that reach ``best[k, s]``."""
    target = best[k, s]
    kk = int(np.flatnonzero(best[:, s] <= target)[0])
    ss = int(np.flatnonzero(best[kk, :] <= target)[0])
    return kk, ss
