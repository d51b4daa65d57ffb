"""The list-scheduling state shared by m-TOPO, m-ETF and m-SCT (Baechi, Jeon et al. 2020).

A :class:`ListState` is Baechi's execution simulator seen from the scheduler (Sec. 4.2): per
device its memory in use and the time it becomes free, per placed node its device, start and
finish, and the arrival time of every tensor already sent to a device (a device caches a received
tensor, so a producer is sent to a device at most once, as in :func:`torchplace.costmodel.simulate`).

Memory is the static model of :func:`torchplace.costmodel.memory` (``param_bytes + temp_bytes`` of
every node on the device), the one :meth:`torchplace.plan.Plan.validate` checks. A colocation group
reserves the memory of all its members when its first member is placed (Sec. 3.1, Sec. 4.2: "Baechi
reserves memory for a colocation group at device d when the first operator is placed"); later
members follow to that device.

Communication (Sec. 2.3, eq. (1); Sec. 3.4): by default every transfer starts when its producer
finishes and takes :meth:`Problem.link_time` (parallel communication). With
``sequential_comm=True`` each device has one outgoing and one incoming queue and a transfer waits
until both are free (Baechi's communication queues; the queue wait is added to eq. (1)).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

from torchplace.devices import Device
from torchplace.errors import InfeasibleError
from torchplace.plan import Plan, stages_from_order
from torchplace.problem import Problem
from torchplace.solvers.baechi.memsim import simulate_memory
from torchplace.solvers.dp_infeasible import kind_fix

__all__ = ["ListState", "check_latency"]

SCHEDULER_WAY_OUT = "coarsen the graph first (place(..., fuse=True) or granularity='module')"
"""What to do when a list scheduler runs out of time."""


def check_latency(problem: Problem, solver: str) -> None:
    """Raise ValueError unless ``problem`` asks for the latency objective (what list schedulers minimise)."""
    if problem.objective != "latency":
        raise ValueError(
            f"{solver} minimises the makespan of one sample; build the Problem with objective='latency' "
            f"(got {problem.objective!r})"
        )


def _groups(problem: Problem) -> tuple[dict[str, str], dict[str, list[str]]]:
    """node -> group key, group key -> members in topological order (a node alone is its own group)."""
    group_of: dict[str, str] = {}
    members: dict[str, list[str]] = defaultdict(list)
    for v in problem.graph.topological_order():
        c = problem.graph.record(v).colocation
        key = f"c:{c}" if c is not None else f"n:{v}"
        group_of[v] = key
        members[key].append(v)
    return group_of, dict(members)


class ListState:
    """Placement and timing bookkeeping of a list scheduler (see the module docstring).

    Args:
        problem: a latency problem.
        sequential_comm: model Baechi's sequential communication queues (Sec. 3.4).
        device_order: the devices in the order ties are broken (default: the cluster's order).
        check: called between the preparation's steps (a time limit's check).
    """

    def __init__(self, problem: Problem, *, sequential_comm: bool = False,
                 device_order: tuple[Device, ...] | None = None, check: Callable[[], None] = lambda: None) -> None:
        self.problem = problem
        self.sequential_comm = sequential_comm
        self.devices = device_order or problem.cluster.devices
        g = problem.graph
        self.topo = {v: i for i, v in enumerate(g.topological_order())}
        check()
        self.preds = {v: sorted(g.predecessors(v), key=self.topo.__getitem__) for v in self.topo}
        check()
        self.group_of, self.members = _groups(problem)
        records = dict(g.records())
        self.need = {k: sum(records[v].param_bytes + records[v].temp_bytes for v in m) for k, m in self.members.items()}
        check()
        kinds = {d.kind for d in self.devices}
        by_kind = {(v, kind): r.time_on(kind) for v, r in records.items() for kind in kinds}
        self.time = {(v, d.name): by_kind[v, d.kind] for v in self.topo for d in self.devices}
        check()
        runs_kind = {
            k: frozenset(kind for kind in kinds if all(math.isfinite(by_kind[v, kind]) for v in m))
            for k, m in self.members.items()
        }
        self.runs = {k: frozenset(d.name for d in self.devices if d.kind in on) for k, on in runs_kind.items()}
        check()
        self.by_name = {d.name: d for d in self.devices}
        self.used = dict.fromkeys(self.by_name, 0)
        self.avail = dict.fromkeys(self.by_name, 0.0)
        self.last: dict[str, str | None] = dict.fromkeys(self.by_name, None)
        self.group_device: dict[str, str] = {}
        self.device_of: dict[str, str] = {}
        self.start: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.arrival: dict[tuple[str, str], float] = {}
        self.out_port = dict.fromkeys(self.by_name, 0.0)
        self.in_port = dict.fromkeys(self.by_name, 0.0)
        self._link: dict[tuple[str, str, str], float] = {}

    # -- memory and colocation --------------------------------------------------------------------
    def free(self, device: str) -> float:
        cap = self.by_name[device].memory_bytes
        return math.inf if cap is None else cap - self.used[device]

    def can_host(self, v: str, device: str, limit: float = math.inf) -> bool:
        """Whether ``v`` may go to ``device``: its group is there already, or the device runs every
        member and has room for the whole group within its capacity and ``limit`` bytes of use."""
        k = self.group_of[v]
        if k in self.group_device:
            return self.group_device[k] == device
        need = self.need[k]
        return device in self.runs[k] and need <= self.free(device) and self.used[device] + need <= limit

    def hosts(self, v: str) -> list[str]:
        """Devices that may take ``v`` now, in tie-break order."""
        return [d.name for d in self.devices if self.can_host(v, d.name)]

    def infeasible(self, v: str, solver: str) -> InfeasibleError:
        """The error for a node no device can take (memory only fills, so it never will)."""
        k = self.group_of[v]
        what = f"node {v!r}" if k.startswith("n:") else f"node {v!r} (colocation group {k[2:]!r}, {len(self.members[k])} nodes)"
        if not self.runs[k]:
            return InfeasibleError(f"{solver}: {what} cannot run on any device (no time for their kinds); "
                                   f"{kind_fix(self.problem, self.members[k])}")
        free = ", ".join(f"{d} {self.free(d):.0f}" for d in sorted(self.runs[k]))
        return InfeasibleError(
            f"{solver}: {what} needs {self.need[k]} bytes but the devices that can run it have only "
            f"{free} bytes free after the nodes placed before it; raise their memory or add devices, or use "
            f"method 'moirai' (exact: it finds a placement wherever one exists) where this greedy order misses one",
            min_memory_bytes=None,
        )

    # -- time ---------------------------------------------------------------------------------------
    def link(self, u: str, src: str, dst: str) -> float:
        key = (u, src, dst)
        if key not in self._link:
            self._link[key] = self.problem.link_time(u, self.by_name[src], self.by_name[dst])
        return self._link[key]

    def data_ready(self, v: str, device: str, *, commit: bool = False) -> float:
        """When every input of ``v`` is on ``device`` (Baechi eq. (1), with queue waits if sequential).

        With ``commit`` the transfers it needs are recorded (arrivals cached, queues advanced).
        """
        ready = 0.0
        out_port = dict(self.out_port) if self.sequential_comm and not commit else self.out_port
        in_port = self.in_port[device]
        for u in sorted(self.preds[v], key=lambda u: (self.finish[u], self.topo[u])):
            src = self.device_of[u]
            if src == device:
                ready = max(ready, self.finish[u])
                continue
            if (u, device) in self.arrival:
                ready = max(ready, self.arrival[u, device])
                continue
            dur = self.link(u, src, device)
            begin = self.finish[u]
            if self.sequential_comm and dur > 0:
                begin = max(begin, out_port[src], in_port)
                out_port[src] = in_port = begin + dur
            ready = max(ready, begin + dur)
            if commit:
                self.arrival[u, device] = begin + dur
        if commit and self.sequential_comm:
            self.in_port[device] = in_port
        return ready

    def duration(self, v: str, device: str) -> float:
        return self.time[v, device]

    def place(self, v: str, device: str) -> None:
        """Put ``v`` on ``device`` at the earliest time its inputs and the device allow."""
        k = self.group_of[v]
        if k not in self.group_device:
            self.group_device[k] = device
            self.used[device] += self.need[k]
        self.start[v] = max(self.avail[device], self.data_ready(v, device, commit=True))
        self.finish[v] = self.avail[device] = self.start[v] + self.time[v, device]
        self.device_of[v] = device
        self.last[device] = v

    @property
    def makespan(self) -> float:
        return max(self.finish.values(), default=0.0)

    # -- result -------------------------------------------------------------------------------------
    def plan(self, solver: str, t0: float, meta: Mapping[str, Any] | None = None) -> Plan:
        """The scheduled order as a validated :class:`Plan` (non-contiguous, status ``"feasible"``)."""
        problem = dataclasses.replace(self.problem, contiguous=False)
        # start order is topological: a consumer starts no earlier than its producer finishes
        order = sorted(self.start, key=lambda v: (self.start[v], self.topo[v]))
        stages = stages_from_order(problem, order, self.device_of)
        info = {"scheduler_makespan": self.makespan, "sequential_comm": self.sequential_comm, **(meta or {})}
        plan = Plan.build(problem, stages, solver=solver, seconds=time.perf_counter() - t0,
                          lower_bound=_lower_bound(problem), status="feasible", meta=info)
        plan.meta["peak_memory"] = simulate_memory(problem, plan).peak
        plan.meta["static_memory"] = {d: self.used[d] for d in self.used if self.used[d]}
        plan.seconds = time.perf_counter() - t0
        return plan


def _lower_bound(problem: Problem) -> float:
    """The combinatorial latency bound (critical path and work over devices, transfers ignored)."""
    from torchplace.solvers.bounds import latency_lower_bound

    return latency_lower_bound(problem)
