"""What a device holding the contiguous piece ``I \\ I'`` costs, for every pair of ideals ``I' <= I``.

Tarnawski et al. 2020, Sec. 5.1.1, Fact 5.2: every contiguous set is ``I \\ I'`` for ideals
``I' <= I``; the ideals DP (:mod:`torchplace.solvers.dp`) reads one cost per pair and device
class. Costs are those of :mod:`torchplace.costmodel`, computed for all pairs at once with numpy:
compute and memory are prefix-sum differences; for transfers, a producer ``u`` (with
``M(u) = {u} + succ(u)``) pays iff ``M(u)`` is partly in the piece ``S``. Writing
``K[J, u] = |M(u) & J|`` and ``P(J) = {u : 0 < K[J, u] < |M(u)|}`` (the frontier of ``J``),

    comm(I \\ I') = B(I') + sum_{u in P(I)} c_u ([K[I', u] = 0] - [K[I', u] = K[I, u]])

with ``B(J) = sum_{u in P(J)} c_u``, for any nested sets ``I' <= I``, so each pair costs
O(|frontier of I|) instead of O(|V| + |E|).

A training :class:`~torchplace.problem.Pipeline` of ``m`` micro-batches makes memory affine in the
micro-batches ``k`` the device holds in flight (Piper 2021, Sec. 3.5 and App. A):

    keep(S, k)      = params + ceil(work / m) + k ceil(saved / m)
    recompute(S, k) = params + ceil(work / m) + k ceil(inputs / m) + ceil(saved / m)

and a recomputing piece's load adds its forward compute (:func:`torchplace.costmodel.memory`,
:func:`~torchplace.costmodel.device_cost`). ``inputs`` are the bytes of the forward values the
piece reads from outside (:func:`~torchplace.costmodel.stage_input_bytes`; 0 on a class that
reads other devices' values where they are, a CPU, as the cost model says). The DP under a
pipeline works on *upsets* (ideals of the reversed graph, Piper's downsets, Def. 4.1); there a
producer ``u`` outside ``S = F \\ F'`` that feeds ``S`` lies outside ``F``, so with
``A[J, u] = |succ_fw(u) & J|`` and ``Q(F) = {u not in F : A[F, u] > 0}``

    inputs(F \\ F') = sum_{u in Q(F)} out_u [A[F', u] < A[F, u]].

Only pieces holding a forward node take a pipeline position; the others (an orphaned backward
group's, Tarnawski App. E.1, or an empty device) hold ``m`` micro-batches as the cost model says.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from torchplace.problem import Pipeline, Problem
from torchplace.solvers.contract import Contraction
from torchplace.solvers.ideals import Ideals

__all__ = ["DeviceClass", "PairCosts", "Positions", "Tables", "device_classes", "training_pipeline"]


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


def training_pipeline(problem: Problem) -> Pipeline | None:
    """The problem's pipeline when it changes the cost model (a training problem), else None."""
    return problem.pipeline if problem.mode == "training" else None


def _per_microbatch(nbytes: np.ndarray, m: int) -> np.ndarray:
    return -(-nbytes // m)


@dataclass(frozen=True)
class Positions:
    """Micro-batches a piece holds in flight, by ``q``: the forward pieces after it (capped).

    1F1B (PipeDream-flush): the piece at position ``j`` of ``S`` holds ``min(m, S - j)``, i.e.
    ``min(m, q + 1)``; ``q`` only matters up to ``levels - 1 = min(m, devices) - 1``. GPipe (and no
    pipeline): one level, every piece holds ``m``.
    """

    levels: int
    microbatches: int
    one_f_one_b: bool

    @classmethod
    def of(cls, pipeline: Pipeline | None, devices: int) -> Positions:
        if pipeline is None:
            return cls(1, 1, False)
        m = pipeline.microbatches
        one_f_one_b = pipeline.schedule == "1f1b"
        return cls(max(1, min(m, devices)) if one_f_one_b else 1, m, one_f_one_b)

    def in_flight(self, q: int) -> int:
        return min(self.microbatches, q + 1) if self.one_f_one_b else self.microbatches

    def after(self, q: int) -> int:
        """The level above a piece holding a forward node, placed over ``q`` of them."""
        return min(q + 1, self.levels - 1)


class PairCosts:
    """The pieces' loads and byte counts, per pair (see the module docstring); a pipeline's
    cost arrays are :class:`Tables` over these.

    Attributes:
        owner, sub: the ideals ``I`` and ``I'`` of each pair (``owner == sub``: an empty piece).
        load: per class, compute (+ transfers when the class pays them); ``inf`` where the class
            cannot run some node; 0 for empty pieces.
        params: parameter bytes (+ working bytes without a pipeline: the published model).
        work, saved: working and saved-activation bytes of the whole batch (pipeline only).
        forward: per class, forward compute (what a recomputing piece runs twice; pipeline only).
        has_forward: whether the piece holds a forward node (pipeline only).
    """

    def __init__(self, problem: Problem, con: Contraction, ideals: Ideals, classes: Sequence[DeviceClass],
                 tick: Callable[[], None] = lambda: None):
        self.problem, self.con, self.ideals, self.classes, self.tick = problem, con, ideals, classes, tick
        self.owner = np.repeat(np.arange(len(ideals)), np.diff(ideals.sub_indptr))
        self.sub = ideals.sub_index
        self.empty = self.owner == self.sub
        x = ideals.membership.astype(np.float64)
        comm = self._comm() if any(c.pays_transfer for c in classes) else None
        self.bad = [self._diff(x, self._super_sum(lambda r, c=c: float(c.kind not in r.times))) > 0.5 for c in classes]
        self.load = [self._load(x, c, bad, comm) for c, bad in zip(classes, self.bad)]
        self.pipelined = training_pipeline(problem) is not None
        if not self.pipelined:
            self.params = self._bytes(x, lambda r: r.param_bytes + r.temp_bytes)
            return
        self.params = self._bytes(x, lambda r: r.param_bytes)
        self.work = self._bytes(x, lambda r: r.temp_bytes)
        self.saved = self._bytes(x, lambda r: r.saved_bytes)
        self.has_forward = self._diff(x, self._super_sum(lambda r: float(not r.backward))) > 0.5
        self.forward = [self._diff(x, self._super_sum(lambda r, c=c: r.times.get(c.kind, 0.0) * (not r.backward)))
                        for c in classes]
        self._inputs: np.ndarray | None = None

    # -- sums over pieces ----------------------------------------------------------------------
    def _super_sum(self, value: Callable) -> np.ndarray:
        g = self.problem.graph
        return np.array([math.fsum(value(g.record(v)) for v in s.members) for s in self.con.nodes])

    def _diff(self, x: np.ndarray, per_super: np.ndarray) -> np.ndarray:
        prefix = x @ per_super
        return prefix[self.owner] - prefix[self.sub]

    def _bytes(self, x: np.ndarray, value: Callable) -> np.ndarray:
        """Exact integer sums (float64 prefix sums are exact below 2**53 bytes)."""
        return np.rint(self._diff(x, self._super_sum(value))).astype(np.int64)

    def _load(self, x: np.ndarray, c: DeviceClass, bad: np.ndarray, comm: np.ndarray | None) -> np.ndarray:
        load = self._diff(x, self._super_sum(lambda r: r.times.get(c.kind, 0.0)))
        if c.pays_transfer and comm is not None:
            load = load + comm
        load[bad] = math.inf
        load[self.empty] = 0.0  # an empty device costs nothing
        return load

    # -- transfers (the frontier trick of the module docstring) ---------------------------------
    def _counts(self, producers: Sequence[str],
                members: Callable[[str], Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """``K`` (ideals x producers): how many of each producer's ``members`` each ideal holds;
        and how many members it has. Nodes in no supernode belong to a group that a safe
        contraction eliminated (:mod:`torchplace.solvers.reduce`, rule 3): every edge across
        such a group's boundary costs nothing, so they are left out of the count."""
        super_of = {v: i for i, s in enumerate(self.con.nodes) for v in s.members}
        w = np.zeros((len(self.con.nodes), len(producers)), dtype=np.float32)
        size = np.zeros(len(producers), dtype=np.int32)
        for j, u in enumerate(producers):
            if u not in super_of:  # its outputs stay inside its eliminated group
                continue
            for v in members(u):
                w[super_of[v], j] += 1
                size[j] += 1
        return np.rint(self.ideals.membership.astype(np.float32) @ w).astype(np.int32), size

    def _comm(self) -> np.ndarray:
        g, p = self.problem.graph, self.problem
        producers = [u for u in g if p.transfer_time(u) > 0 and any(True for _ in g.successors(u))]
        k, size = self._counts(producers, lambda u: (u, *g.successors(u)))
        c = np.array([p.transfer_time(u) for u in producers], dtype=np.float64)
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

    @property
    def inputs(self) -> np.ndarray:
        """Bytes of the forward values each piece reads from outside, over upsets (module docstring)."""
        if self._inputs is None:
            self._inputs = self._input_bytes()
        return self._inputs

    def _input_bytes(self) -> np.ndarray:
        g = self.problem.graph
        succ = {u: [v for v in g.successors(u) if not g.record(v).backward] for u, r in g.records()
                if not r.backward and r.output_bytes > 0}
        producers = [u for u, vs in succ.items() if vs]
        a, _ = self._counts(producers, succ.__getitem__)
        inside, _ = self._counts(producers, lambda u: (u,))
        nbytes = np.array([g.record(u).output_bytes for u in producers], dtype=np.float64)
        feeds = (a > 0) & (inside == 0)  # Q(F): outside F, feeding it
        out = np.empty(self.sub.size, dtype=np.int64)
        indptr = self.ideals.sub_indptr
        for i in range(len(self.ideals)):
            self.tick()
            lo, hi = indptr[i], indptr[i + 1]
            f = np.flatnonzero(feeds[i])
            out[lo:hi] = np.rint((a[np.ix_(self.sub[lo:hi], f)] < a[i, f]) @ nbytes[f])
        return out


class Tables:
    """The cost arrays one DP run reads: per device class and in-flight count ``k``, each pair's
    load, ``inf`` where it does not fit (``measure="load"``), or the fewest bytes it can take
    (``measure="memory"``, 0 on devices without a limit), for ``devices`` devices in all (default:
    the cluster's). Under a pipeline that allows it, a piece
    recomputes when keeping its activations does not fit (the lower load that fits: recomputing
    only adds load)."""

    def __init__(self, pc: PairCosts, pipeline: Pipeline | None, measure: str = "load", devices: int | None = None):
        self.pc, self.pipeline, self.measure = pc, pipeline, measure
        total = devices if devices is not None else sum(len(c.devices) for c in pc.classes)
        self.positions = Positions.of(pipeline, total)
        self._cache: dict[tuple[int, int], np.ndarray] = {}

    @property
    def recompute(self) -> bool:
        return self.pipeline is not None and self.pipeline.recompute

    def _memory(self, c: int, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Bytes of each pair on class ``c`` keeping its activations, and recomputing them (None if
        not allowed; a class that reads other devices' values in place keeps no copy of its inputs)."""
        pc, p = self.pc, self.pipeline
        if p is None:
            return pc.params, None
        m = p.microbatches
        held = np.where(pc.has_forward, k, m)  # a piece without forward nodes is not ranked: m
        fixed = pc.params + _per_microbatch(pc.work, m)
        saved = _per_microbatch(pc.saved, m)
        keep = fixed + held * saved
        if not p.recompute:
            return keep, None
        inputs = _per_microbatch(pc.inputs, m) if pc.classes[c].pays_transfer else 0
        return keep, fixed + held * inputs + saved

    def cost(self, c: int, k: int) -> np.ndarray:
        """Class ``c``'s cost of every pair for a piece holding ``k`` micro-batches in flight."""
        key = (c, k)
        if key not in self._cache:
            self._cache[key] = (self._load if self.measure == "load" else self._bytes_needed)(c, k)
        return self._cache[key]

    def _load(self, c: int, k: int) -> np.ndarray:
        cap, load = self.pc.classes[c].memory, self.pc.load[c]
        if cap is None:
            return load
        keep, again = self._memory(c, k)
        cost = np.where(keep <= cap, load, math.inf)
        if again is not None:
            redo = (keep > cap) & (again <= cap)
            cost[redo] = (load + self.pc.forward[c])[redo]
        cost[self.pc.empty] = 0.0
        return cost

    def _bytes_needed(self, c: int, k: int) -> np.ndarray:
        if self.pc.classes[c].memory is None:
            cost = np.zeros(self.pc.sub.size)
        else:
            keep, again = self._memory(c, k)
            cost = (keep if again is None else np.minimum(keep, again)).astype(np.float64)
        cost[self.pc.bad[c]] = math.inf
        cost[self.pc.empty] = 0.0
        return cost

    def recomputes(self, c: int, k: int, pair: int) -> bool:
        """Whether the piece of ``pair`` on class ``c`` with ``k`` in flight recomputes (it does
        only when keeping its activations does not fit)."""
        cap = self.pc.classes[c].memory
        if not self.recompute or cap is None or self.measure != "load":
            return False
        return bool(self._memory(c, k)[0][pair] > cap)
