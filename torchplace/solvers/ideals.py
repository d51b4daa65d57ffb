"""Ideals (downward-closed sets) of a DAG, and which ideals contain which.

Tarnawski et al. 2020, Sec. 5.1.1, Def. 5.1: ``I`` is an ideal if ``v in I`` and ``(u, v) in E``
imply ``u in I``. Every contiguous set is ``I \\ I'`` for ideals ``I' <= I`` (Fact 5.2), so the
pairs ``(I, I')`` enumerate the contiguous sets a device may hold.

Ideals are Python ints used as bitsets over nodes ``0..n-1``; they are listed level by level
(by size), so every proper sub-ideal of an ideal comes before it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from torchplace.errors import TooManyIdealsError

__all__ = ["DEFAULT_IDEAL_LIMIT", "Ideals", "below_masks", "enumerate_ideals", "ideal_sets"]

DEFAULT_IDEAL_LIMIT = 20_000


@dataclass(frozen=True)
class Ideals:
    """All ideals of a DAG.

    Attributes:
        sets: bitsets, ordered by size; ``sets[0]`` is empty and ``sets[-1]`` is everything.
        membership: bool matrix ``(len(sets), n)``.
        sub_indptr, sub_index: CSR lists of sub-ideals: the ideals ``J <= sets[i]`` (``i`` itself
            included, last) are ``sub_index[sub_indptr[i]:sub_indptr[i+1]]``.
    """

    sets: list[int]
    membership: np.ndarray
    sub_indptr: np.ndarray
    sub_index: np.ndarray

    def __len__(self) -> int:
        return len(self.sets)

    @property
    def pairs(self) -> int:
        return int(self.sub_index.size)


def _too_many(limit: int) -> TooManyIdealsError:
    return TooManyIdealsError(
        f"the graph has more than {limit} ideals, too many for the exact DP; use method 'slicegraph' "
        "(--method slicegraph: SliceGraph over topological orders, polynomial in the nodes, fits any graph) "
        "or 'auto', raise ideal_limit= (--ideal-limit), or coarsen the graph "
        "(granularity='module' with leaf_modules=)",
        limit,
    )


def _levels(n: int, preds: Sequence[int], limit: int, tick: Callable[[], None]) -> tuple[list[int], list[list[int]]]:
    """Grow ideals one node at a time; return them and each ideal's immediate sub-ideals.

    Each ideal keeps its frontier (the nodes it could take next: outside it, every predecessor
    inside), so growing it visits those nodes only, in increasing order as a scan of all ``n``
    would, and the ideals come out in the same order."""
    succs: list[list[int]] = [[] for _ in range(n)]
    for v in range(n):
        p = preds[v]
        while p:
            low = p & -p
            succs[low.bit_length() - 1].append(v)
            p ^= low
    sets = [0]
    index = {0: 0}
    immediate: list[list[int]] = [[]]
    level = [(0, sum(1 << v for v in range(n) if not preds[v]))]
    while level:
        nxt: list[tuple[int, int]] = []
        for ideal, frontier in level:
            tick()
            me = index[ideal]
            f = frontier
            while f:
                bit = f & -f
                f ^= bit
                grown = ideal | bit
                j = index.get(grown)
                if j is None:
                    j = index[grown] = len(sets)
                    if j >= limit:
                        raise _too_many(limit)
                    sets.append(grown)
                    immediate.append([])
                    ready = frontier ^ bit
                    for w in succs[bit.bit_length() - 1]:
                        if not preds[w] & ~grown:
                            ready |= 1 << w
                    nxt.append((grown, ready))
                immediate[j].append(me)
        level = nxt
    return sets, immediate


def below_masks(immediate: list[list[int]], tick: Callable[[], None]) -> list[int]:
    """Per ideal, the bitset of the indices of its proper sub-ideals (the transitive closure of the
    immediate-sub relation). ``sum(m.bit_count()) + len(masks)`` is the number of ideal pairs."""
    below: list[int] = []
    for subs in immediate:
        tick()
        mask = 0
        for j in subs:
            mask |= below[j] | (1 << j)
        below.append(mask)
    return below


def _closure(below: list[int], tick: Callable[[], None]) -> tuple[np.ndarray, np.ndarray]:
    """The reflexive closure of ``below``, as CSR (self last)."""
    indptr = [0]
    chunks: list[np.ndarray] = []
    for i, mask in enumerate(below):
        tick()
        nbytes = (i + 8) // 8
        bits = np.unpackbits(np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little")
        idx = np.flatnonzero(bits).astype(np.int32)
        chunks.append(np.append(idx, np.int32(i)))
        indptr.append(indptr[-1] + idx.size + 1)
    return np.asarray(indptr, dtype=np.int64), np.concatenate(chunks)


def _no_tick() -> None:
    return None


def ideal_sets(n: int, edges: Sequence[tuple[int, int]], limit: int = DEFAULT_IDEAL_LIMIT,
               tick: Callable[[], None] = _no_tick) -> tuple[list[int], list[list[int]]]:
    """The ideals as bitsets by size, and each one's immediate sub-ideals (by index).

    Raises:
        TooManyIdealsError: if there are more than ``limit`` ideals (at once when ``n + 1``, the
            prefixes of a topological order, already are).
    """
    if n + 1 > limit:
        raise _too_many(limit)
    preds = [0] * n
    for u, v in edges:
        preds[v] |= 1 << u
    return _levels(n, preds, limit, tick)


def enumerate_ideals(n: int, edges: Sequence[tuple[int, int]], limit: int = DEFAULT_IDEAL_LIMIT,
                     tick: Callable[[], None] = _no_tick,
                     found: tuple[list[int], list[int]] | None = None) -> Ideals:
    """All ideals of the DAG on nodes ``0..n-1`` with ``edges``.

    Args:
        tick: called once per ideal while enumerating and closing (e.g. a time limit's check,
            :meth:`torchplace.solvers.limits.Budget.ticks`); what it raises propagates.
        found: ``(sets, below)`` from :func:`ideal_sets` and :func:`below_masks`, when the caller
            already has them (to count the pairs before building their table).

    Raises:
        TooManyIdealsError: if there are more than ``limit`` ideals (at once when ``n + 1``, the
            prefixes of a topological order, already are).
    """
    if found is None:
        sets, immediate = ideal_sets(n, edges, limit, tick)
        below = below_masks(immediate, tick)
    else:
        sets, below = found
    membership = np.zeros((len(sets), n), dtype=bool)
    for i, s in enumerate(sets):
        if s:
            bits = np.unpackbits(np.frombuffer(s.to_bytes((n + 7) // 8, "little"), dtype=np.uint8), bitorder="little")
            membership[i] = bits[:n].astype(bool)
    indptr, index = _closure(below, tick)
    return Ideals(sets, membership, indptr, index)
