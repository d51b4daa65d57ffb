"""The exact MIP for pipeline partitioning with an acyclic quotient graph (Archer et al. 2024, Sec. 3.1).

Archer's max-throughput partitioning problem (MTPP, Sec. 2.2, Def. 2.1) splits the graph into ``k``
blocks whose *quotient graph is acyclic* and minimises the largest block cost
``f(S) = io(V \\ S, S) + work(S) + io(S, V \\ S)``, each tensor counted once however many consumers
it has (eq. (1)): on devices that pay transfers this is exactly our cost model's load (Tarnawski's
CommIn/CommOut). Acyclic-quotient partitions are the chains of ideals the DP searches
(:mod:`torchplace.solvers.dp`), so MTPP is the DP's problem, not the non-contiguous one: a
non-contiguous placement (:mod:`maxload` with ``contiguous=False``) may let two devices feed each
other and can be strictly better (Tarnawski Fig. 1b).

The MIP of Fig. 3 numbers the blocks ``1..k`` in a topological order of the quotient graph, with
``y[u,b]`` = "unit u is in block b or earlier" (``y[u,0] = 0``, ``y[u,k] = 1``,
``x[u,b] = y[u,b] - y[u,b-1]``, eq. (11)):

    y[u,b] >= y[v,b]                 (u -> v)      DAG constraints                  (8)
    c[p,b] >= y[p,b-1] + x[w,b] - 1  (p -> w)      tensor p enters block b          (9)
    c[p,b] >= x[p,b] - y[w,b]        (p -> w)      tensor p leaves block b          (10)
    bottleneck >= work(b) + sum_p c_p c[p,b]                                        (6), (7)

Our generalisations: units are colocation groups (one ``y`` per group, so colocated nodes share a
block); a block holding more memory than its device has is forbidden (Archer Sec. 3 reserves a
buffer instead of modelling overflow; we model no overflow); and devices of several classes (kind,
memory, transfer rule; e.g. accelerators and CPUs) are handled by giving each block a class,
``w[b,c]`` binary, ``sum_c w[b,c] = 1``, ``sum_b w[b,c] = |class c|``, with

    bottleneck >= work_c(b) + [c pays] sum_p c_p c[p,b] - M_c (1 - w[b,c])
    sum_u m_u x[u,b] <= sum_c M^mem_c w[b,c]        x[u,b] <= sum_{c runs u} w[b,c]

where ``M_c`` is the largest load any block can have on class ``c`` (all of its finite times
plus all transfers). With one class ``w`` is 1 and this is Archer's Fig. 3 exactly.

Inference graphs only: a training graph's forward and backward parts go to separate stages of
one device, so one block per device with an acyclic quotient is not its search space (use the DP
or :mod:`maxload`).
"""
from __future__ import annotations

import math

import pyomo.environ as pyo

from torchplace.errors import InfeasibleError, UsageError
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.dp import device_classes
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.highs import solve_model
from torchplace.solvers.milp.maxload import (
    Units,
    assignment_units,
    byte_unit,
    model_size,
    row,
    time_unit,
)
from torchplace.solvers.milp.size import mtpp_size
from torchplace.solvers.pipelined import solve_pipelined, training_pipeline

__all__ = ["build", "extract", "solve"]


def _check_inference(problem: Problem) -> None:
    if any(r.backward for _, r in problem.graph.records()):
        raise UsageError(
            "the MTPP MIP (Archer et al. 2024) is for inference graphs: one block per device with an acyclic "
            "quotient graph; for a training graph use method 'dp' or the max-load IP (milp.maxload)"
        )


def _class_tables(problem: Problem, units: Units, unit: float):
    """Per class: representative device index, unit times in ``unit`` s (0 where it cannot run), allowed units."""
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    classes = device_classes(problem)
    rep = [index[c.devices[0]] for c in classes]
    times = [[t[d] / unit if math.isfinite(t[d]) else 0.0 for t in units.time] for d in rep]
    ok = [{u for u in range(len(units.members)) if (u, d) in units.allowed} for d in rep]
    return classes, rep, times, ok


def build(problem: Problem, *, budget: Budget | None = None) -> pyo.ConcreteModel:
    """Archer's Fig. 3 MIP for ``problem``, generalised to device classes (module docstring).

    Args:
        budget: refuse a model too large for it, and stop building when it runs out.

    Raises:
        UsageError: (a ValueError) for a training graph.
        InfeasibleError: if some unit fits on no device.
        ModelTooLargeError: if the model would not fit ``budget`` (or outgrows it).
        SolverLimitError: if ``budget``'s deadline passes while building.
    """
    _check_inference(problem)
    units = assignment_units(problem)
    if budget is not None:
        budget.admit(mtpp_size(problem, units))
    unit = time_unit(units, problem)  # seconds per model time unit
    classes, rep, times, ok = _class_tables(problem, units, unit)
    n_units, k = len(units.members), len(problem.cluster)
    devices = problem.cluster.devices
    pays = [devices[d].pays_transfer for d in rep]
    total_mem = sum(units.memory)
    cap = [min(devices[d].memory_bytes, total_mem) if devices[d].memory_bytes is not None else total_mem for d in rep]
    mu = byte_unit([*units.memory, *cap])  # bytes per memory unit
    if k == 1 and cap[0] < total_mem:  # one block holds every unit: its memory row is a constant (no Pyomo rule raises)
        raise InfeasibleError(f"the graph needs {total_mem} bytes on its one device {devices[0].name!r}, which has "
                              f"{cap[0]}: raise max_memory to at least {total_mem} bytes, or add a device",
                              min_memory_bytes=total_mem)
    edges = sorted({(units.of[u], units.of[v]) for u, v in problem.graph.edges} - {(i, i) for i in range(n_units)})
    cut = [(p, w) for p, ws in units.fanout.items() for w in ws] if any(pays) else []
    multi = len(classes) > 1
    m = budgeted_model(budget, "MTPP MIP")
    m.units, m.multi, m.unit = units, multi, unit
    # Sets
    m.U = pyo.Set(initialize=range(n_units))  # units, topological
    m.B = pyo.RangeSet(1, k)  # blocks in pipeline order
    m.Bin = pyo.RangeSet(1, k - 1)  # blocks whose y is a variable
    m.C = pyo.Set(initialize=range(len(classes)))  # device classes
    m.E = pyo.Set(dimen=2, initialize=edges)  # edges between units
    m.P = pyo.Set(initialize=sorted({p for p, _ in cut}))  # producers whose transfer costs time
    m.CUT = pyo.Set(dimen=2, initialize=cut)  # (producer, consumer unit)
    # Params
    m.c = pyo.Param(m.P, initialize={p: problem.transfer_time(p) / unit for p in m.P})  # transfer time
    big = [math.fsum(times[c]) + (math.fsum(m.c[p] for p in m.P) if pays[c] else 0.0) for c in m.C]
    # Vars
    m.y = pyo.Var(m.U, m.Bin, domain=pyo.Binary)  # unit u in block b or earlier
    m.cc = pyo.Var(m.P, m.B, bounds=(0, 1))  # tensor p crosses the boundary of block b
    if multi:
        m.w = pyo.Var(m.B, m.C, domain=pyo.Binary)  # block b runs on a device of class c
    m.bottleneck = pyo.Var(bounds=(0, None))

    def Y(u: int, b: int):
        return 0 if b <= 0 else 1 if b >= k else m.y[u, b]

    def X(u: int, b: int):
        return Y(u, b) - Y(u, b - 1)

    def W(b: int, c: int):
        return m.w[b, c] if multi else 1

    m.comm = pyo.Expression(m.B, rule=lambda m, b: sum(m.c[p] * m.cc[p, b] for p in m.P))  # cut tensors
    # Objective
    m.obj = pyo.Objective(expr=m.bottleneck, sense=pyo.minimize)  # (5)
    # Constraints
    m.monotone = pyo.Constraint(m.U, m.Bin, rule=lambda m, u, b: Y(u, b - 1) <= m.y[u, b] if b > 1 else pyo.Constraint.Skip)
    m.dag = pyo.Constraint(m.E, m.Bin, rule=lambda m, u, v, b: m.y[u, b] >= m.y[v, b])  # (8)
    m.cut_in = pyo.Constraint(  # (9)
        m.CUT, m.B, rule=lambda m, p, w, b: m.cc[p, b] >= Y(units.of[p], b - 1) + X(w, b) - 1 if b > 1 else pyo.Constraint.Skip)
    m.cut_out = pyo.Constraint(  # (10)
        m.CUT, m.B, rule=lambda m, p, w, b: m.cc[p, b] >= X(units.of[p], b) - Y(w, b) if b < k else pyo.Constraint.Skip)
    m.block = pyo.Constraint(  # (6), (7) per class, switched off by big-M where the block is another class's
        m.B, m.C, rule=lambda m, b, c: m.bottleneck >= sum(times[c][u] * X(u, b) for u in m.U)
        + (m.comm[b] if pays[c] else 0) - (big[c] * (1 - m.w[b, c]) if multi else 0))
    m.memory = pyo.Constraint(
        m.B, rule=lambda m, b: row(sum(units.memory[u] / mu * X(u, b) for u in m.U) <= sum(cap[c] / mu * W(b, c) for c in m.C),
                                   "the memory of the devices") if min(cap) < total_mem else pyo.Constraint.Skip)
    m.support = pyo.Constraint(  # a unit only on a block whose class can run it
        m.U, m.B, rule=lambda m, u, b: row(X(u, b) <= sum(W(b, c) for c in m.C if u in ok[c]), "device support")
        if any(u not in ok[c] for c in m.C) else pyo.Constraint.Skip)
    m.one_class = pyo.Constraint(m.B, rule=lambda m, b: sum(m.w[b, c] for c in m.C) == 1 if multi else pyo.Constraint.Skip)
    m.class_count = pyo.Constraint(
        m.C, rule=lambda m, c: sum(m.w[b, c] for b in m.B) == len(classes[c].devices) if multi else pyo.Constraint.Skip)
    return m


def extract(m: pyo.ConcreteModel, problem: Problem) -> list[Stage]:
    """Stages in block order, each block on the next unused device of its class."""
    units: Units = m.units
    classes = device_classes(problem)
    k = len(problem.cluster)
    block = [next((b for b in range(1, k) if pyo.value(m.y[u, b]) > 0.5), k) for u in m.U]
    used = [0] * len(classes)
    stages = []
    for b in range(1, k + 1):
        c = max(m.C, key=lambda c: pyo.value(m.w[b, c])) if m.multi else 0
        device = classes[c].devices[used[c]]
        used[c] += 1
        nodes = tuple(v for v in units.nodes if block[units.of[v]] == b)
        if nodes:
            stages.append(Stage(device, nodes))
    return stages


def solve(problem: Problem, *, time_limit: float | None = None, mip_gap: float = 1e-6) -> Plan:
    """Optimal acyclic-quotient (chain) split by Archer's exact MIP, solved by HiGHS.

    Returns:
        A Plan (status ``"optimal"`` or ``"time_limit"``) with one stage per non-empty block. Its
        lower bound is the simple bound, valid for every split; the MIP's proven bound, valid among
        acyclic-quotient splits only, is ``meta["milp_bound"]``. A problem with a training
        :class:`~torchplace.problem.Pipeline` (and no backward nodes) is solved through the per-node
        memory relaxation and restriction of :mod:`torchplace.solvers.pipelined`.

    Args:
        time_limit: seconds for everything: building the model, handing it to HiGHS, the solve
            and the plan (HiGHS gets what is left). ``None``: no limit.

    Raises:
        UsageError: (a ValueError) for a training graph.
        InfeasibleError: if no acyclic-quotient split fits.
        SolverLimitError: if the time limit passed before HiGHS found any split (also while the
            model was built).
        ModelTooLargeError: if the model would not fit in the solver memory budget or the time limit.
    """
    if training_pipeline(problem) is not None:
        _check_inference(problem)
        return solve_pipelined(problem, solve, time_limit, mip_gap=mip_gap)
    budget = Budget("MTPP MIP", time_limit)
    m = build(problem, budget=budget)
    build_seconds = budget.elapsed()
    scaled = solve_model(m, name="MTPP MIP", mip_gap=mip_gap, budget=budget, unit=m.unit,
                         known_bound=simple_lower_bound(problem))
    res = scaled.scaled(m.unit)
    stages = extract(m, problem)
    rows, cols = model_size(m)
    plan = Plan.build(
        problem, stages, solver="mtpp-mip", seconds=budget.elapsed(),
        lower_bound=simple_lower_bound(problem), status=res.status,
        meta={"milp_objective": res.objective, "milp_bound": res.bound, "rows": rows, "cols": cols,
              "build_seconds": build_seconds, "solve_seconds": res.seconds, "contiguous": True},
    )
    if res.status == "optimal" and not math.isclose(plan.objective, res.objective, rel_tol=max(mip_gap, 1e-6), abs_tol=1e-9):
        raise AssertionError(f"MTPP MIP value {res.objective} differs from the cost model's {plan.objective}")
    return plan
