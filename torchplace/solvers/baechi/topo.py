"""m-TOPO: topological-order placement with a per-device memory share (Baechi Sec. 2.2).

m-TOPO walks the operators in topological order and fills the devices one after another: each
device takes operators until its memory use would pass the share

    m_d = sum_v m_v / n + max_v m_v                                    (Baechi Sec. 2.2)

(total memory over the device count, plus the largest operator for outliers), then the next device
takes over. Each device runs its operators in topological order. A share of that size always
suffices: a device is left only when the next operator would push it past ``m_d``, i.e. with more
than ``sum m / n`` in use, so ``n`` devices never all close before every operator is placed.

Heterogeneity and constraints torchplace adds:

* Devices are filled fastest first (by the time the whole graph would take on each device, a node
  it cannot run counted at its slowest time elsewhere); Baechi fills by device id.
* ``m_v`` is a colocation group's static memory (params + temporaries of all members), reserved
  when the group's first member is placed (Sec. 3.1); later members follow the group.
* A node the current device cannot run goes to the next device in the order that can run it and
  has room, without moving the fill pointer. When no device has room within its share, the real
  capacities decide; when none has room at all the problem is infeasible for m-TOPO.
* ``share="capacity"`` fills each device up to its capacity instead (no balancing): everything
  lands on the fastest device when it fits there.
"""
from __future__ import annotations

import math
import time
from typing import Literal

from torchplace.devices import Device
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.baechi.state import SCHEDULER_WAY_OUT, ListState, check_latency
from torchplace.solvers.limits import Budget

__all__ = ["fastest_first", "m_topo"]

Share = Literal["balanced", "capacity"]


def m_topo(problem: Problem, *, share: Share = "balanced", sequential_comm: bool = False,
           time_limit: float | None = None) -> Plan:
    """Place ``problem``'s nodes with m-TOPO (Baechi Sec. 2.2).

    Args:
        problem: a latency problem.
        share: ``"balanced"`` (Baechi's per-device share ``m_d``) or ``"capacity"``.
        sequential_comm: sequential communication queues in the scheduler's estimate (Sec. 3.4).
        time_limit: seconds for the whole placement (no plan exists before every node is placed,
            so the limit raises :class:`SolverLimitError`).

    Returns:
        A ``"feasible"`` non-contiguous plan; ``meta["memory_share"]`` is ``m_d`` (``None`` for
        ``share="capacity"``), ``meta["device_order"]`` the fill order.

    Raises:
        InfeasibleError: when a node fits on no device.
        SolverLimitError: when the time limit passes before every node is placed.
        ValueError: for a non-latency problem or an unknown ``share``.
    """
    t0 = time.perf_counter()
    check_latency(problem, "m-TOPO")
    if share not in ("balanced", "capacity"):
        raise ValueError(f"share must be 'balanced' or 'capacity', got {share!r}")
    budget = Budget("m-TOPO", time_limit, way_out=SCHEDULER_WAY_OUT)
    order = fastest_first(problem)
    state = ListState(problem, sequential_comm=sequential_comm, device_order=order,
                      check=lambda: budget.check("preparing"))
    needs = state.need.values()
    limit = sum(needs) / len(state.devices) + max(needs, default=0) if share == "balanced" else math.inf
    pointer = 0
    tick = budget.ticks("placing", every=64)
    for v in state.topo:
        tick()
        k = state.group_of[v]
        if k in state.group_device:
            state.place(v, state.group_device[k])
            continue
        device, pointer = _fill(state, v, pointer, limit)
        state.place(v, device)
    return state.plan("m-topo", t0, {"memory_share": limit if share == "balanced" else None, "share": share,
                                      "device_order": [d.name for d in state.devices]})


def _fill(state: ListState, v: str, pointer: int, limit: float) -> tuple[str, int]:
    """The device for ``v``'s group and the new fill pointer (see the module docstring)."""
    n = len(state.devices)
    k = state.group_of[v]
    for cap in (limit, math.inf):
        for step in range(n):
            i = (pointer + step) % n
            if state.can_host(v, state.devices[i].name, cap):
                current_full = state.devices[pointer].name in state.runs[k]
                return state.devices[i].name, (i if step and current_full else pointer)
    raise state.infeasible(v, "m-TOPO")


def fastest_first(problem: Problem) -> tuple[Device, ...]:
    """The cluster's devices by the time the whole graph would take on each (stable)."""
    records = [r for _, r in problem.graph.records()]

    def total(kind: str) -> float:
        out = 0.0
        for r in records:
            t = r.time_on(kind)
            out += t if math.isfinite(t) else max((x for x in r.times.values() if math.isfinite(x)), default=0.0)
        return out

    by_kind = {kind: total(kind) for kind in {d.kind for d in problem.cluster.devices}}
    return tuple(sorted(problem.cluster.devices, key=lambda d: by_kind[d.kind]))
