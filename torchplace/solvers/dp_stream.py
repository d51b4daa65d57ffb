"""The ideals DP without the ideal-pair table: one ideal's sub-ideals at a time (issue 16, item 2).

The DP of :mod:`torchplace.solvers.dp` keeps every pair ``(I, I')`` with its costs, about 60 bytes
a pair: a layer graph with real branch parallelism (InceptionV3: 36,596 ideals, 5.8e8 pairs)
needs 35 GB. This variant computes the same recurrence ideal by ideal, in the order of
:mod:`~torchplace.solvers.ideals` (every sub-ideal first):

    dp[s][I] = min( min_c dp[s - e_c][I],                               (device left empty)
                    min_c min_{I' < I} max(dp[s - e_c][I'], cost_c(I \\ I')) )

with the pieces' costs of :mod:`~torchplace.solvers.paircosts` (compute and memory as prefix-sum
differences, transfers by the frontier of ``I``) computed for ``I``'s sub-ideals only, all states
``s`` at once. Memory is O(ideals x (states + producers + supernodes)) plus one ideal's
sub-ideals; the backtrack recomputes the costs of the ideals on the optimal chain. Without a
training pipeline only (a pipeline's memory depends on positions: :mod:`dp` keeps the tables).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from torchplace.problem import Problem
from torchplace.solvers.contract import Contraction
from torchplace.solvers.paircosts import DeviceClass

__all__ = ["StreamedDP", "stream_bytes"]


def stream_bytes(n: int, ideals: int, n_states: int, producers: int, widest: int) -> int:
    """Bytes the streamed DP holds: per ideal its below-mask, membership, prefix sums, frontier
    counts and DP row per state; per sub-ideal of the widest ideal a few float arrays per state."""
    return ideals * (ideals // 8 + n + 8 * (n_states + 4) + 5 * producers) + widest * 8 * (4 * n_states + 8)


class StreamedDP:
    """The DP of the module docstring over one contraction.

    Args:
        problem: a throughput problem without a training pipeline.
        con: the contraction; ``sets`` and ``below`` its ideals (bitsets, by size) and, per ideal,
            the bitset of the indices of its proper sub-ideals.
        classes, counts: device classes and how many devices of each.
        tick: called once per ideal (a time limit's check).
    """

    def __init__(self, problem: Problem, con: Contraction, sets: Sequence[int], below: Sequence[int],
                 classes: Sequence[DeviceClass], counts: Sequence[int], tick: Callable[[], None] = lambda: None):
        self.problem, self.con, self.sets, self.below = problem, con, sets, below
        self.classes, self.counts, self.tick = classes, tuple(counts), tick
        n = len(con.nodes)
        x = np.zeros((len(sets), n), dtype=np.float64)
        for i, s in enumerate(sets):
            if s:
                bits = np.unpackbits(np.frombuffer(s.to_bytes((n + 7) // 8, "little"), dtype=np.uint8), bitorder="little")
                x[i] = bits[:n]
        self.x = x
        g = problem.graph

        def per_super(value: Callable) -> np.ndarray:
            return np.array([math.fsum(value(g.record(v)) for v in s.members) for s in con.nodes])

        self.comp = [x @ per_super(lambda r, c=c: r.times.get(c.kind, 0.0)) for c in classes]
        self.bad = [x @ per_super(lambda r, c=c: float(c.kind not in r.times)) for c in classes]
        self.params = np.rint(x @ per_super(lambda r: r.param_bytes + r.temp_bytes))
        # what can bind at all: a class that runs every node, or holds the whole graph, skips the check
        self.may_be_bad = [bool(b[-1] > 0.5) for b in self.bad]
        self.may_overflow = [c.memory is not None and self.params[-1] > c.memory for c in classes]
        self._frontier_counts()
        self.states = list(np.ndindex(*(k + 1 for k in self.counts)))  # s - e_c comes before s
        self.state_index = {s: i for i, s in enumerate(self.states)}
        self.dp = np.full((len(sets), len(self.states)), math.inf)  # dp[I][s]: rows gather fast

    # -- costs of one ideal's pieces ----------------------------------------------------------
    def _frontier_counts(self) -> None:
        g, p = self.problem.graph, self.problem
        super_of = {v: i for i, s in enumerate(self.con.nodes) for v in s.members}
        # a producer in no supernode sits in a group a safe contraction eliminated: its outputs stay
        # inside the group (every edge across that group's boundary is free), so it never pays
        producers = [u for u in g
                     if u in super_of and p.transfer_time(u) > 0 and any(True for _ in g.successors(u))]
        w = np.zeros((len(self.con.nodes), len(producers)), dtype=np.float32)
        size = np.zeros(len(producers), dtype=np.int32)
        for j, u in enumerate(producers):
            for v in (u, *g.successors(u)):
                w[super_of[v], j] += 1
                size[j] += 1
        self.k = np.rint(self.x.astype(np.float32) @ w).astype(np.int32)
        self.c = np.array([p.transfer_time(u) for u in producers], dtype=np.float64)
        self.partial = (self.k > 0) & (self.k < size)
        self.b = self.partial.astype(np.float64) @ self.c

    def subs(self, i: int, live: int = -1) -> np.ndarray:
        """Indices of ideal ``i``'s proper sub-ideals (those in the bitset ``live`` only)."""
        mask = self.below[i] & live
        if not mask:
            return np.zeros(0, dtype=np.int64)
        nbytes = (mask.bit_length() + 7) // 8
        bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits)

    def costs(self, i: int, subs: np.ndarray) -> list[np.ndarray]:
        """Per class, the cost of the piece ``I_i \\ I_j`` for each ``j`` in ``subs`` (``inf``
        where the class cannot run a node of it or it does not fit)."""
        comm = None
        if any(c.pays_transfer for c in self.classes):
            f = np.flatnonzero(self.partial[i])
            ks = self.k[np.ix_(subs, f)]
            comm = self.b[subs] + ((ks == 0).astype(np.float64) - (ks == self.k[i, f])) @ self.c[f]
        params = self.params[i] - self.params[subs] if any(self.may_overflow) else None
        out = []
        for ci, cls in enumerate(self.classes):
            load = self.comp[ci][i] - self.comp[ci][subs]
            if cls.pays_transfer and comm is not None:
                load += comm
            if self.may_be_bad[ci]:
                load[(self.bad[ci][i] - self.bad[ci][subs]) > 0.5] = math.inf
            if self.may_overflow[ci]:
                load[params > cls.memory] = math.inf
            out.append(load)
        return out

    # -- the DP ------------------------------------------------------------------------------
    def _less(self, s: tuple[int, ...], c: int) -> tuple[int, ...]:
        return s[:c] + (s[c] - 1,) + s[c + 1:]

    def run(self) -> float:
        """Fill the DP; return the optimum (``inf`` if nothing fits).

        Only pairs that can matter are costed: a sub-ideal ``I'`` whose row is ``inf`` in every
        source state is skipped (with one device used only ``I' = {}`` is finite), and the state
        that uses every device is filled for the whole graph alone (no other state reads it). With
        two devices this costs O(ideals) pieces instead of O(ideal pairs); the optimum, and the
        backtrack (which costs its own pairs), are unchanged."""
        dp, states = self.dp, self.states
        dp[0, 0] = 0.0  # the empty ideal with no device used
        full, last = self.state_index[self.counts], len(self.sets) - 1
        rows = {c: (np.array([self.state_index[s] for s in states if s[c]], dtype=np.int64),
                    np.array([self.state_index[self._less(s, c)] for s in states if s[c]], dtype=np.int64))
                for c in range(len(self.classes))}
        partial = {c: (to[to != full], frm[to != full]) for c, (to, frm) in rows.items()}
        empty = [[self.state_index[self._less(s, c)] for c in range(len(s)) if s[c]] for s in states]
        sources = [np.unique(np.concatenate([frm for _, frm in r.values()])) for r in (partial, rows)]
        live = [1 if np.isfinite(dp[0, cols]).any() else 0 for cols in sources]  # bitsets of useful sub-ideals
        for i in range(1, len(self.sets)):
            self.tick()
            whole = i == last
            subs = self.subs(i, live[whole])
            below = dp[subs]  # (sub-ideals, states): one gather for every class
            best = np.full(len(states), math.inf)
            for c, cost in enumerate(self.costs(i, subs)):
                to, frm = (rows if whole else partial)[c]
                if to.size:
                    vals = np.maximum(below[:, frm], cost[:, None]).min(axis=0, initial=math.inf)
                    best[to] = np.minimum(best[to], vals)
            row = best.tolist()
            for si, srcs in enumerate(empty):  # a device left empty: s - e_c comes first
                for sj in srcs:
                    if row[sj] < row[si]:
                        row[si] = row[sj]
            if not whole:
                row[full] = math.inf  # not computed: read by no state (module docstring)
            dp[i] = row
            for k, cols in enumerate(sources):
                if any(math.isfinite(row[j]) for j in cols.tolist()):
                    live[k] |= 1 << i
        return float(dp[-1, full])

    def pieces(self) -> list[tuple[int, list[int]]]:
        """The optimal split's pieces ``(class, supernodes)``, first to last."""
        s, i = self.counts, len(self.sets) - 1
        target = self.dp[i, self.state_index[s]]
        pieces: list[tuple[int, list[int]]] = []
        while i != 0:
            s, i, piece = self._step(s, i, target)
            if piece is not None:
                pieces.append(piece)
        return pieces[::-1]

    def _step(self, s: tuple[int, ...], i: int, target: float):
        subs = self.subs(i)
        costs = self.costs(i, subs)
        for c in range(len(s)):
            if s[c] == 0:
                continue
            prev = self.dp[:, self.state_index[self._less(s, c)]]
            if prev[i] <= target:
                return self._less(s, c), i, None
            hits = np.flatnonzero(np.maximum(prev[subs], costs[c]) <= target)
            if hits.size:
                j = int(subs[hits[0]])
                diff = self.x[i] > self.x[j]
                return self._less(s, c), j, (c, np.flatnonzero(diff).tolist())
        raise AssertionError("streamed DP backtrack found no candidate")  # pragma: no cover
