"""Piper's knapsack subproblem (Sec. 4, App. C): one TMPC per node of a stage, least total time
per sample, memory ``sum a * y + b <= M`` for every in-flight count ``y`` at once.

Each function takes ``cost`` as an array ``(nodes, slots, C)`` (a node with fewer TMPCs pads its
slots with ``cost = inf``), ``a``, ``b`` as ``(nodes, slots)`` or per column, and ``ys``, the in-flight count of
each of the ``C`` columns (a column is one ``(d, y)``: the costs depend on ``d``, the memory on
``y``), and returns the best total cost per column (``inf`` where nothing fits) and the chosen
slot of every node per column.

* :func:`heuristic` — the paper's bang-per-buck rule: start from each node's fastest TMPC and,
  while memory is too high, take the swap with the least extra time per byte saved. For nodes
  with at most two TMPCs every ``y`` is done at once with one sort (the authors' fast variant).
* :func:`exact` — the same problem as a MIP, solved by HiGHS (to measure the heuristic's loss).
* :func:`brute_force` — every combination, for tests on tiny stages.
"""
from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import numpy as np

__all__ = ["brute_force", "exact", "heuristic"]

_EPS = 1e-9


def _mem(a: np.ndarray, b: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Memory of every (node, slot, column): ``a * y + b`` (``a``, ``b`` per column or shared)."""
    if a.ndim == 2:
        a, b = a[:, :, None], b[:, :, None]
    return a * ys[None, None, :] + b


def _columns(a: np.ndarray, b: np.ndarray, cols: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``a``, ``b`` of the columns ``cols`` and the first ``slots`` slots (shared ones stay shared)."""
    if a.ndim == 2:
        return a[:, :slots], b[:, :slots]
    return a[:, :slots][:, :, cols], b[:, :slots][:, :, cols]


def _take(x: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """``x[i, slot[i, c], c]`` for arrays (n, slots, C) and slot (n, C)."""
    n, c = slot.shape
    return x[np.arange(n)[:, None], slot, np.arange(c)[None, :]]


def heuristic(cost: np.ndarray, a: np.ndarray, b: np.ndarray, limit: float,
              ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Piper's greedy (Sec. 4, "The knapsack subproblem") for every column ``c`` at once: node
    costs ``cost[:, :, c]`` with ``y = ys[c]``. Returns values ``(C,)`` and picks ``(n, C)``."""
    n, slots, _ = cost.shape
    ys = np.asarray(ys, dtype=np.float64)
    fastest = np.argmin(cost, axis=1)  # (n, C); first of equals: deterministic
    if slots > 2:
        # by the TMPCs the nodes have, not the padding: a column's answer must not depend on what
        # it is solved beside (Piper's table pads every degree to the widest; its picks do not)
        wide = np.isfinite(cost[:, 2:, :]).any(axis=(0, 1))
        if wide.all():
            return _heuristic_loop(cost, a, b, limit, ys, fastest)
        values, picks = np.full(len(ys), np.inf), fastest.copy()
        two = ~wide  # the vectorised greedy, on the first two slots (a node's TMPCs come first)
        values[two], picks[:, two] = heuristic(cost[:, :2][:, :, two], *_columns(a, b, two, 2), limit, ys[two])
        if wide.any():
            values[wide], picks[:, wide] = _heuristic_loop(cost[:, :, wide], *_columns(a, b, wide, slots), limit,
                                                           ys[wide], fastest[:, wide])
        return values, picks
    mem = _mem(a, b, ys)
    base = _take(cost, fastest).sum(axis=0)
    mem_fast = _take(mem, fastest)
    excess = mem_fast.sum(axis=0) - limit
    values = np.where(excess <= 0, base, np.inf)
    picks = fastest.copy()
    if slots == 1:
        return values, picks
    hard = np.flatnonzero(excess > 0)  # only these need swaps
    if hard.size == 0:
        return values, picks
    f, ex = fastest[:, hard], excess[hard]
    other = 1 - f
    c_fast, c_other = _take(cost[:, :, hard], f), _take(cost[:, :, hard], other)
    valid = np.isfinite(c_other)
    extra = np.where(valid, c_other - c_fast, 0.0)  # >= 0
    saving = np.where(valid, mem_fast[:, hard] - _take(mem[:, :, hard], other), 0.0)
    useful = saving > _EPS
    ratio = np.where(useful, extra / np.where(useful, saving, 1.0), np.inf)
    order = np.argsort(ratio, axis=0, kind="stable")
    cum_sav = np.cumsum(np.take_along_axis(np.where(useful, saving, 0.0), order, axis=0), axis=0)
    cum_extra = np.cumsum(np.take_along_axis(np.where(useful, extra, 0.0), order, axis=0), axis=0)
    enough = cum_sav >= ex[None, :]  # the shortest prefix of swaps whose savings cover the excess
    feasible = enough[-1]
    taken = np.argmax(enough, axis=0) + 1
    total = base[hard] + np.take_along_axis(cum_extra, (taken - 1)[None, :], axis=0)[0]
    values[hard] = np.where(feasible, total, np.inf)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(n)[:, None], order.shape), axis=0)
    picks[:, hard] = np.where(rank < taken[None, :], other, f)
    return values, picks


def _heuristic_loop(cost: np.ndarray, a: np.ndarray, b: np.ndarray, limit: float, ys: np.ndarray,
                    fastest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The paper's greedy for any number of TMPCs (Sec. 4, "The knapsack subproblem"): one swap at
    a time from the current picks, the one with the highest ratio of memory saved to time added.
    On nodes with two TMPCs it takes the swaps of :func:`heuristic`'s sort, in its order."""
    n, _, C = cost.shape
    mem = _mem(a, b, ys)
    values = np.full(C, np.inf)
    picks = fastest.copy()
    rows = np.arange(n)
    for j in range(C):
        pick, m, c = fastest[:, j].copy(), mem[:, :, j], cost[:, :, j]
        while True:
            over = m[rows, pick].sum() - limit
            if over <= 0:
                values[j] = c[rows, pick].sum()
                picks[:, j] = pick
                break
            saving = m[rows, pick][:, None] - m
            extra = c - c[rows, pick][:, None]
            ok = (saving > _EPS) & np.isfinite(c)
            if not ok.any():
                break
            ratio = np.where(ok, extra / np.where(ok, saving, 1.0), np.inf)  # all bytes saved, as the paper
            i, slot = np.unravel_index(np.argmin(ratio), ratio.shape)
            pick[i] = slot
    return values, picks


def exact(cost: np.ndarray, a: np.ndarray, b: np.ndarray, limit: float,
          ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The multiple-choice knapsack solved to optimality by HiGHS (one MIP per column)."""
    n, slots, _ = cost.shape
    ys = np.asarray(ys, dtype=np.float64)
    values = np.full(len(ys), np.inf)
    picks = np.zeros((n, len(ys)), dtype=np.int64)
    mem = _mem(a, b, ys)
    rows = np.arange(n)
    for j in range(len(ys)):
        fastest = np.argmin(cost[:, :, j], axis=1)
        if mem[rows, fastest, j].sum() <= limit:  # the fastest TMPCs fit: no MIP needed
            values[j], picks[:, j] = cost[rows, fastest, j].sum(), fastest
            continue
        usable = np.where(np.isfinite(cost[:, :, j]), mem[:, :, j], np.inf)
        if usable.min(axis=1).sum() > limit:  # not even the smallest TMPCs fit
            continue
        values[j], picks[:, j] = _exact_one(cost[:, :, j], mem[:, :, j], limit)
    return values, picks


def _silent_highs() -> Any:
    """A ``highspy.Highs`` that prints nothing. The first one made in a process writes HiGHS's
    banner to file descriptor 1 from C++, before ``silent()`` can run: it would open
    ``torchplace solve --json``'s output. So it is made with that descriptor on ``os.devnull``."""
    import highspy

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    h.silent()
    return h


def _exact_one(cost: np.ndarray, mem: np.ndarray, limit: float) -> tuple[float, np.ndarray]:
    import highspy

    n, slots = cost.shape
    pick = np.zeros(n, dtype=np.int64)
    cells = [(i, s) for i in range(n) for s in range(slots) if np.isfinite(cost[i, s])]
    h = _silent_highs()
    inf = highspy.kHighsInf
    for i, s in cells:
        h.addVar(0.0, 1.0)
    h.changeColsCost(len(cells), np.arange(len(cells), dtype=np.int32), np.array([cost[i, s] for i, s in cells]))
    h.changeColsIntegrality(len(cells), np.arange(len(cells), dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * len(cells)))
    for node in range(n):  # one TMPC per node
        idx = np.array([k for k, (i, _) in enumerate(cells) if i == node], dtype=np.int32)
        h.addRow(1.0, 1.0, len(idx), idx, np.ones(len(idx)))
    idx = np.arange(len(cells), dtype=np.int32)  # memory; scaled to keep HiGHS's tolerances meaningful
    scale = limit if limit > 0 else 1.0  # a limit of 0 bytes (a device of less than one byte) fits only 0
    h.addRow(-inf, limit / scale, len(idx), idx, np.array([mem[i, s] / scale for i, s in cells]))
    h.setOptionValue("primal_feasibility_tolerance", 1e-10)
    h.setOptionValue("mip_feasibility_tolerance", 1e-10)
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return np.inf, pick
    x = np.asarray(h.getSolution().col_value)
    for k, (i, s) in enumerate(cells):
        if x[k] > 0.5:
            pick[i] = s
    if (mem[np.arange(n), pick]).sum() > limit:  # HiGHS's feasibility tolerance let it through
        return np.inf, pick
    return float(cost[np.arange(n), pick].sum()), pick


def brute_force(cost: np.ndarray, a: np.ndarray, b: np.ndarray, limit: float,
                ys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every combination of TMPCs (tiny stages only)."""
    n, slots, _ = cost.shape
    ys = np.asarray(ys, dtype=np.float64)
    values = np.full(len(ys), np.inf)
    picks = np.zeros((n, len(ys)), dtype=np.int64)
    rows = np.arange(n)
    mem_all = _mem(a, b, ys)
    for combo in itertools.product(range(slots), repeat=n):
        c = np.asarray(combo)
        total = cost[rows, c, :].sum(axis=0)
        mem = mem_all[rows, c, :].sum(axis=0)
        better = (mem <= limit) & (total < values)
        values[better] = total[better]
        picks[:, better] = c[:, None]
    return values, picks
