"""m-ETF: Earliest Task First with memory constraints (Baechi, Jeon et al. 2020, Sec. 2.3).

ETF (Hwang et al. 1989) repeatedly starts the (ready operator, device) pair with the earliest
schedulable time, eq. (1): the later of the device's available time and the arrival of the
operator's inputs. m-ETF drops a pair whose device lacks the memory for the operator (the head of
Baechi's queue is removed when it is not schedulable); since memory only fills up, an operator that
no device can take makes the problem infeasible for the scheduler.

Heterogeneous devices (``device_rule``). With identical devices, the pair of earliest start is also
the pair of earliest finish for that operator. With devices of different speed the earliest start
sends work to whichever device idles, e.g. a CPU 100x slower than an idle-in-a-moment GPU. So by
default (``device_rule="finish"``) each ready operator takes the device where it *finishes*
earliest (as HEFT does), and among ready operators the one that *starts* earliest goes first, as in
ETF. On identical devices this is exactly ETF (same pairs, same order); ``device_rule="start"``
gives Baechi's pair rule unchanged. Ties go to the device already holding more of the operator's
inputs, then to the cluster's order; between operators to the topological order.

The same loop runs m-SCT (:mod:`torchplace.solvers.baechi.sct`) given favourite children.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Literal

from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.baechi.state import SCHEDULER_WAY_OUT, ListState, check_latency
from torchplace.solvers.limits import Budget

__all__ = ["DeviceRule", "list_schedule", "m_etf"]

DeviceRule = Literal["finish", "start"]


def m_etf(problem: Problem, *, sequential_comm: bool = False, device_rule: DeviceRule = "finish",
          time_limit: float | None = None) -> Plan:
    """Place and order ``problem``'s nodes with m-ETF (Baechi Sec. 2.3).

    Args:
        problem: a latency problem (``objective="latency"``).
        sequential_comm: model one transfer at a time per device port in the scheduler's own
            estimate (Baechi Sec. 3.4); the cost model always serializes ports.
        device_rule: ``"finish"`` (default, see the module docstring) or ``"start"`` (Baechi's rule).
        time_limit: seconds for the whole schedule; a list scheduler has no plan before it has
            placed every node, so the limit raises :class:`SolverLimitError`.

    Returns:
        A ``"feasible"`` plan over ``dataclasses.replace(problem, contiguous=False)``; its objective
        is the cost model's simulation, ``meta["scheduler_makespan"]`` the scheduler's estimate.

    Raises:
        InfeasibleError: when a ready node fits on no device (naming it and the free bytes).
        SolverLimitError: when the time limit passes before every node is placed.
        ValueError: for a problem whose objective is not latency, or an unknown ``device_rule``.
    """
    t0 = time.perf_counter()
    check_latency(problem, "m-ETF")
    budget = Budget("m-ETF", time_limit, way_out=SCHEDULER_WAY_OUT)
    state = ListState(problem, sequential_comm=sequential_comm, check=lambda: budget.check("preparing"))
    list_schedule(state, solver="m-ETF", device_rule=device_rule, budget=budget)
    return state.plan("m-etf", t0, {"device_rule": device_rule})


def list_schedule(state: ListState, *, solver: str, device_rule: DeviceRule = "finish",
                  favourite_parent: Mapping[str, str] | None = None, budget: Budget | None = None) -> None:
    """Schedule every node of ``state``'s problem by the ETF rule.

    With ``favourite_parent`` (m-SCT), a ready node whose favourite parent was the last node placed
    on its device, and which that device can take, goes to that device ("pinned"); pinned nodes
    win ties on start time.

    Raises:
        InfeasibleError: when a ready node fits on no device.
        SolverLimitError: when ``budget``'s deadline passes before every node is placed.
    """
    tick = budget.ticks("scheduling", every=16) if budget is not None else (lambda: None)
    if device_rule not in ("finish", "start"):
        raise ValueError(f"device_rule must be 'finish' or 'start', got {device_rule!r}")
    g, topo = state.problem.graph, state.topo
    missing = {v: len(state.preds[v]) for v in topo}
    ready = {v: None for v in topo if missing[v] == 0}
    cache: dict[tuple[str, str], float] = {}
    while ready:
        tick()
        best: tuple[tuple[float, int, int], str, str] | None = None
        for v in ready:
            devices, pinned = _candidates(state, v, favourite_parent)
            if not devices:
                raise state.infeasible(v, solver)
            start, device = _best_device(state, v, devices, device_rule, cache)
            key = (start, 0 if pinned else 1, topo[v])
            if best is None or key < best[0]:
                best = (key, v, device)
        assert best is not None
        _, v, device = best
        state.place(v, device)
        del ready[v]
        for w in sorted(g.successors(v), key=topo.__getitem__):
            missing[w] -= 1
            if missing[w] == 0:
                ready[w] = None


def _candidates(state: ListState, v: str, favourite_parent: Mapping[str, str] | None) -> tuple[list[str], bool]:
    """Devices that may take ``v`` now, and whether m-SCT pins it to its favourite parent's device."""
    devices = state.hosts(v)
    p = favourite_parent.get(v) if favourite_parent else None
    if p is not None:
        dp = state.device_of[p]
        if state.last[dp] == p and dp in devices:
            return [dp], True
    return devices, False


def _best_device(state: ListState, v: str, devices: list[str], rule: DeviceRule,
                 cache: dict[tuple[str, str], float]) -> tuple[float, str]:
    """(start, device) of ``v`` on its best device under ``rule``."""
    best: tuple[tuple[float, float, int, int], float, str] | None = None
    for i, d in enumerate(devices):
        if state.sequential_comm:
            ready = state.data_ready(v, d)
        elif (v, d) in cache:
            ready = cache[v, d]
        else:
            ready = cache[v, d] = state.data_ready(v, d)
        start = max(state.avail[d], ready)
        finish = start + state.duration(v, d)
        local = sum(1 for u in state.preds[v] if state.device_of[u] == d)
        key = (finish, start, -local, i) if rule == "finish" else (start, finish, -local, i)
        if best is None or key < best[0]:
            best = (key, start, d)
    assert best is not None
    return best[1], best[2]
