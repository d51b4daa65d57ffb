"""The ideals DP for min max-load contiguous splits (Tarnawski et al. 2020, Sec. 5.1.1, 5.3, App. E).

    dp[s][I] = min over device classes c with s_c > 0, ideals I' <= I of
               max(dp[s - e_c][I'], cost_c(I \\ I'))

where ``s`` counts the devices of each class still unused (the paper's (k', l') for accelerators
and CPUs, generalised to any number of classes of identical devices) and ``I' = I`` means "leave
this device empty". Training graphs are handled by running the DP on the forward part with each
forward supernode carrying its backward sibling (Sec. 5.3, App. E.1; see ``contract``), once per
orientation of the backward pieces when backward edges join colour classes. The pieces' costs are
:mod:`torchplace.solvers.paircosts`.

Training with a :class:`~torchplace.problem.Pipeline` (Piper 2021, Sec. 3.5 and 4): under 1F1B a
piece's memory depends on the forward pieces *after* it (``min(m, S - j)`` micro-batches in
flight), so the DP runs over upsets (Piper's downsets, Def. 4.1: the ideals of the reversed
contraction), adding each piece in front of the pieces already placed, and carries their number
``q`` as Piper's ``dp[D][k][s]`` carries its suffix sum ``s``:

    dp[s][q][F] = min over c, F' <= F of max(dp[s - e_c][q'][F'], cost_c(F \\ F', k(q')))

with ``q = min(q' + 1, levels - 1)`` and ``k(q') = min(m, q' + 1)`` for a piece that holds a
forward node, and ``q = q'``, ``k = m`` for one that does not. Empty pieces (unused devices) keep
``q``, and so does the cost model: it ranks only the devices that run a forward stage
(:func:`torchplace.costmodel.in_flight`), so an unused device, or one holding only an orphaned
backward group, shifts no one's position; the forward stages keep the chain's order in the plan
(:func:`~torchplace.solvers.ordering.order_stages` is a stable topological sort, and every forward
edge between pieces points down the chain). ``cost_c`` keeps a piece's activations when that fits
and else recomputes them if the pipeline allows it (recomputing only adds load), so the DP is
optimal over contiguous splits and recomputation choices together; GPipe has one level (every
device holds ``m``).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from torchplace.errors import InfeasibleError, ModelTooLargeError, SolverError

from torchplace.plan import Plan, Stage
from torchplace.problem import Pipeline, Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.contract import Contraction, contractions
from torchplace.solvers.dp_infeasible import explain
from torchplace.solvers.dp_stream import StreamedDP, stream_bytes
from torchplace.solvers.ideals import DEFAULT_IDEAL_LIMIT, Ideals, below_masks, enumerate_ideals, ideal_sets
from torchplace.solvers.limits import Budget
from torchplace.solvers.ordering import order_stages
from torchplace.solvers.reduce import Reduced, reduce_contraction
from torchplace.solvers.paircosts import DeviceClass, PairCosts, Positions, Tables, device_classes, training_pipeline

__all__ = ["DeviceClass", "Piece", "device_classes", "pieces_to_stages", "run_dp", "solve", "solve_linearized"]

Table = dict[tuple[int, ...], np.ndarray]
"""``dp[s]``: an array (levels, ideals) of optimal max-loads."""


class Piece(NamedTuple):
    """A contiguous piece: its device class, its supernodes, whether its device recomputes."""

    cls: int
    supers: list[int]
    recompute: bool = False


def _states(counts: Sequence[int]) -> list[tuple[int, ...]]:
    return sorted(itertools.product(*(range(n + 1) for n in counts)), key=sum)


def _less(s: tuple[int, ...], c: int) -> tuple[int, ...]:
    return s[:c] + (s[c] - 1,) + s[c + 1:]


def _into(row: np.ndarray, vals: np.ndarray, starts: np.ndarray, last: bool) -> None:
    """``row[I] = min(row[I], min of vals over I's pairs)`` (only the whole graph's when ``last``)."""
    if last:
        row[-1] = min(row[-1], vals.min(initial=math.inf))
    else:
        np.minimum(row, np.minimum.reduceat(vals, starts), out=row)


def _relax(t: Tables, best: np.ndarray, prev: np.ndarray, c: int, last: bool) -> None:
    """Every way to put class ``c``'s next device in front of the splits in ``prev``."""
    pc, pos = t.pc, t.positions
    indptr = pc.ideals.sub_indptr
    pairs = slice(indptr[-2], indptr[-1]) if last else slice(None)  # last state: only the whole graph matters
    sub, starts = pc.sub[pairs], indptr[:-1]
    for q in range(pos.levels):
        if pos.levels > 1 and not np.isfinite(prev[q]).any():
            continue
        vals = np.maximum(prev[q][sub], t.cost(c, pos.in_flight(q))[pairs])
        if pos.levels == 1:
            _into(best[0], vals, starts, last)
            continue
        fw = pc.has_forward[pairs]
        _into(best[pos.after(q)], np.where(fw, vals, math.inf), starts, last)
        _into(best[q], np.where(fw, math.inf, vals), starts, last)


def run_dp(t: Tables, counts: Sequence[int], check: Callable[[], None] = lambda: None) -> Table:
    """The DP table over the states ``s <= counts`` (module docstring); ``check`` runs once per state."""
    n, levels, full = len(t.pc.ideals), t.positions.levels, tuple(counts)
    dp: Table = {}
    for s in _states(counts):
        check()  # once per state: each is a pass over every pair
        best = np.full((levels, n), math.inf)
        if not any(s):
            best[0, 0] = 0.0
        for c in range(len(counts)):
            if s[c]:
                _relax(t, best, dp[_less(s, c)], c, s == full)
        dp[s] = best
    return dp


def _step(t: Tables, dp: Table, s: tuple[int, ...], i: int, q: int, target: float):
    """One piece back from ``(s, q, I=i)``: the predecessor state and the piece (None if empty)."""
    pc, pos = t.pc, t.positions
    lo, hi = pc.ideals.sub_indptr[i], pc.ideals.sub_indptr[i + 1]
    for c in range(len(s)):
        if s[c] == 0:
            continue
        prev = dp[_less(s, c)]
        for q_src in range(pos.levels):
            k = pos.in_flight(q_src)
            ok = np.maximum(prev[q_src][pc.sub[lo:hi]], t.cost(c, k)[lo:hi]) <= target
            if pos.levels > 1:
                ok &= np.where(pc.has_forward[lo:hi], pos.after(q_src) == q, q_src == q)
            hits = np.flatnonzero(ok)
            if hits.size:
                pair = lo + int(hits[0])
                j = int(pc.sub[pair])
                diff = pc.ideals.membership[i] & ~pc.ideals.membership[j]
                piece = Piece(c, np.flatnonzero(diff).tolist(), t.recomputes(c, k, pair)) if j != i else None
                return _less(s, c), j, q_src, piece
    raise AssertionError("DP backtrack found no candidate")  # pragma: no cover - values come from candidates


def backtrack(t: Tables, dp: Table, counts: Sequence[int]) -> list[Piece]:
    """The optimal split's pieces in the order the DP added them (last piece first over ideals,
    first piece first over upsets)."""
    s, i = tuple(counts), len(t.pc.ideals) - 1
    q = int(np.argmin(dp[s][:, i]))
    target = dp[s][q, i]
    pieces: list[Piece] = []
    while i != 0:
        s, i, q, piece = _step(t, dp, s, i, q, target)
        if piece is not None:
            pieces.append(piece)
    return pieces


def pieces_to_stages(con: Contraction, classes: Sequence[DeviceClass], pieces: Sequence[tuple]) -> list[Stage]:
    """Stages from pieces (:class:`Piece`, or ``(class index, supernode indices)``), first to last.

    Each piece takes the next unused device of its class and becomes a forward stage and, for
    training graphs, a backward stage (the supernodes' backward siblings, Tarnawski App. E.1),
    both recomputing if the piece does. Stage order is not yet the execution order: pass the
    result to ``order_stages``.
    """
    used = [0] * len(classes)
    stages: list[Stage] = []
    for piece in map(lambda p: Piece(*p), pieces):
        device = classes[piece.cls].devices[used[piece.cls]]
        used[piece.cls] += 1
        fw = tuple(v for i in piece.supers for v in con.nodes[i].forward)
        bw = tuple(v for i in piece.supers for v in con.nodes[i].backward)
        stages += [Stage(device, part, piece.recompute) for part in (fw, bw) if part]
    return stages


@dataclass(frozen=True)
class _Run:
    """The DP over one contraction (one backward order, :func:`~torchplace.solvers.contract.contractions`)."""

    backward_order: str
    con: Contraction
    ideals: Ideals | None  # None when streamed
    tables: Tables | None
    dp: Table | None
    value: float  # the optimum over this contraction's splits
    upsets: bool  # run over upsets (a training pipeline): pieces come out first to last
    reduced: Reduced | None = None  # con is reduced.con, made by the safe rules of solvers/reduce.py
    streamed: StreamedDP | None = None  # the DP ran without the pair table (solvers/dp_stream.py)
    counts_ideals: tuple[int, int] = (0, 0)  # (ideals, ideal pairs)

    @property
    def source(self) -> Contraction:
        """The contraction the pieces index (the unreduced one)."""
        return self.reduced.original if self.reduced is not None else self.con

    def pieces(self, counts: Sequence[int]) -> list[Piece]:
        """The optimal split's pieces, first to last, over :attr:`source`'s supernodes."""
        if self.streamed is not None:
            pieces = [Piece(c, supers) for c, supers in self.streamed.pieces()]
        else:
            assert self.tables is not None and self.dp is not None
            pieces = backtrack(self.tables, self.dp, counts)
            pieces = pieces if self.upsets else pieces[::-1]
        if self.reduced is None:
            return pieces
        expanded = self.reduced.expand([p.supers for p in pieces])
        return [p._replace(supers=supers) for p, supers in zip(pieces, expanded)]


def _value(runs: Sequence[_Run], check: Callable[[], None]) -> Callable[[Pipeline | None, Sequence[int], str], float]:
    """The optimum over ``runs``'s pairs for another pipeline, device counts or measure (what
    :func:`~torchplace.solvers.dp_infeasible.explain` asks)."""
    def value(pipeline: Pipeline | None, counts: Sequence[int], measure: str) -> float:
        tables = [Tables(r.tables.pc, pipeline, measure, sum(counts)) for r in runs]
        return min(float(run_dp(t, counts, check)[tuple(counts)][:, -1].min()) for t in tables)
    return value


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


def _table_bytes(n: int, ideals: int, pairs: int, n_classes: int, levels: int = 0) -> int:
    """Bytes of the DP's tables: per pair its ideals' indices and one cost per class (with numpy
    temporaries), per ideal its membership as bool, float32 and float64 rows (measured: 60 bytes a
    pair with two classes, on BERT operator graphs). Under a pipeline (``levels`` > 0) each pair
    also has its byte counts, forward compute per class and a cost per class and level."""
    pipeline = pairs * (48 + 8 * n_classes * (1 + levels)) if levels else 0
    return pairs * (32 + 16 * n_classes) + ideals * n * 13 + 8 * n * n + pipeline


def _admit(budget: Budget, n: int, ideals: int, pairs: int, n_classes: int, levels: int) -> None:
    """Refuse tables that would not fit the memory budget (ModelTooLargeError)."""
    need = _table_bytes(n, ideals, pairs, n_classes, levels)
    budget.admit_memory(need, f"the DP over {n:,} supernodes, {ideals:,} ideals and {pairs:,} ideal pairs")


def _runs(problem: Problem, classes: Sequence[DeviceClass], counts: Sequence[int], ideal_limit: int,
          linearize: bool, budget: Budget, reduce: bool = True, stream: bool | None = None) -> list[_Run]:
    """The DP over every distinct contraction of the graph (one unless backward edges join classes);
    over its upsets under a training pipeline (module docstring); each contraction first shrunk by
    the safe rules of :mod:`~torchplace.solvers.reduce` when ``reduce`` (not under a pipeline, nor
    for DPL, whose order the rules would change)."""
    runs = []
    pipeline = training_pipeline(problem)
    levels = Positions.of(pipeline, sum(counts)).levels if pipeline is not None else 0
    contracted = contractions(problem.graph)
    budget.check("contracting the graph")
    for order, con in contracted.items():
        reduced = None
        if linearize:
            con = _linearized(con)
        elif reduce and pipeline is None:
            reduced = reduce_contraction(problem, con, budget.ticks("reducing the contraction", every=256))
            con = reduced.con
            budget.check("reducing the contraction")
        n = len(con.nodes)
        if n < ideal_limit:  # (else enumerate_ideals refuses it at once) a chain's tables, the smallest there are
            _admit(budget, n, n + 1, (n + 1) * (n + 2) // 2, len(classes), levels)
        edges = con.edges if pipeline is None else tuple((v, u) for u, v in con.edges)  # upsets: Piper Def. 4.1
        sets, immediate = ideal_sets(n, edges, ideal_limit, tick=budget.ticks("enumerating ideals", every=64))
        below = below_masks(immediate, budget.ticks("closing the ideals", every=64))
        del immediate
        pairs = len(sets) + sum(m.bit_count() for m in below)
        too_big = _table_bytes(n, len(sets), pairs, len(classes)) > budget.memory_bytes
        if pipeline is None and (stream or (stream is None and (too_big or sum(counts) <= 2))):
            runs.append(_streamed(problem, order, con, reduced, sets, below, pairs, classes, counts, budget))
            continue
        _admit(budget, n, len(sets), pairs, len(classes), levels)
        ideals = enumerate_ideals(n, edges, ideal_limit, tick=budget.ticks("listing ideal pairs", every=64),
                                  found=(sets, below))
        pc = PairCosts(problem, con, ideals, classes, tick=budget.ticks("computing the pieces' costs", every=64))
        tables = Tables(pc, pipeline)
        dp = run_dp(tables, counts, lambda: budget.check("running the DP"))
        value = float(dp[tuple(counts)][:, -1].min())
        runs.append(_Run(order, con, ideals, tables, dp, value, upsets=pipeline is not None, reduced=reduced,
                         counts_ideals=(len(ideals), ideals.pairs)))
    return runs


STREAM_SECONDS_PER_PAIR = 2.5e-9
"""Measured cost of one pair and state of the streamed DP on the 2-core benchmark machine
(its estimate of time, checked against the time limit before it starts)."""


def _streamed(problem: Problem, order: str, con: Contraction, reduced: Reduced | None, sets: list[int],
              below: list[int], pairs: int, classes: Sequence[DeviceClass], counts: Sequence[int],
              budget: Budget) -> _Run:
    """The DP of :mod:`~torchplace.solvers.dp_stream` when the pair table would not fit: admitted
    only if its own memory fits the budget and its estimated time the time left."""
    n, n_states = len(con.nodes), math.prod(k + 1 for k in counts)
    widest = max(m.bit_count() for m in below) + 1
    producers = sum(1 for u in problem.graph if problem.transfer_time(u) > 0)
    what = f"the streamed DP over {n:,} supernodes, {len(sets):,} ideals and {pairs:,} ideal pairs"
    budget.admit_memory(stream_bytes(n, len(sets), n_states, producers, widest), what)
    costed = pairs if sum(counts) > 2 else 2 * len(sets)  # two devices: O(ideals) pieces (StreamedDP.run)
    estimate = costed * n_states * len(classes) * STREAM_SECONDS_PER_PAIR
    left = budget.remaining()
    if left is not None and estimate > left:
        raise ModelTooLargeError(f"{budget.what}: {what} would take about {estimate:.0f} s, more than the "
                                 f"{left:.0f} s left of the time limit; {_WAY_OUT}", budget.time_limit)
    sd = StreamedDP(problem, con, sets, below, classes, counts, tick=budget.ticks("running the streamed DP", every=16))
    value = sd.run()
    return _Run(order, con, None, None, None, value, upsets=False, reduced=reduced, streamed=sd,
                counts_ideals=(len(sets), pairs))


def solve(problem: Problem, *, ideal_limit: int = DEFAULT_IDEAL_LIMIT, linearize: bool = False,
          time_limit: float | None = None, reduce: bool = True, stream: bool | None = None) -> Plan:
    """Optimal contiguous max-load split (Tarnawski Sec. 5.1.1), training included (Sec. 5.3).

    A training graph whose backward edges join colour classes is solved over both contractions
    (backward pieces in the forward pieces' device order, and in its reverse; see
    :mod:`~torchplace.solvers.contract`), which together are exactly the contiguous splits; the
    better wins (ties: the reverse order, the paper's mirror image).

    With a training :class:`~torchplace.problem.Pipeline` each piece is costed as the cost model
    costs its device: one micro-batch's working memory, its activations times the micro-batches
    in flight at its pipeline position (1F1B) or all ``m`` (GPipe), and, where keeping them does
    not fit and the pipeline allows it, recomputation (``Stage.recompute``, forward compute
    twice); the optimum is over contiguous splits and recomputation choices together (module
    docstring). The search runs over upsets then, so among equal optima it may pick another plan
    than without a pipeline.

    Args:
        problem: a throughput problem; devices are grouped into classes of identical devices.
        ideal_limit: stop with TooManyIdealsError past this many ideals (per contraction).
        linearize: DPL (Sec. 5.1.2): search only the splits along one DFS topological order,
            in O(|V|^2) pairs; the plan is contiguous but not proven optimal (status "feasible").
        reduce: first shrink each contraction by the safe rules of :mod:`~torchplace.solvers.reduce`
            (leaf merge, chain merge, free-node elimination; same optimum, often far fewer
            ideals). Not under a training pipeline, nor with ``linearize``.
        stream: run the DP ideal by ideal without the pair table (:mod:`~torchplace.solvers.dp_stream`;
            memory O(ideals x states)); ``None`` (default): when the table would not fit the memory
            budget, or for at most two devices (the stream then costs O(ideals) pieces, the table
            O(ideal pairs): 40 million pairs and 2.4 GB for a one-layer Whisper). Not under a
            training pipeline.
        time_limit: seconds for everything (contraction, ideals, pair costs, the DP); the DP has no
            plan before it ends, so the limit raises SolverLimitError. ``None``: no limit.

    Returns:
        A Plan whose objective is the optimal max-load among contiguous splits (status
        ``"optimal"``) and whose lower bound is the simple bound of :mod:`bounds` (recomputation
        only adds load, so it holds under a pipeline). ``meta`` holds the winning contraction's
        ``ideals``, ``ideal_pairs`` and ``backward_order``.

    Raises:
        TooManyIdealsError: if a contraction of the graph has more than ``ideal_limit`` ideals.
        InfeasibleError: if no contiguous split fits (memory, supported devices); its message
            says by how much (``min_memory_bytes``) and what would fit
            (:func:`~torchplace.solvers.dp_infeasible.explain`).
        SolverLimitError: if the time limit passed first.
        ModelTooLargeError: if the tables would not fit in the solver memory budget
            (:data:`torchplace.solvers.limits.MEMORY_BUDGET`).
    """
    budget = Budget("ideals DP", time_limit, way_out=_WAY_OUT)
    classes = device_classes(problem)
    # every used device holds a piece of at least one node, so no split uses more devices of a class
    # than there are nodes: the states past that add nothing (4,090 devices: 364k states for 3 nodes)
    counts = [min(len(c.devices), len(problem.graph)) for c in classes]
    runs = _runs(problem, classes, counts, ideal_limit, linearize, budget, reduce, stream)
    run = min(runs, key=lambda r: r.value)  # first on ties
    best = run.value
    if math.isinf(best) and stream is None and any(r.streamed is not None for r in runs):
        try:  # streamed by choice: the tables, where they fit, say what would fit
            runs = _runs(problem, classes, counts, ideal_limit, linearize, budget, reduce, stream=False)
        except ModelTooLargeError:
            pass
    if math.isinf(best) and any(r.streamed is not None for r in runs):
        raise InfeasibleError("no contiguous split fits the devices (memory, supported kinds); "
                              "add devices or memory, or use method 'slicegraph' to see what comes closest")
    if math.isinf(best):
        raise explain(problem, classes, counts, _value(runs, lambda: budget.check("finding what would fit")))
    stages = order_stages(problem.graph, pieces_to_stages(run.source, classes, run.pieces(counts)))
    plan = Plan.build(
        problem, stages, solver="dpl" if linearize else "dp", seconds=budget.elapsed(),
        lower_bound=simple_lower_bound(problem), status="feasible" if linearize else "optimal",
        meta={"ideals": run.counts_ideals[0], "ideal_pairs": run.counts_ideals[1], "streamed": run.streamed is not None, "dp_value": best, "contiguous": True,
              "backward_order": run.backward_order, "supernodes": len(run.con.nodes),
              "supernodes_before": len(run.source.nodes)},
    )
    if not math.isclose(plan.objective, best, rel_tol=1e-9, abs_tol=1e-12):
        times = [t for _, r in problem.graph.records() for t in r.times.values() if t > 0]
        if not times or max(times) < 1e12 * min(times):  # not a matter of precision: a bug of ours
            raise AssertionError(f"DP value {best} differs from the cost model's {plan.objective}")
        raise SolverError(f"the DP's sums lost precision (its optimum {best:.6g} is {plan.objective:.6g} in the cost "
                          f"model): the graph's times span {min(times, default=0):.3g} to {max(times, default=0):.3g} "
                          "s, beyond what float sums keep; leave a device a node cannot run out of its supported "
                          "devices instead of giving it a huge time, or use method 'slicegraph'")
    plan.seconds = budget.elapsed()
    return plan


def solve_linearized(problem: Problem, *, time_limit: float | None = None) -> Plan:
    """DPL (Tarnawski Sec. 5.1.2): :func:`solve` over the splits of one DFS topological order."""
    return solve(problem, linearize=True, time_limit=time_limit)
