"""The latency Integer Program of Tarnawski et al. 2020 (Sec. 4, App. A, Fig. 5; App. A.1, Fig. 6).

Tarnawski's model of one sample (App. A, "Computation model"): an accelerator subgraph ``S`` is
invoked atomically — once every input (an output of a node outside ``S`` with an edge into ``S``)
is in host DRAM, its inputs move in (``c_u`` each), all of ``S`` runs, and its outputs move out
(``c_u`` each). Index 0 is "all CPU cores together": a CPU node runs as soon as its predecessors'
outputs are in DRAM, in parallel with any other CPU node (the paper assumes at least width(G)
cores). With up to ``q`` subgraph slots per accelerator (App. A.1), a node ``v`` goes to slot
``j`` (``x_vj``) or to the CPUs (``x_v0``), and

    (1)  sum_j x_vj + x_v0 = 1
    (3*) sum_v m_v sum_{j in slots(i)} x_vj <= M_i                    (accelerators with a cap)
         sum_v m_v x_v0 <= max over CPU devices of their cap          (all CPU devices capped)
    (4)  CommIn_uj >= x_vj - x_uj,  (5) CommOut_uj >= x_uj - x_vj      for (u, v) in E
    (6)  SubgraphStart_j >= Latency_u - H (1 - CommIn_uj)              (Lemma A.1 big-M form)
    (7)  SubgraphFinish_j = SubgraphStart_j + sum_u c_u CommIn_uj + sum_v p_v(j) x_vj
                                            + sum_u c_u CommOut_uj
    (8)  Latency_v >= p_v^cpu x_v0,  (9) Latency_v >= p_v^cpu x_v0 + Latency_u  for (u, v) in E
    (10) Latency_v >= SubgraphFinish_j - H (1 - x_vj)                  (Lemma A.1 big-M form)
    (11) z_vj >= x_vj, (12) z_vj <= z_uj, (13) z_vj <= x_vj - x_uj + 1  (slot j contiguous)
    (14) SubgraphStart_j >= SubgraphFinish_{j-1}                       (slots of one accelerator)
    TotalLatency >= Latency_v;  minimise TotalLatency.

Colocation is per device (App. A.1): equal ``x_v0`` and equal slot sums per accelerator. The
paper's CPU pool has no memory limit; with CPU devices that all have one, the CPU nodes together
fit the largest, and :func:`extract` packs them onto the CPU devices (each where it has room: it
never runs out, see :func:`_cpu_schedule`). A restriction: a split that fits only across several
capped CPUs is not found (MOIRAI's MILP places each node on a device).
Generalisation: accelerators of different kinds use their own times ``p_v(j)`` (the kind of the
slot's device); a node a kind cannot run has ``x_vj = 0``, a node without a CPU time (or a cluster
without CPUs) has ``x_v0 = 0``. The big-M ``H`` is the sum of every node's largest time plus
every producer's transfer counted once out and once into each slot it can feed: no chain of
subgraph windows and CPU nodes is longer, so ``H`` bounds every Latency of a tight solution.

Valid inequalities (not in the paper): ``Latency_v`` is at least the longest path ending at ``v``
with each node at its least time, in Tarnawski's model as in any other (a slot's window holds all
of its compute); this lifts the LP bound from near zero to the critical path.

Symmetry breaking (valid: every solution maps to one that meets it with the same objective):
the slots of one accelerator are filled in order (an empty slot before a used one can be moved to
the end, (14) still holds); and of two identical accelerators (same kind and memory) the first
holds a node earlier in topological order than any node of the second (relabel identical devices
by their first node; empty devices last).

**This is not the cost model.** torchplace's latency objective is :func:`costmodel.simulate`
(node-level, every device and port serving its work in plan order, one transfer per (producer,
destination device), ports that serialize). The
plan built here is evaluated by the simulation; the IP's own value goes to ``meta["ip_latency"]``
and its proven bound (a bound for Tarnawski's model only) to ``meta["ip_bound"]``; the plan's
lower bound is :func:`~torchplace.solvers.bounds.latency_lower_bound`. When the cluster has at
least width(G) CPU devices, no colocation binds two CPU nodes, every move costs at most ``c_u`` per
end that pays transfers (so it is with ``transfer_time`` and no ``link_times`` or pair bandwidths)
and no transfer in the simulation waits for a port, the simulated makespan is at most the IP's TotalLatency: the IP's times are then a
schedule the simulation could run in the plan order :func:`extract` gives (stages ordered by
the IP's start times), and it runs the earliest schedule in that order. With ports that bind it can be
larger: Tarnawski's DRAM hub sends one output to any number of readers at once, the simulation
sends it to one device after another (see ``tests/test_milp_latency.py``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import pyomo.environ as pyo

from torchplace.devices import Device
from torchplace import costmodel
from torchplace.errors import InfeasibleError, ModelTooLargeError, SolverLimitError, UsageError
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers.bounds import latency_lower_bound
from torchplace.solvers.dp_infeasible import kind_fix
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp import contiguity
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.highs import solve_model
from torchplace.solvers.milp.maxload import byte_unit, unit_for
from torchplace.solvers.milp.size import latency_size
from torchplace.solvers.ordering import order_stages

__all__ = ["build", "extract", "initialize", "single_place_start", "solve"]


@dataclass(frozen=True)
class _Layout:
    """Nodes in topological order, accelerators (``q`` slots each, slot ``j`` on ``accels[j // q]``)
    and CPU devices (together Tarnawski's index 0)."""

    nodes: tuple[str, ...]
    accels: tuple[Device, ...]
    cpus: tuple[Device, ...]
    q: int


def _layout(problem: Problem, q: int) -> _Layout:
    devs = problem.cluster.devices
    return _Layout(tuple(problem.graph.topological_order()), tuple(d for d in devs if d.pays_transfer),
                   tuple(d for d in devs if not d.pays_transfer), q)


def _check(problem: Problem, q: int) -> None:
    if problem.objective != "latency":
        raise UsageError(
            f"the latency IP minimises the latency of one sample, but the problem's objective is "
            f"{problem.objective!r}; solve dataclasses.replace(problem, objective='latency')"
        )
    if q < 1:
        raise UsageError(f"q (subgraphs per accelerator) must be at least 1, got {q}")
    cpus = [d.name for d in problem.cluster.devices if not d.pays_transfer]
    if problem.contiguous and (q > 1 or cpus):
        why = f"q={q} gives an accelerator several subgraphs" if q > 1 else f"the CPUs {cpus} form one pool"
        raise UsageError(
            f"the problem asks for one contiguous set per device, but in Tarnawski's latency IP {why} "
            "(App. A: only each accelerator subgraph is contiguous); "
            "solve dataclasses.replace(problem, contiguous=False)"
        )
    nowhere = [v for v, r in problem.graph.records()
               if all(math.isinf(problem.node_time(v, d)) for d in problem.cluster.devices)]
    if nowhere:
        raise InfeasibleError(f"nodes {nowhere[:5]} cannot run on any device of the cluster (no time for its kinds); "
                              f"for {nowhere[0]!r}: {kind_fix(problem, nowhere[:1])}")


def _big_m(problem: Problem, lay: _Layout) -> float:
    """A horizon no tight Latency exceeds: every duration of every subgraph window and CPU node."""
    g, n_slots = problem.graph, len(lay.accels) * lay.q
    devices = lay.accels + lay.cpus[:1]
    work = math.fsum(max((t for d in devices if math.isfinite(t := problem.node_time(v, d))), default=0.0)
                     for v in lay.nodes)
    moves = math.fsum(problem.transfer_time(u) * (1 + min(n_slots, sum(1 for _ in g.successors(u))))
                      for u in lay.nodes if any(True for _ in g.successors(u)))
    return work + moves + 1.0


def _heads(problem: Problem, lay: _Layout) -> dict[str, float]:
    """Per node, the longest path ending at it with each node at its least time on the cluster."""
    devices = lay.accels + lay.cpus
    head: dict[str, float] = {}
    for v in lay.nodes:
        least = min((problem.node_time(v, d) for d in devices), default=math.inf)
        head[v] = _finite(least) + max((head[u] for u in problem.graph.predecessors(v)), default=0.0)
    return head


def _symmetric_pairs(lay: _Layout) -> list[int]:
    """Accelerators ``a`` identical to accelerator ``a - 1`` (same kind and memory)."""
    return [a for a in range(1, len(lay.accels))
            if (lay.accels[a].kind, lay.accels[a].memory_bytes) == (lay.accels[a - 1].kind, lay.accels[a - 1].memory_bytes)]


def build(problem: Problem, *, q: int = 1, budget: Budget | None = None) -> pyo.ConcreteModel:
    """The IP of Tarnawski Fig. 6 (Fig. 5 when ``q == 1``) for ``problem`` (see the module docstring).

    Args:
        budget: refuse a model too large for it, and stop building when it runs out.

    Raises:
        UsageError: (a ``ValueError``) for a non-latency objective, ``q < 1``, or a contiguous
            problem the IP cannot honour.
        InfeasibleError: if some node can run on no device of the cluster.
        ModelTooLargeError: if the model would not fit ``budget`` (or outgrows it).
        SolverLimitError: if ``budget``'s deadline passes while building.
    """
    _check(problem, q)
    if budget is not None:
        budget.admit(latency_size(problem, q))
    g, lay = problem.graph, _layout(problem, q)
    order = {v: t for t, v in enumerate(lay.nodes)}
    slots = range(len(lay.accels) * q)
    dev = {j: lay.accels[j // q] for j in slots}
    groups: dict[str, str] = {}
    rep = {v: groups.setdefault(r.colocation, v) for v, r in g.records() if r.colocation is not None}
    pool = _cpu_pool(lay)
    sym = _symmetric_pairs(lay)
    head = _heads(problem, lay)
    unit = _time_unit(problem, lay)

    m = budgeted_model(budget, f"tarnawski-latency-q{q}")
    m.unit = unit  # seconds per model time unit
    # -- Sets
    m.V = pyo.Set(initialize=lay.nodes, ordered=True, doc="nodes, topological order")
    m.E = pyo.Set(initialize=sorted(g.edges, key=lambda e: (order[e[0]], order[e[1]])), dimen=2, doc="edges")
    m.P = pyo.Set(initialize=[u for u in lay.nodes if any(True for _ in g.successors(u))], doc="producers")
    m.A = pyo.Set(initialize=range(len(lay.accels)), doc="accelerators")
    m.J = pyo.Set(initialize=slots, doc="subgraph slots; slot j is on accelerator j // q")
    m.A_MEM = pyo.Set(initialize=[a for a in m.A if lay.accels[a].memory_bytes is not None], doc="capped accelerators")
    m.J_NEXT = pyo.Set(initialize=[j for j in slots if j % q], doc="slots after another slot of their accelerator")
    m.COLO = pyo.Set(initialize=[v for v in lay.nodes if v in rep and rep[v] != v], doc="colocated, not the group's first")
    m.A_SYM = pyo.Set(initialize=sym, doc="accelerators identical to the one before")
    m.A_PRE = pyo.Set(initialize=sorted({a - 1 for a in sym}), doc="accelerators with an identical successor")
    # -- Params
    m.q = pyo.Param(initialize=q, doc="slots per accelerator")
    m.H = pyo.Param(initialize=_big_m(problem, lay) / unit, doc="big-M horizon of Lemma A.1")
    m.c = pyo.Param(m.V, initialize={v: problem.transfer_time(v) / unit for v in lay.nodes}, doc="per-side transfer c_v")
    m.p = pyo.Param(m.V, m.J, initialize={(v, j): _finite(problem.node_time(v, dev[j])) / unit for v in lay.nodes
                                          for j in slots}, default=0.0, doc="time of v on slot j's accelerator")
    m.p_cpu = pyo.Param(m.V, initialize={v: _finite(g.record(v).time_on("cpu")) / unit for v in lay.nodes}, doc="CPU time")
    need = {v: g.record(v).param_bytes + g.record(v).temp_bytes for v in lay.nodes}
    caps = {a: lay.accels[a].memory_bytes for a in m.A_MEM}
    m.mem_unit = mu = byte_unit([*need.values(), *caps.values(), *([] if pool is None else [pool])])  # bytes per unit
    m.mem = pyo.Param(m.V, initialize={v: b / mu for v, b in need.items()}, doc="m_v, in memory units")
    m.M = pyo.Param(m.A_MEM, initialize={a: b / mu for a, b in caps.items()}, doc="accelerator memory")
    # -- Vars
    m.x = pyo.Var(m.V, m.J, domain=pyo.Binary, doc="v in slot j",
                  bounds=lambda m, v, j: (0, 1 if math.isfinite(problem.node_time(v, dev[j])) else 0))
    m.x_cpu = pyo.Var(m.V, domain=pyo.Binary, doc="v on the CPUs (x_v0)",
                      bounds=lambda m, v: (0, 1 if lay.cpus and "cpu" in g.record(v).times else 0))
    m.z = contiguity.reach_var(m.V, m.J)  # contiguity witness of Lemma A.1
    m.comm_in = pyo.Var(m.P, m.J, bounds=(0, 1), doc="u's output moves into slot j")
    m.comm_out = pyo.Var(m.P, m.J, bounds=(0, 1), doc="u's output moves out of slot j")
    m.latency = pyo.Var(m.V, bounds=lambda m, v: (head[v] / unit, None), doc="v's output is in DRAM (bounded by its head path)")
    m.start = pyo.Var(m.J, domain=pyo.NonNegativeReals, doc="SubgraphStart_j")
    m.finish = pyo.Var(m.J, domain=pyo.NonNegativeReals, doc="SubgraphFinish_j")
    m.total = pyo.Var(domain=pyo.NonNegativeReals, doc="TotalLatency")
    m.used = pyo.Var(m.J, bounds=(0, 1), doc="slot j holds a node (symmetry breaking)")
    m.prefix = pyo.Var(m.V, m.A_PRE, domain=pyo.NonNegativeReals, doc="nodes up to v on accelerator a")
    # -- Objective
    m.obj = pyo.Objective(expr=m.total, sense=pyo.minimize)
    # -- Constraints
    on = _on_accel  # sum of v's slots on accelerator a
    m.assign = pyo.Constraint(m.V, rule=lambda m, v: sum(m.x[v, j] for j in m.J) + m.x_cpu[v] == 1)  # (1)
    m.memory = pyo.Constraint(m.A_MEM, rule=lambda m, a: sum(m.mem[v] * on(m, v, a) for v in m.V) <= m.M[a])  # (3*)
    m.cpu_memory = pyo.Constraint(  # the CPU nodes fit on the largest CPU device (_cpu_schedule then packs them)
        rule=lambda m: sum(m.mem[v] * m.x_cpu[v] for v in m.V) <= pool / mu if pool is not None else pyo.Constraint.Skip)
    m.in_def = pyo.Constraint(m.E, m.J, rule=lambda m, u, v, j: m.comm_in[u, j] >= m.x[v, j] - m.x[u, j])  # (4)
    m.out_def = pyo.Constraint(m.E, m.J, rule=lambda m, u, v, j: m.comm_out[u, j] >= m.x[u, j] - m.x[v, j])  # (5)
    m.total_def = pyo.Constraint(m.V, rule=lambda m, v: m.total >= m.latency[v])
    m.start_after_inputs = pyo.Constraint(  # (6)
        m.P, m.J, rule=lambda m, u, j: m.start[j] >= m.latency[u] - m.H * (1 - m.comm_in[u, j]))
    m.window = pyo.Constraint(m.J, rule=lambda m, j: m.finish[j] == m.start[j] + sum(  # (7)
        m.c[u] * (m.comm_in[u, j] + m.comm_out[u, j]) for u in m.P) + sum(m.p[v, j] * m.x[v, j] for v in m.V))
    m.cpu_time = pyo.Constraint(m.V, rule=lambda m, v: m.latency[v] >= m.p_cpu[v] * m.x_cpu[v])  # (8)
    m.cpu_after_inputs = pyo.Constraint(  # (9)
        m.E, rule=lambda m, u, v: m.latency[v] >= m.p_cpu[v] * m.x_cpu[v] + m.latency[u])
    m.after_slot = pyo.Constraint(  # (10)
        m.V, m.J, rule=lambda m, v, j: m.latency[v] >= m.finish[j] - m.H * (1 - m.x[v, j]))
    contiguity.add_lemma_a1(m, z=m.z, x=lambda v, j: m.x[v, j], nodes=m.V, edges=m.E, places=m.J)  # (11)-(13)
    m.slot_order = pyo.Constraint(m.J_NEXT, rule=lambda m, j: m.start[j] >= m.finish[j - 1])  # (14)
    m.colocate_cpu = pyo.Constraint(m.COLO, rule=lambda m, v: m.x_cpu[v] == m.x_cpu[rep[v]])
    m.colocate_accel = pyo.Constraint(m.COLO, m.A, rule=lambda m, v, a: on(m, v, a) == on(m, rep[v], a))
    m.used_has_node = pyo.Constraint(
        m.J, rule=lambda m, j: m.used[j] <= sum(m.x[v, j] for v in m.V) if (j + 1) % q else pyo.Constraint.Skip)
    m.slots_in_order = pyo.Constraint(m.V, m.J_NEXT, rule=lambda m, v, j: m.x[v, j] <= m.used[j - 1])
    m.prefix_def = pyo.Constraint(m.V, m.A_PRE, rule=lambda m, v, a: m.prefix[v, a] == on(m, v, a) + (
        m.prefix[m.V.prev(v), a] if v != m.V.first() else 0))
    m.devices_in_order = pyo.Constraint(m.V, m.A_SYM, rule=lambda m, v, a: on(m, v, a) <= (
        m.prefix[m.V.prev(v), a - 1] if v != m.V.first() else 0))
    return m


def _finite(t: float) -> float:
    return t if math.isfinite(t) else 0.0


def _time_unit(problem: Problem, lay: _Layout) -> float:
    """Seconds per model time unit (:func:`~torchplace.solvers.milp.maxload.unit_for` of the node
    times on the cluster's kinds and the transfer times): unscaled, nanosecond counts of 1e9 beside
    the 0/1 rows led HiGHS to prove 6e9 for a chain that runs in 5e9."""
    kinds = {d.kind for d in lay.accels} | ({"cpu"} if lay.cpus else set())
    g = problem.graph
    return unit_for([*(g.record(v).time_on(k) for v in lay.nodes for k in kinds),
                     *(problem.transfer_time(v) for v in lay.nodes)])


def _on_accel(m: pyo.ConcreteModel, v: str, a: int) -> Any:
    q = pyo.value(m.q)
    return sum(m.x[v, j] for j in range(a * q, (a + 1) * q))


def _cpu_pool(lay: _Layout) -> int | None:
    """Bytes the CPU nodes may take together: the largest CPU device's cap (``None``: a CPU device
    without one). Tarnawski's CPUs are one pool without memory; with caps, CPU nodes of at most
    this many bytes always fit, packed by :func:`_cpu_schedule`, and a set above it fits on none."""
    caps = [d.memory_bytes for d in lay.cpus]
    return None if not caps or None in caps else max(c for c in caps if c is not None)


def _cpu_schedule(problem: Problem, lay: _Layout, starts: dict[str, float]) -> list[tuple[float, float, str, str]]:
    """List-schedule the CPU nodes on the CPU devices in order of their IP start times, each on the
    CPU free earliest that has room for it (a colocated node on its group's CPU, which the group's
    first node takes with room for all of them): (start, finish, device, node).

    Never stuck when the CPU nodes fit :func:`_cpu_pool` (as the IP's row makes them): what the
    largest CPU device holds is some of the nodes, so the rest still fit beside it."""
    g = problem.graph
    free = {d.name: 0.0 for d in lay.cpus}
    room = {d.name: math.inf if d.memory_bytes is None else d.memory_bytes for d in lay.cpus}
    need: dict[str | None, int] = {}  # bytes of each colocation group's CPU nodes
    for v in starts:
        r = g.record(v)
        if r.colocation is not None:
            need[r.colocation] = need.get(r.colocation, 0) + r.param_bytes + r.temp_bytes
    group_cpu: dict[str, str] = {}
    out = []
    topo = {v: t for t, v in enumerate(lay.nodes)}
    for v in sorted(starts, key=lambda v: (starts[v], topo[v])):
        color = g.record(v).colocation
        cpu = group_cpu.get(color) if color is not None else None
        if cpu is None:
            nbytes = need[color] if color is not None else g.record(v).param_bytes + g.record(v).temp_bytes
            fits = [c for c in free if room[c] >= nbytes] or list(free)  # over the pool: validate names it
            cpu = min(fits, key=free.__getitem__)  # first such CPU on ties
            room[cpu] -= nbytes
        if color is not None:
            group_cpu[color] = cpu
        begin = max(free[cpu], starts[v])
        free[cpu] = begin + g.record(v).time_on("cpu")
        out.append((starts[v], free[cpu], cpu, v))
    return out


def _merge_adjacent(stages: list[Stage], topo: dict[str, int]) -> list[Stage]:
    """Join neighbouring stages of one device when that keeps its run order (topological inside)."""
    out: list[Stage] = []
    for s in stages:
        if out and out[-1].device == s.device and max(topo[v] for v in out[-1].nodes) < min(topo[v] for v in s.nodes):
            out[-1] = Stage(s.device, out[-1].nodes + s.nodes)
        else:
            out.append(s)
    return out


@dataclass(frozen=True)
class _Values:
    """What :func:`extract` reads of a solution: the assignment (node -> slot, ``None`` for the
    CPUs) and the times (SubgraphStart / SubgraphFinish per used slot, Latency per node)."""

    place: Mapping[str, int | None]
    start: Mapping[int, float]
    finish: Mapping[int, float]
    latency: Mapping[str, float]


def extract(model: pyo.ConcreteModel, problem: Problem) -> list[Stage]:
    """Stages of a solved model: each used slot a stage on its accelerator, CPU nodes list-scheduled
    on the CPU devices; ordered by the IP's SubgraphStart / CPU start times (ties made valid by
    :func:`order_stages`), neighbouring stages of one device joined where the run order allows."""
    place = {v: next((j for j in model.J if pyo.value(model.x[v, j]) > 0.5), None) for v in model.V}
    used, unit = set(place.values()) - {None}, model.unit  # times back in seconds
    return _stages(problem, int(pyo.value(model.q)), _Values(
        place, {j: pyo.value(model.start[j]) * unit for j in used}, {j: pyo.value(model.finish[j]) * unit for j in used},
        {v: pyo.value(model.latency[v]) * unit for v in model.V}))


def _stages(problem: Problem, q: int, values: _Values) -> list[Stage]:
    lay = _layout(problem, q)
    topo = {v: t for t, v in enumerate(lay.nodes)}
    units: list[tuple[float, float, int, Stage]] = []
    for j in sorted(values.start):
        nodes = tuple(v for v in lay.nodes if values.place[v] == j)
        units.append((values.start[j], values.finish[j], topo[nodes[0]], Stage(lay.accels[j // q].name, nodes)))
    g = problem.graph
    starts = {v: values.latency[v] - _finite(g.record(v).time_on("cpu")) for v in lay.nodes if values.place[v] is None}
    for begin, end, cpu, v in _cpu_schedule(problem, lay, starts):
        units.append((begin, end, topo[v], Stage(cpu, (v,))))
    units.sort(key=lambda u: u[:3])
    return _merge_adjacent(order_stages(g, [u[3] for u in units]), topo)


def single_place_start(problem: Problem, q: int = 1) -> dict[str, int | None] | None:
    """A MIP start: every node on one place, the one whose plan simulates fastest among those that
    can run every node and hold them all (the CPUs, each accelerator's first slot); ``None`` if no
    place can. Valid for the IP: one slot is contiguous, colocation holds, the symmetry rows hold
    (slot 0 of an accelerator that is not a copy of the one before it)."""
    _check(problem, q)
    g, lay = problem.graph, _layout(problem, q)
    need = sum(r.param_bytes + r.temp_bytes for _, r in g.records())
    candidates: list[dict[str, int | None]] = []
    pool = _cpu_pool(lay)
    if lay.cpus and all("cpu" in r.times for _, r in g.records()) and (pool is None or need <= pool):
        candidates.append(dict.fromkeys(lay.nodes))
    copies = set(_symmetric_pairs(lay))
    for a, d in enumerate(lay.accels):
        if a not in copies and (d.memory_bytes is None or need <= d.memory_bytes) and all(
                math.isfinite(problem.node_time(v, d)) for v in lay.nodes):
            candidates.append(dict.fromkeys(lay.nodes, a * q))
    if not candidates:
        return None
    return min(candidates, key=lambda place: costmodel.evaluate_stages(problem, _start_stages(problem, q, place))[0])


def _start_values(problem: Problem, q: int, place: Mapping[str, int | None]) -> _Values:
    """Tarnawski's times for an assignment (App. A's computation model, each window and CPU node as
    early as its inputs and its accelerator's earlier slot allow): the least values the rows admit.

    Raises:
        ValueError: if the assignment's slots feed each other in a cycle (not a valid start).
    """
    g, lay = problem.graph, _layout(problem, q)
    head = _heads(problem, lay)
    unit = {v: ("slot", j) if j is not None else ("cpu", v) for v, j in place.items()}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(unit.values())
    quotient.add_edges_from((unit[u], unit[v]) for u, v in g.edges if unit[u] != unit[v])
    used = sorted({j for j in place.values() if j is not None})
    quotient.add_edges_from((("slot", j - 1), ("slot", j)) for j in used if j % q and ("slot", j - 1) in quotient)
    if not nx.is_directed_acyclic_graph(quotient):
        raise ValueError("the start's slots feed each other in a cycle")
    members: dict[Any, list[str]] = {}
    for v in lay.nodes:
        members.setdefault(unit[v], []).append(v)
    start: dict[int, float] = {}
    finish: dict[int, float] = {}
    latency: dict[str, float] = {}
    for u_ in nx.topological_sort(quotient):
        nodes = members[u_]
        if u_[0] == "cpu":
            v = nodes[0]
            ready = max((latency[u] for u in g.predecessors(v)), default=0.0)
            latency[v] = max(head[v], ready + _finite(g.record(v).time_on("cpu")))
            continue
        j, inside = u_[1], set(nodes)
        dev = lay.accels[j // q]
        inputs = {u for v in nodes for u in g.predecessors(v) if u not in inside}
        outputs = {u for u in nodes if any(w not in inside for w in g.successors(u))}
        start[j] = max([latency[u] for u in inputs] + ([finish[j - 1]] if j % q and j - 1 in finish else []),
                       default=0.0)
        finish[j] = start[j] + math.fsum(problem.transfer_time(u) for u in inputs | outputs) + math.fsum(
            _finite(problem.node_time(v, dev)) for v in nodes)
        for v in nodes:
            latency[v] = max(finish[j], head[v])
    return _Values(dict(place), start, finish, latency)


def initialize(model: pyo.ConcreteModel, problem: Problem, place: Mapping[str, int | None]) -> None:
    """Set every variable of ``model`` to the assignment ``place`` (node -> slot, ``None`` for the
    CPUs) and its least times (:func:`_start_values`): a MIP start, HiGHS's first incumbent when
    the assignment meets memory, colocation, contiguity and the symmetry rows (as
    :func:`single_place_start`'s does)."""
    q = int(pyo.value(model.q))
    values = _start_values(problem, q, place)
    g, lay = problem.graph, _layout(problem, q)
    for (v, j), var in model.x.items():
        var.value = float(place[v] == j)
    for v, var in model.x_cpu.items():
        var.value = float(place[v] is None)
    succ = {u: list(g.successors(u)) for u in model.P}
    for (u, j), var in model.comm_in.items():
        var.value = float(place[u] != j and any(place[w] == j for w in succ[u]))
    for (u, j), var in model.comm_out.items():
        var.value = float(place[u] == j and any(place[w] != j for w in succ[u]))
    z = contiguity.reach_values(lay.nodes, list(g.edges), list(model.J), place)
    for key, var in model.z.items():
        var.value = z[key]
    unit = model.unit
    for v, var in model.latency.items():
        var.value = values.latency[v] / unit
    for j in model.J:
        model.used[j].value = float(j in values.start)
    for j in model.J:  # an unused slot's window is empty: it opens when the slot before it closes
        begin = values.start[j] / unit if j in values.start else model.finish[j - 1].value if j % q else 0.0
        model.start[j].value = begin
        model.finish[j].value = values.finish[j] / unit if j in values.finish else begin
    model.total.value = max(values.latency.values(), default=0.0) / unit
    count = {a: 0 for a in model.A_PRE}
    for v in lay.nodes:
        for a in model.A_PRE:
            count[a] += sum(place[v] == j for j in range(a * q, (a + 1) * q))
            model.prefix[v, a].value = float(count[a])


def _start_stages(problem: Problem, q: int, place: Mapping[str, int | None]) -> list[Stage]:
    return _stages(problem, q, _start_values(problem, q, place))


def _size(model: pyo.ConcreteModel) -> tuple[int, int]:
    rows = sum(1 for _ in model.component_data_objects(pyo.Constraint, active=True))
    cols = sum(1 for v in model.component_data_objects(pyo.Var) if not (v.lb == v.ub == 0))
    return rows, cols


def solve(problem: Problem, *, q: int = 1, time_limit: float | None = None, mip_gap: float = 1e-6) -> Plan:
    """Minimise latency with Tarnawski's IP (App. A; App. A.1 for ``q > 1``) and return its plan.

    Args:
        problem: a latency problem; ``contiguous`` must be ``False`` unless ``q == 1`` and the
            cluster has no CPU device (CPU nodes form a pool, and slots of one accelerator are
            separate subgraphs). Training graphs need ``q >= 2`` for a device to hold a forward and
            a backward subgraph.
        q: contiguous subgraphs per accelerator (App. A.1).
        time_limit: seconds for everything: building the model, handing it to HiGHS, the solve
            and the plan (HiGHS gets what is left); ``None``: no limit. mip_gap: HiGHS's relative gap.

    HiGHS starts from :func:`single_place_start` (every node on the one place that simulates
    fastest) where some place can run and hold every node; when the limit stops the build, the
    hand-over or HiGHS before its first incumbent, that start is returned with status
    ``"time_limit"`` and the reason in ``meta["stopped"]``. The plan is the better, under the
    simulation, of HiGHS's incumbent and the start.

    Returns:
        A Plan whose objective is the cost model's simulated latency; its status is ``"feasible"``
        (the IP is optimal for Tarnawski's model, not for the simulation) or ``"time_limit"``, or
        ``"optimal"`` when the objective meets its lower bound, :func:`latency_lower_bound`. ``meta`` holds ``ip_latency`` (TotalLatency),
        ``ip_bound`` (proven for Tarnawski's model only), ``ip_status``, ``q``, ``rows``, ``cols``,
        ``kept`` (``"ip"`` or ``"start"``) and ``ip_simulated`` (the IP's own plan, simulated).

    Raises:
        UsageError: see :func:`build`.
        InfeasibleError: if no placement meets memory, colocation and contiguity.
        SolverLimitError: if the time limit passed before any placement was found (also while the
            model was built) and there is no single-place start.
        ModelTooLargeError: if the model would not fit in the solver memory budget or the time limit.
    """
    name = f"latency IP (Tarnawski App. A, q={q})"
    budget = Budget(name, time_limit)
    start = single_place_start(problem, q)
    start_stages = None if start is None else _start_stages(problem, q, start)
    try:
        model = build(problem, q=q, budget=budget)
        if start is not None:
            initialize(model, problem, start)
        scaled = solve_model(model, name=name, mip_gap=mip_gap, budget=budget, warm_start=start is not None,
                             unit=model.unit)
        res = scaled.scaled(model.unit)
    except InfeasibleError as e:
        raise _infeasible(problem, q) from e
    except SolverLimitError as e:
        if start_stages is None or isinstance(e, ModelTooLargeError):
            raise
        # The limit stopped the build, the hand-over or HiGHS before its first incumbent: the
        # start is feasible for the IP, so it is the answer at this limit.
        stages, status = start_stages, "time_limit"
        meta = {"ip_latency": None, "ip_bound": e.bound, "ip_status": "time_limit", "q": q,
                "milp_objective": None, "milp_bound": e.bound, "stopped": str(e)}
    else:
        stages, kept = extract(model, problem), "ip"
        simulated = costmodel.evaluate_stages(problem, stages)[0]
        if start_stages is not None and (  # keep the start where HiGHS's incumbent simulates worse
                costmodel.evaluate_stages(problem, start_stages)[0] < simulated):
            stages, kept = start_stages, "start"
        status = "time_limit" if res.status == "time_limit" else "feasible"
        rows, cols = _size(model)
        meta = {"ip_latency": res.objective, "ip_bound": res.bound, "ip_status": res.status, "q": q,
                "milp_objective": res.objective, "milp_bound": res.bound, "rows": rows, "cols": cols, "kept": kept,
                "ip_simulated": simulated}
    plan = Plan.build(problem, stages, solver="milp-latency", seconds=budget.elapsed(),
                      lower_bound=latency_lower_bound(problem), status=status, meta=meta)
    if plan.objective <= plan.lower_bound * (1 + 1e-9):
        plan.status = "optimal"  # the simulation bound proves it, whatever the IP's status
    return plan


def _infeasible(problem: Problem, q: int) -> InfeasibleError:
    g = problem.graph
    accel_only = sum(r.param_bytes + r.temp_bytes for v, r in g.records()
                     if "cpu" not in r.times or all(d.pays_transfer for d in problem.cluster.devices))
    caps = ["unlimited" if d.memory_bytes is None else d.memory_bytes for d in problem.cluster.devices if d.pays_transfer]
    pool = _cpu_pool(_layout(problem, q))
    cpus = "" if pool is None else f", the CPU nodes together at most {pool} bytes (the largest CPU device's)"
    memory = (f"nodes that must go to an accelerator need {accel_only} bytes, the accelerators hold {caps} "
              f"bytes{cpus}")
    if q == 1 and problem.mode == "training":
        return InfeasibleError(
            f"latency IP (q=1): no placement meets memory, colocation and contiguity; with q=1 an accelerator "
            "holds one contiguous subgraph, and a training graph's forward and colocated backward nodes are "
            "rarely one (the nodes between them would have to come too): raise q to 2 (solve(problem, 'latency-ip', "
            f"q=2)), or use method 'moirai' (any placement); if that fails too, look at memory: {memory}"
        )
    return InfeasibleError(
        f"latency IP (q={q}): no placement meets memory, colocation and contiguity; {memory}; raise max_memory, "
        "add devices, raise q (more subgraphs per accelerator relax contiguity), or use method 'moirai' (any "
        "placement, each node on one device)"
    )
