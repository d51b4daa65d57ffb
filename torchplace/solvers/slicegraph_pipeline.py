"""SliceGraph under a training Pipeline: each order sliced exactly at the pieces' 1F1B positions,
recomputing where keeping activations does not fit.

Archer et al. 2024, Algorithm 1 (:mod:`torchplace.solvers.slicegraph`) cuts a topological order
into segments. Under a :class:`~torchplace.problem.Pipeline` a segment's memory depends on the
forward segments *after* it (``min(m, S - j)`` micro-batches in flight under 1F1B), so, as the
ideals DP does (:mod:`torchplace.solvers.dp`; Piper 2021 Sec. 4), the order is sliced from its
end: over the reversed order, prefix ``j`` is the pipeline's last ``j`` supernodes and each new
segment goes in front, with the state carrying ``q``, the forward segments already placed:

    f[s][q][j] = min over c, i < j of max(f[s - e_c][q'][i], cost_c(seg[i:j], k(q')))

with ``q = min(q' + 1, levels - 1)``, ``k = min(m, q' + 1)`` (GPipe: one level, ``k = m``) for a
segment holding a forward node and ``q = q'``, ``k = m`` for one that does not (empty devices
and orphaned backward groups take no position; see :mod:`torchplace.solvers.paircosts`).
``cost_c`` is the load when keeping the activations fits, else (if allowed) the load plus the
forward compute when recomputing fits, else ``inf``; the memory terms are prefix-sum differences
and the inputs a recomputing segment keeps are a suffix sum of point masses, swept like the
transfers (a producer ``u`` outside ``[i, j)`` feeds it iff ``i <= `` the last position before
``j`` of a forward successor of ``u``, and ``u`` itself lies at or after ``j``). Windows are
pruned as in SliceGraph, by the compute prefix (``<= T``) and by the fewest bytes a segment can
take (``params + floor((work + saved) / m)``, monotone in the start).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from torchplace.problem import Pipeline, Problem
from torchplace.solvers.dp import Piece
from torchplace.solvers.paircosts import Positions, training_pipeline
from torchplace.solvers.slicegraph_order import _TOL, _Instance, _Lattice, _Timeout, _transfer_events

__all__ = ["PipeInstance", "prepare", "slice_order"]


@dataclass(frozen=True)
class PipeInstance:
    """Per-supernode bytes and forward parts (and the producers of forward inputs) of a problem."""

    pipeline: Pipeline
    positions: Positions
    params: np.ndarray  # (n,) bytes of parameters (gradients, optimizer state)
    work: np.ndarray  # (n,) working bytes of the whole batch
    saved: np.ndarray  # (n,) saved-activation bytes of the whole batch
    forward: np.ndarray  # (n,) forward nodes
    forward_time: np.ndarray  # (classes, n) forward compute (0 where the class cannot run it)
    floor: np.ndarray  # (n,) the fewest bytes a supernode adds to any segment
    out_bytes: np.ndarray  # per producer of a forward value read in another supernode
    home: np.ndarray  # per producer: its supernode
    indptr: np.ndarray  # CSR: the distinct other supernodes holding its forward readers
    readers: np.ndarray


def prepare(problem: Problem, inst: _Instance) -> PipeInstance:
    """The arrays :func:`slice_order` needs for ``problem`` (a training problem with a pipeline)."""
    p, g = training_pipeline(problem), problem.graph
    assert p is not None
    nodes = inst.con.nodes
    rec = dict(g.records())

    def per_super(value) -> np.ndarray:
        return np.array([sum(value(rec[v]) for v in s.members) for s in nodes], dtype=np.int64)

    params, work, saved = (per_super(lambda r, a=a: getattr(r, a))
                           for a in ("param_bytes", "temp_bytes", "saved_bytes"))
    fw_time = np.array([[math.fsum(rec[v].times.get(c.kind, 0.0) for v in s.forward) for s in nodes]
                        for c in inst.classes]).reshape(len(inst.classes), len(nodes))
    super_of = {v: i for i, s in enumerate(nodes) for v in s.members}
    out, home, indptr, readers = [], [], [0], []
    for u, r in rec.items():
        if r.backward or r.output_bytes <= 0:
            continue
        group = sorted({super_of[v] for v in g.successors(u) if not rec[v].backward} - {super_of[u]})
        if group:
            out.append(r.output_bytes)
            home.append(super_of[u])
            readers += group
            indptr.append(len(readers))
    m = p.microbatches
    return PipeInstance(p, Positions.of(p, sum(len(c.devices) for c in inst.classes)), params, work, saved,
                        per_super(lambda r: int(not r.backward)), fw_time, params + (work + saved) // m,
                        np.array(out, dtype=np.int64), np.array(home, dtype=np.int64),
                        np.array(indptr, dtype=np.int64), np.array(readers, dtype=np.int64))


def _input_events(pi: PipeInstance, pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point masses of the input bytes (module docstring), by the position that moves them: a
    reader's position takes its producer's mass from the previous reader's; the producer's own
    position removes it."""
    prod = np.repeat(np.arange(pi.out_bytes.size), np.diff(pi.indptr))
    p = pos[pi.readers]
    idx = np.lexsort((p, prod))
    prod, p = prod[idx], p[idx]
    c = pi.out_bytes[prod]
    first = np.r_[True, prod[1:] != prod[:-1]] if prod.size else np.zeros(0, dtype=bool)
    last = np.r_[prod[1:] != prod[:-1], True] if prod.size else np.zeros(0, dtype=bool)
    inner = ~first
    trig = np.concatenate([p, p[inner], pos[pi.home[prod[last]]]])
    index = np.concatenate([p, p[np.flatnonzero(inner) - 1], p[last]])
    delta = np.concatenate([c, -c[inner], -c[last]])
    by = np.argsort(trig, kind="stable")
    return np.searchsorted(trig[by], np.arange(n + 1), side="left"), index[by], delta[by]


@dataclass(frozen=True)
class _Layout:
    """Prefix sums along the reversed order; segments are ``order[i:j]``."""

    order: np.ndarray  # the reversed supernode order: the pipeline's end first
    base: np.ndarray  # (classes, n+1) compute
    fwt: np.ndarray  # (classes, n+1) forward compute
    params: np.ndarray  # (n+1,) and the byte counts below
    work: np.ndarray
    saved: np.ndarray
    lo: np.ndarray  # (classes, n+1) smallest start allowed for end j (support, fewest bytes)
    forward_end: np.ndarray  # (n+1,) segments [i, j) hold a forward node iff i < forward_end[j]
    comm: tuple[bool, ...]
    xfer: tuple[np.ndarray, np.ndarray, np.ndarray]  # transfer events (slicegraph)
    inputs: tuple[np.ndarray, np.ndarray, np.ndarray]  # input-bytes events


def _ceil(nbytes: np.ndarray, m: int) -> np.ndarray:
    """Bytes of one micro-batch (as :func:`torchplace.costmodel.memory` rounds them)."""
    return -(-nbytes // m)


def _cumsum(x: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(x.shape[:-1] + (1,), dtype=x.dtype), np.cumsum(x, axis=-1)], axis=-1)


def _layout(inst: _Instance, pi: PipeInstance, topo: np.ndarray) -> _Layout:
    order = topo[::-1].copy()
    n = inst.n
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    floor = _cumsum(pi.floor[order])
    lo = np.zeros((len(inst.classes), n + 1), dtype=np.int64)
    for c, cl in enumerate(inst.classes):
        lo[c, 1:] = np.maximum.accumulate(np.where(inst.bad[c, order], np.arange(1, n + 1), 0))
        if cl.memory is not None:
            lo[c] = np.maximum(lo[c], np.searchsorted(floor, floor - cl.memory, side="left"))
    ends = np.zeros(n + 1, dtype=np.int64)
    ends[1:] = np.maximum.accumulate(np.where(pi.forward[order] > 0, np.arange(1, n + 1), 0))
    comm = tuple(cl.pays_transfer for cl in inst.classes)
    empty = (np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    return _Layout(order, _cumsum(inst.times[:, order]), _cumsum(pi.forward_time[:, order]),
                   _cumsum(pi.params[order]), _cumsum(pi.work[order]), _cumsum(pi.saved[order]), lo, ends, comm,
                   _transfer_events(inst, pos) if any(comm) else empty, _input_events(pi, pos, n))


@dataclass
class _Tables:
    """The DP over one reversed order: rows are ``state * levels + q``."""

    f: np.ndarray
    g: np.ndarray
    arg_i: np.ndarray = field(repr=False)
    arg_c: np.ndarray = field(repr=False)
    arg_q: np.ndarray = field(repr=False)
    arg_rc: np.ndarray = field(repr=False)

    @classmethod
    def empty(cls, rows: int, n: int, levels: int) -> _Tables:
        f = np.full((rows, n + 1), math.inf)
        f[::levels, 0] = 0.0  # the empty suffix, with any devices, no forward segment
        g = np.full((rows, n + 1), math.inf)
        g[0, 0] = 0.0
        zeros = lambda dtype: np.zeros((rows, n + 1), dtype=dtype)  # noqa: E731
        return cls(f, g, zeros(np.int64), zeros(np.int64), zeros(np.int64), zeros(bool))


@dataclass
class Sliced:
    """One order's optimum; ``value`` is exact when ``exact``, else an upper bound."""

    lay: _Layout
    lattice: _Lattice
    levels: int
    value: float
    exact: bool
    tab: _Tables = field(repr=False)

    def pieces(self) -> list[Piece]:
        """The optimal segments, first to last in the pipeline (backtracking the tables)."""
        t, L = self.tab, self.levels
        j = self.lay.order.size
        row = self.lattice.full * L + int(np.argmin(t.f[self.lattice.full * L:(self.lattice.full + 1) * L, j]))
        out = []
        while j > 0:
            s, q = divmod(row, L)
            r2 = next(x * L + q for x in self.lattice.below(s) if t.g[x * L + q, j] <= t.f[row, j])
            c, i = int(t.arg_c[r2, j]), int(t.arg_i[r2, j])
            out.append(Piece(c, self.lay.order[i:j][::-1].tolist(), bool(t.arg_rc[r2, j])))  # topological
            row, j = (r2 // L - self.lattice.stride[c]) * L + int(t.arg_q[r2, j]), i
        return out


class _Row:
    """The candidates of one end ``j``: segment costs over a window, and the update of column ``j``."""

    def __init__(self, lay: _Layout, pi: PipeInstance, tab: _Tables, j: int, comm: np.ndarray | None,
                 inputs: np.ndarray, lo_sums: int):
        self.lay, self.pi, self.tab, self.j = lay, pi, tab, j
        self.comm, self.inputs, self.lo_sums = comm, inputs, lo_sums
        self.col = tab.g[:, j].copy()

    def costs(self, c: int, cap: int | None, a: int, b: int, held: int) -> tuple[np.ndarray, np.ndarray]:
        """Costs (and recomputation flags) of the segments ``[i, j)``, ``a <= i < b``, holding ``held``."""
        lay, j, m = self.lay, self.j, self.pi.pipeline.microbatches
        load = lay.base[c, j] - lay.base[c, a:b]
        if lay.comm[c]:
            load = load + self.comm[a - self.lo_sums:b - self.lo_sums]
        redo = np.zeros(b - a, dtype=bool)
        if cap is None:
            return load, redo
        fixed = lay.params[j] - lay.params[a:b] + _ceil(lay.work[j] - lay.work[a:b], m)
        saved = _ceil(lay.saved[j] - lay.saved[a:b], m)
        keep = fixed + held * saved
        cost = np.where(keep <= cap, load, math.inf)
        if self.pi.pipeline.recompute:
            again = fixed + held * _ceil(self.inputs[a - self.lo_sums:b - self.lo_sums], m) + saved
            redo = (keep > cap) & (again <= cap)
            cost = np.where(redo, load + lay.fwt[c, j] - lay.fwt[c, a:b], cost)
        return cost, redo

    def update(self, tgt: np.ndarray, src: np.ndarray, q_src: np.ndarray, c: int, a: int,
               cost: np.ndarray, redo: np.ndarray) -> None:
        """Segments ``[a + x, j)`` after the splits in rows ``src`` (levels ``q_src``), into rows ``tgt``."""
        cand = np.maximum(self.tab.f[src, a:a + cost.size], cost)
        best = cand.argmin(axis=1)
        val = cand[np.arange(src.size), best]
        better = val < self.col[tgt]
        t, j = tgt[better], self.j
        self.col[t] = val[better]
        self.tab.arg_i[t, j], self.tab.arg_c[t, j] = a + best[better], c
        self.tab.arg_q[t, j], self.tab.arg_rc[t, j] = q_src[better], redo[best[better]]


def _relax(row: _Row, lattice: _Lattice, pos: Positions, c: int, cap: int | None, start: int, last: bool) -> None:
    """Class ``c``'s segments ending at ``row.j``: forward ones from each level, the others within one."""
    tgt_s, src_s = lattice.moves[c][last]
    L, j = pos.levels, row.j
    split = min(max(int(row.lay.forward_end[j]), start), j)
    for q in range(L if split > start else 0):
        cost, redo = row.costs(c, cap, start, split, pos.in_flight(q))
        row.update(tgt_s * L + pos.after(q), src_s * L + q, np.full(src_s.size, q), c, start, cost, redo)
    if split < j:
        cost, redo = row.costs(c, cap, split, j, pos.microbatches)  # no forward node: not ranked, m
        levels = np.repeat(np.arange(L)[None, :], src_s.size, axis=0).reshape(-1)
        rows_src = (src_s[:, None] * L + np.arange(L)).reshape(-1)
        rows_tgt = (tgt_s[:, None] * L + np.arange(L)).reshape(-1)
        row.update(rows_tgt, rows_src, levels, c, split, cost, redo)


def _closure(lattice: _Lattice, levels: int, col: np.ndarray) -> np.ndarray:
    """``min_{s' <= s}`` at each level: devices may stay empty."""
    r = col.reshape(lattice.shape + (levels,))
    for axis in range(r.ndim - 1):
        r = np.minimum.accumulate(r, axis=axis)
    return r.reshape(-1)


def _sweep(d: np.ndarray, events: tuple[np.ndarray, np.ndarray, np.ndarray], j: int) -> None:
    indptr, index, delta = events
    a, b = indptr[j - 1], indptr[j]
    if a < b:
        np.add.at(d, index[a:b], delta[a:b])


def _run(inst: _Instance, pi: PipeInstance, lay: _Layout, lattice: _Lattice, bound: float,
         deadline: float | None) -> Sliced:
    n, pos = lay.order.size, pi.positions
    L = pos.levels
    tab = _Tables.empty(lattice.size * L, n, L)
    cut = bound * (1 + _TOL) + _TOL
    lo = np.maximum(lay.lo, np.stack([np.searchsorted(b, b - cut, side="left") for b in lay.base]))
    d_comm, d_in = np.zeros(n), np.zeros(n, dtype=np.int64)
    for j in range(1, n + 1):
        if deadline is not None and j % 128 == 0 and time.monotonic() > deadline:
            raise _Timeout
        _sweep(d_comm, lay.xfer, j)
        _sweep(d_in, lay.inputs, j)
        first = int(lo[:, j].min())
        comm = np.cumsum(d_comm[first:j][::-1])[::-1] if any(lay.comm) else None
        row = _Row(lay, pi, tab, j, comm, np.cumsum(d_in[first:j][::-1])[::-1], first)
        for c, cl in enumerate(inst.classes):
            if int(lo[c, j]) < j:
                _relax(row, lattice, pos, c, cl.memory, int(lo[c, j]), j == n)
        tab.g[:, j] = row.col
        tab.f[:, j] = _closure(lattice, L, row.col)
    full = lattice.full * L
    value = float(tab.f[full:full + L, n].min())
    return Sliced(lay, lattice, L, value, value <= cut, tab)


def slice_order(inst: _Instance, pi: PipeInstance, topo: np.ndarray, *, bound: float = math.inf, guess: float = 0.0,
                deadline: float | None = None) -> Sliced:
    """The best split of the topological supernode order ``topo`` under the pipeline; with a finite
    ``bound`` exact only if its value is ``<= bound`` (the window bound grows from ``guess`` as in
    :func:`torchplace.solvers.slicegraph_order._slice`)."""
    lay, lattice = _layout(inst, pi, topo), _Lattice([len(c.devices) for c in inst.classes])
    if math.isfinite(bound):
        return _run(inst, pi, lay, lattice, bound, deadline)
    widest = float((lay.base[:, -1] - lay.base[:, 0]).max(initial=0.0)) * 2 + float(lay.fwt[:, -1].max(initial=0.0))
    t = guess if guess > 0 else math.inf
    while True:
        res = _run(inst, pi, lay, lattice, t, deadline)
        if res.exact or math.isinf(t):
            return res
        t = res.value if math.isfinite(res.value) else (2 * t if 2 * t < widest else math.inf)
