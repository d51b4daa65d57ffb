"""The size of each MILP, counted from the problem's dimensions before the model is built.

Each function follows its builder's index sets, component by component (rows: constraints,
cols: variables, nonzeros: coefficients, counted per row from the formulation), without creating a
Pyomo object, so a model too large for the memory or the time can be refused at once
(:meth:`torchplace.solvers.limits.Budget.admit`). Counts agree with the built models within a few
per cent on rows and columns; nonzeros are approximate (rows whose terms Pyomo merges or drops).

The MOIRAI model has quadratically many rows: pairs of nodes that no path orders, per device both
can use, and pairs of transfers that may share a port. Those pairs are counted with descendant
bitsets (Python ints, one per node) without listing them; beyond :data:`BITSET_NODES` nodes the
model is refused on the count of node pairs alone (each costs a row or a descendant entry).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from math import comb
from typing import TYPE_CHECKING

from torchplace.problem import Problem
from torchplace.solvers.dp import device_classes
from torchplace.solvers.limits import ModelSize

if TYPE_CHECKING:
    from torchplace.solvers.milp.maxload import Units

__all__ = ["BITSET_NODES", "bottleneck_size", "latency_size", "maxload_size", "moirai_size", "mtpp_size"]

BITSET_NODES = 20_000
"""Largest graph whose node pairs are counted exactly (the bitsets take n^2 / 16 bytes)."""

_BYTES_PER_PAIR = 60  # a descendant-set entry or a listed pair of the MOIRAI builder's data


def _fanout_rows(units: Units, pays: Sequence[int]) -> tuple[int, int]:
    """(|IN|, |OUT|) of the max-load IP: (producer, consumer unit, paying device) triples."""
    into = sum(1 for ws in units.fanout.values() for w in ws for d in pays if (w, d) in units.allowed)
    out = sum(len(ws) for p, ws in units.fanout.items() for d in pays if (units.of[p], d) in units.allowed)
    return into, out


def maxload_size(problem: Problem, units: Units, contiguous: bool, symmetry: str) -> ModelSize:
    """Size of :func:`torchplace.solvers.milp.maxload.build` (Fig. 7, plus (16) when ``contiguous``)."""
    devices = problem.cluster.devices
    n_dev, pays = len(devices), [d for d, dev in enumerate(devices) if dev.pays_transfer]
    on = Counter(d for _, d in units.allowed)  # units allowed per device
    n_units, n_allowed, n_prod = len(units.members), len(units.allowed), len(units.fanout)
    into, out = _fanout_rows(units, pays)
    capped = [d for d, dev in enumerate(devices) if dev.memory_bytes is not None]
    cols = n_allowed + 2 * n_prod * len(pays) + 1
    rows = n_units + len(capped) + into + out + n_dev
    nnz = n_allowed + sum(on[d] for d in capped) + 3 * (into + out) + n_dev + n_allowed + 2 * n_prod * len(pays)
    size = ModelSize(rows, cols, nnz)
    if contiguous:
        size = _plus(size, _contiguity_size(problem, units))
    pairs = sum(len(c.devices) - 1 for c in device_classes(problem))
    if symmetry == "index":  # F, sym_prefix, sym_first
        size = _plus(size, ModelSize(2 * n_units * pairs, n_units * pairs, 6 * n_units * pairs))
    elif symmetry == "load":
        size = _plus(size, ModelSize(pairs, 0, 2 * pairs * (n_allowed // max(n_dev, 1) + 2 * n_prod)))
    return size


def _contiguity_size(problem: Problem, units: Units) -> ModelSize:
    """Lemma A.1's witness and rows per device on each side, and each side's device order."""
    g, n_dev = problem.graph, len(problem.cluster)
    backward = {v: g.record(v).backward for v in g}
    on = Counter(u for u, _ in units.allowed)  # devices allowed per unit
    same_side = [(u, v) for u, v in g.edges if backward[u] == backward[v]]
    sides = {backward[u] for u, v in same_side if units.of[u] != units.of[v]}
    sources = {u for u, _ in same_side}
    above = sum(on[units.of[v]] for v in units.nodes)
    cut = sum(on[units.of[u]] for u, v in same_side if units.of[u] != units.of[v])
    order = sum(on[units.of[v]] for v in sources if backward[v] in sides) * (n_dev - 1)
    tri = 2 * len(sides) * comb(n_dev, 3)
    link = 4 * comb(n_dev, 2) if len(sides) == 2 else 0  # the backward order is the forward one or its reverse
    rows = above + len(same_side) * n_dev + cut + tri + order + link
    cols = len(units.nodes) * n_dev + len(sides) * comb(n_dev, 2) + (len(sides) == 2)
    return ModelSize(rows, cols, 2 * above + 2 * len(same_side) * n_dev + 3 * cut + 3 * tri + 4 * order + 3 * link)


def _plus(a: ModelSize, b: ModelSize) -> ModelSize:
    return ModelSize(a.rows + b.rows, a.cols + b.cols, a.nonzeros + b.nonzeros, a.extra_bytes + b.extra_bytes)


def mtpp_size(problem: Problem, units: Units) -> ModelSize:
    """Size of :func:`torchplace.solvers.milp.mtpp.build` (Archer Fig. 3 over device classes)."""
    classes = device_classes(problem)
    k, n_cls, n_units = len(problem.cluster), len(classes), len(units.members)
    multi = n_cls > 1
    pays = any(c.pays_transfer for c in classes)
    edges = {(units.of[u], units.of[v]) for u, v in problem.graph.edges if units.of[u] != units.of[v]}
    cut = sum(len(ws) for ws in units.fanout.values()) if pays else 0
    producers = len(units.fanout) if pays else 0
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    rep = [index[c.devices[0]] for c in classes]
    unsupported = any((u, d) not in units.allowed for u in range(n_units) for d in rep)
    cols = n_units * (k - 1) + producers * k + (k * n_cls if multi else 0) + 1
    rows = n_units * max(k - 2, 0) + len(edges) * (k - 1) + 2 * cut * (k - 1) + k * n_cls + k
    nnz = 2 * n_units * max(k - 2, 0) + 2 * len(edges) * (k - 1) + 8 * cut * (k - 1)
    nnz += k * n_cls * (2 * n_units + producers + 2) + k * (2 * n_units + n_cls)
    if unsupported:
        rows, nnz = rows + n_units * k, nnz + n_units * k * (2 + n_cls)
    if multi:
        rows, nnz = rows + k + n_cls, nnz + 2 * k * n_cls
    return ModelSize(rows, cols, nnz)


def bottleneck_size(problem: Problem, units: Units, device: int, guess: bool) -> ModelSize:
    """Size of :func:`torchplace.solvers.milp.bounds.build_bottleneck` for ``device``'s class."""
    n_units, n_prod = len(units.members), len(units.fanout)
    in_s = sum(1 for u in range(n_units) if (u, device) in units.allowed)
    fan = sum(len(ws) for ws in units.fanout.values())
    cols, rows, nnz = in_s + 2 * n_prod + 1, 2 * fan + 3, 3 * 2 * fan + 2 * (in_s + 2 * n_prod) + in_s
    if guess:
        classes = device_classes(problem)
        rest = len(classes)
        paying = sum(1 for c in classes if c.pays_transfer)
        r = n_units * rest
        cols += r + 2 * n_prod * paying
        rows += n_units + 2 * fan * paying + 3 * rest
        nnz += n_units * (1 + rest) + 6 * fan * paying + 3 * rest * (n_units + 2 * n_prod)
    return ModelSize(rows, cols, nnz)


def latency_size(problem: Problem, q: int) -> ModelSize:
    """Size of :func:`torchplace.solvers.milp.latency.build` (Tarnawski Fig. 5, Fig. 6 for ``q > 1``)."""
    g, devs = problem.graph, problem.cluster.devices
    accels = [d for d in devs if d.pays_transfer]
    n, m = len(g), sum(1 for _ in g.edges)
    prods = sum(1 for v in g if any(True for _ in g.successors(v)))
    slots, nxt = len(accels) * q, len(accels) * (q - 1)
    capped = sum(1 for d in accels if d.memory_bytes is not None)
    sym = sum(1 for a, b in zip(accels, accels[1:]) if (a.kind, a.memory_bytes) == (b.kind, b.memory_bytes))
    colo = len(g) - len({r.colocation for _, r in g.records() if r.colocation is not None}) \
        - sum(1 for _, r in g.records() if r.colocation is None)
    cols = 2 * n * slots + n + 2 * prods * slots + n + 3 * slots + 1 + n * sym
    rows = (n + capped + 1 + 2 * m * slots + n + prods * slots + slots + n + m + n * slots
            + n * slots + 2 * m * slots + nxt + colo * (1 + len(accels)) + slots + n * nxt + 2 * n * sym)
    nnz = (n * (slots + 1) + capped * n * q + 6 * m * slots + 2 * n + 3 * prods * slots
           + slots * (2 + 2 * prods + n) + 2 * n + 3 * m + 3 * n * slots
           + 2 * n * slots + 5 * m * slots + 2 * nxt + colo * (2 + 2 * q * len(accels)) + slots * (n + 1)
           + 2 * n * nxt + n * sym * (2 * q + 3))
    return ModelSize(rows, cols, nnz)


def _descendants(order: Sequence[str], succ: Mapping[str, Sequence[str]]) -> list[int]:
    """Per node (topological position), the bitset of the positions of its descendants."""
    pos = {v: i for i, v in enumerate(order)}
    below = [0] * len(order)
    for i in range(len(order) - 1, -1, -1):
        mask = 0
        for w in succ[order[i]]:
            j = pos[w]
            mask |= below[j] | (1 << j)
        below[i] = mask
    return below


def _unordered_after(below: Sequence[int]) -> list[int]:
    """Per position ``i``, the bitset of later positions that no path from ``i`` reaches."""
    full = (1 << len(below)) - 1
    return [full & ~((1 << (i + 1)) - 1) & ~b for i, b in enumerate(below)]


def _pairs_within(members: int, later: Sequence[int], weight: Mapping[int, int] | None = None) -> int:
    """Unordered pairs (i before j, no path) inside the bitset ``members``; with ``weight``, each
    pair counts ``weight[i] * weight[j]`` (positions not in ``weight`` count 1)."""
    if weight is None:
        return sum((members & later[i]).bit_count() for i in _bits(members))
    groups: dict[int, int] = defaultdict(int)  # weight -> positions with it
    for i, w in weight.items():
        groups[w] |= 1 << i
    return sum(weight[i] * w * (members & later[i] & mask).bit_count()
               for i in _bits(members) for w, mask in groups.items())


def moirai_size(problem: Problem) -> ModelSize:
    """Size of :func:`torchplace.solvers.milp.moirai.build` (MOIRAI (4)-(8) with plan order).

    Raises:
        InfeasibleError: if some node can run on no device (as the builder would).
    """
    from torchplace.solvers.milp.moirai_data import _allowed, _links

    g, names = problem.graph, problem.cluster.names
    order = g.topological_order()
    n, n_dev, m = len(order), len(names), sum(1 for _ in g.edges)
    if n > BITSET_NODES:  # every node pair is a row or a descendant entry
        return ModelSize(n, n * n_dev, n, extra_bytes=_BYTES_PER_PAIR * comb(n, 2))
    p = _allowed(problem)
    link = _links(problem, p)
    can = {v: [k for k in names if (v, k) in p] for v in order}
    transfers = {(u, d) for u, v in g.edges for d in can[v] if any(k != d for k in can[u])}
    need = sum(1 for u, v in g.edges for d in can[v] if (u, d) in transfers)
    succ = {v: list(g.successors(v)) for v in order}
    below = _descendants(order, succ)
    later = _unordered_after(below)
    pos = {v: i for i, v in enumerate(order)}
    runs = {k: sum(1 << pos[v] for v in order if (v, k) in p) for k in names}
    node_pairs = sum(_pairs_within(mask, later) for mask in runs.values())  # PK
    anywhere = sum(1 << i for i in range(n))
    delta = _pairs_within(anywhere, [later[i] & _union(runs, can[v]) for i, v in enumerate(order)])
    into, into_free, out, out_free, free = _port_pairs(problem, link, later, pos)
    sinks = sum(1 for v in order if not succ[v])
    colo = sum(1 for _, r in g.records() if r.colocation is not None) - len(
        {r.colocation for _, r in g.records() if r.colocation is not None})
    caps = sum(1 for d in problem.cluster.devices if d.memory_bytes is not None)
    n_t, n_w, n_a = len(transfers), len(link), len(p)
    cols = n_a + 2 * n + 2 * n_t + n_w + delta + free + 1
    rows = (sinks + 3 * n_dev + n + colo * n_dev + caps + 2 * m + 2 * n_t + 3 * need + 2 * n_w
            + 4 * node_pairs + into + out + 3 * (into_free + out_free))
    nnz = (sinks * (2 + n_dev) + 3 * n_dev + 2 * n_a + 2 * n_w + n_a + 2 * colo * n_dev + caps * n
           + m * (2 + n_dev) + n_t * (2 + n_dev) + n_t + n_w + need * (9 + 2 * n_dev) + 5 * n_w + 2 * m
           + node_pairs * (2 * n_dev + 12) + (into + 3 * into_free) * 2 * n_dev + (out + 3 * out_free) * (2 + n_dev))
    comparable = comb(n, 2) - sum(b.bit_count() for b in later)
    return ModelSize(rows, cols, nnz, extra_bytes=_BYTES_PER_PAIR * (comparable + node_pairs + into + out))


def _union(runs: Mapping[str, int], devices: Sequence[str]) -> int:
    mask = 0
    for k in devices:
        mask |= runs[k]
    return mask


def _port_pairs(problem: Problem, link: Mapping[tuple[str, str, str], float], later: Sequence[int],
                pos: Mapping[str, int]) -> tuple[int, int, int, int, int]:
    """(QIn, QIn with a free order, QOut, QOut with a free order, free producer pairs) of
    :func:`~torchplace.solvers.milp.moirai_data.port_pairs`, counted without listing them."""
    into_d: dict[str, int] = defaultdict(int)  # d -> bitset of producers moving into d
    out_w: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # k -> producer -> transfers from k
    moving = {(u, d) for u, _, d in link}
    for u, d in moving:
        into_d[d] |= 1 << pos[u]
    for u, k, d in link:
        out_w[k][pos[u]] += 1
    into = sum(comb(b.bit_count(), 2) for b in into_d.values())
    into_free = sum(_pairs_within(b, later) for b in into_d.values())
    out = sum(comb(sum(w.values()), 2) for w in out_w.values())
    out_free = 0
    for w in out_w.values():
        members = sum(1 << i for i in w)
        out_free += _pairs_within(members, later, w)
    share = [0] * len(later)  # producers sharing some port with each producer
    for b in into_d.values():
        for i in _bits(b):
            share[i] |= b
    for w in out_w.values():
        b = sum(1 << i for i in w)
        for i in w:
            share[i] |= b
    free = sum((share[i] & later[i]).bit_count() for i in range(len(later)))
    return into, into_free, out, out_free, free


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
