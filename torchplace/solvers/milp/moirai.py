"""MOIRAI's heterogeneous latency MILP (Zhang et al., "MOIRAI", Sec. III-D, eqs. (4)-(8), Table II).

Minimises the makespan of one sample (objective (4)) over placements ``x_ik`` of nodes on devices
and start times ``S_i``, for any latency :class:`~torchplace.problem.Problem`, with the semantics
of the one cost model, :func:`torchplace.costmodel.simulate`:

- (4b)/(4c) each node runs on one device that supports it (finite time; ``x`` only exists for those
  pairs) for ``p_ik`` = :meth:`Problem.node_time` seconds; colocation groups share a device.
- (5) the memory (``param_bytes + temp_bytes``) on a device fits its ``memory_bytes``.
- (7) transfers. The paper has one communication task ``q`` per edge. torchplace moves a tensor
  once per (producer ``u``, destination device ``d``): the transfer task ``(u, d)`` exists
  (``y_ud = 1``) iff ``u`` is not on ``d`` and some successor of ``u`` is; it takes
  ``link_time(u, k', d)`` when ``u`` is on ``k'`` (``w_uk'd = x_uk' * y_ud``, the paper's
  ``u_qk'k''``). When two consumers of ``u`` share a device this is one transfer where the paper
  would count two. (Per-edge data, as in MOIRAI's own files, is expressed by zero-time colocated
  nodes per out-edge: see :mod:`torchplace.workloads.moirai`.)
- (4a) precedence through transfers: ``S_v >= C_u`` on every edge, the transfer starts after
  ``C_u``, and a consumer on ``d`` starts after the transfer ``(u, d)`` ends.
- (6) no overlap on a device: a disjunction (order binary ``delta_ij``) for every pair of nodes
  that no path orders, on each device both can use; precedence orders the others.
- (8) congestion: transfers out of one device serialize, transfers into one device serialize (one
  order binary ``pi_uv`` per pair of producers whose transfers may share a port, the same on
  every port they share). A transfer of 0 s (e.g. CPU to CPU) uses no port, as in the simulation.
- Plan order (not in the paper, whose (6) and (8) let each device and port pick its own order):
  the simulation serves every device and port in the plan's order, one topological order of all
  nodes. The model keeps a position ``r_v`` in ``[0, n-1]`` per node with ``r_v >= r_u + 1`` on
  every edge and on every pair the model orders (two nodes on one device by ``delta``, two
  producers whose transfers share a port by ``pi``), so the orders it picks come from one
  topological order. A producer's transfers precede its descendants' (forced by the edges) and
  one producer's go in destination name order (fixed), as in the simulation.

Big-M is the horizon ``H`` = sum over nodes of their largest finite time + sum over transfers of
their largest link time: some optimal schedule is left-justified, and in a left-justified schedule
every finish time is the length of a chain of distinct tasks, so ``H`` bounds every time and every
big-M difference. Times are scaled by the largest duration so HiGHS's absolute tolerances stay
relative to the data. Beyond the paper's constraints the model has valid cuts (a device's nodes
and a port's transfers fit in the makespan; a consumer waits for its input's transfer time).

Why the MILP's optimum is the best simulated plan:

- Every plan's simulated schedule is a feasible MILP solution with the same makespan: its
  assignment meets (4c), (5) and colocation (plans are validated); ``r`` is the plan position,
  ``delta`` and ``pi`` follow it, nodes start after their inputs arrive, the transfers are exactly
  ``y_ud = 1`` with the same durations, and no device or port serves two things at once. So the
  MILP optimum, and any bound HiGHS proves, is at most every plan's makespan.
- Conversely, :func:`extract` sorts the nodes by ``r`` (a topological order carrying every order
  the model picked) into stages. The simulation serves each device and port in that order and
  starts everything as early as those orders allow, so by induction along the order each node
  and transfer ends no later than in the MILP's schedule: the plan's makespan is at most the
  MILP's objective.

Hence an optimal MILP solution gives an optimal plan whose simulated makespan is the MILP's value,
up to HiGHS's tolerances (the plan's status is ``"optimal"`` only within them).

HiGHS solves it with presolve off: on a 6-node instance (``test_milp_proves_8_where_presolve_cut_it_off``)
HiGHS 1.15's MIP presolve returned 10 as "optimal" where a plan of 8 exists, and presolve off is
no slower on these models (example-1: 2 s against 7 s).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import pyomo.environ as pyo

from torchplace import costmodel
from torchplace.errors import InfeasibleError, ModelTooLargeError, SolverLimitError
from torchplace.plan import Plan, Stage, stages_from_order
from torchplace.problem import Problem
from torchplace.solvers.bounds import latency_lower_bound, round_up_bound
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.highs import solve_model
from torchplace.solvers.milp.moirai_data import derive, port_pairs
from torchplace.solvers.milp.maxload import byte_unit
from torchplace.solvers.milp.size import moirai_size

__all__ = ["build", "extract", "initialize", "solve"]

_NAME = "MOIRAI latency MILP"
# HiGHS proves its bound up to its primal feasibility tolerance (1e-7 in the model's scaled
# time units); the reported bound gives that slack back so it is never above the true optimum.
_BOUND_SLACK = 1e-7
# HiGHS accepts a binary within 1e-6 of 0 or 1; multiplied by the big-M (the horizon) in up to
# three terms of a constraint, the MILP's schedule may be shorter than exact by this much per
# unit of horizon. A simulated plan within it (plus mip_gap) of the MILP's value counts as optimal.
_BIG_M_SLACK = 1e-5


def build(problem: Problem, *, budget: Budget | None = None) -> pyo.ConcreteModel:
    """The MILP (4)-(8) of the module docstring for a latency ``problem`` (times in ``model.unit`` s).

    Args:
        budget: refuse a model too large for it (counted before its index sets are listed:
            :func:`~torchplace.solvers.milp.size.moirai_size`), and stop building when it runs out.

    Raises:
        ValueError: if ``problem.objective`` is not ``"latency"``.
        InfeasibleError: if some node can run on no device.
        ModelTooLargeError: if the model would not fit ``budget`` (or outgrows it).
        SolverLimitError: if ``budget``'s deadline passes while building.
    """
    if problem.objective != "latency":
        raise ValueError(f"the MOIRAI MILP minimises latency; problem.objective is {problem.objective!r}")
    if budget is not None:
        budget.admit(moirai_size(problem))
    data = derive(problem)
    if budget is not None:
        budget.check("listing the model's index sets")
    into, out, free = port_pairs(data)
    m = budgeted_model(budget, _NAME)
    m.unit = data.unit  # seconds per time unit of the model
    m.horizon = data.horizon  # big-M, in time units
    m.positions = len(data.nodes)  # big-M of the plan-order constraints
    H = data.horizon
    # Sets
    m.V = pyo.Set(initialize=data.nodes, ordered=True)  # nodes, topological order
    m.K = pyo.Set(initialize=data.devices, ordered=True)  # devices
    m.A = pyo.Set(initialize=list(data.p), dimen=2)  # (v, k): v can run on k
    m.E = pyo.Set(initialize=list(problem.graph.edges), dimen=2)  # edges u -> v
    m.T = pyo.Set(initialize=data.transfers, dimen=2)  # transfer tasks (u, d)
    m.W = pyo.Set(initialize=list(data.link), dimen=3)  # (u, k', d): positive-time channel k' -> d
    m.N = pyo.Set(initialize=data.need, dimen=3)  # (u, v, d): v on d needs transfer (u, d)
    m.P = pyo.Set(initialize=sorted({(i, j) for i, j, _ in data.pairs}), dimen=2)  # unordered node pairs
    m.PK = pyo.Set(initialize=data.pairs, dimen=3)  # (i, j, k): both can run on k
    m.QIn = pyo.Set(initialize=into, dimen=4)  # (u, d, v, d): both into d
    m.QOut = pyo.Set(initialize=out, dimen=5)  # (u, d, v, e, k): both out of k
    m.R = pyo.Set(initialize=free, dimen=2)  # (u, v): producers whose transfers' order is free
    m.Sink = pyo.Set(initialize=[v for v in data.nodes if not any(True for _ in problem.graph.successors(v))])
    m.Cap = pyo.Set(initialize=sorted(data.capacity))  # devices with a memory limit
    m.Col = pyo.Set(initialize=data.colocated, dimen=3)  # (v, rep, k): colocation
    # Params
    m.p = pyo.Param(m.A, initialize=data.p)  # p_ik
    m.pc = pyo.Param(m.W, initialize=data.link)  # p^comm_{u k' d}
    m.longest = pyo.Param(m.T, initialize=data.longest)  # max_k' p^comm_{u k' d}
    m.mem_unit = mu = byte_unit([*data.memory.values(), *data.capacity.values()])  # bytes per memory unit
    m.mem = pyo.Param(m.V, initialize={v: b / mu for v, b in data.memory.items()})  # m_i
    m.cap = pyo.Param(m.Cap, initialize={k: b / mu for k, b in data.capacity.items()})  # Mem_k
    # Vars
    m.x = pyo.Var(m.A, domain=pyo.Binary)  # x_ik: node i on device k
    m.S = pyo.Var(m.V, bounds=(0, H))  # start time S_i
    m.TS = pyo.Var(m.T, bounds=(0, H))  # start of transfer (u, d)
    m.y = pyo.Var(m.T, bounds=(0, 1))  # z_q: transfer (u, d) happens (integral when x is)
    m.w = pyo.Var(m.W, bounds=(0, 1))  # u_qk'k'': it happens from k' (integral when x is)
    m.delta = pyo.Var(m.P, domain=pyo.Binary)  # delta_ij = 1: i runs before j on a shared device
    m.pi = pyo.Var(m.R, domain=pyo.Binary)  # delta_qr = 1: u's transfers hold a shared port before v's
    m.r = pyo.Var(m.V, bounds=(0, len(data.nodes) - 1), initialize=0)  # position in the plan order
    m.makespan = pyo.Var(bounds=(0, H))  # objective (4)
    # Expressions
    m.C = pyo.Expression(m.V, rule=lambda m, v: m.S[v] + sum(m.p[v, k] * m.x[v, k] for k in m.K if (v, k) in m.A))
    m.TC = pyo.Expression(m.T, rule=lambda m, u, d: m.TS[u, d] + sum(
        m.pc[u, k, d] * m.w[u, k, d] for k in m.K if (u, k, d) in m.W))  # transfer end
    m.port = pyo.Expression(m.T, rule=lambda m, u, d: sum(m.w[u, k, d] for k in m.K if (u, k, d) in m.W))
    # Objective (4)
    m.obj = pyo.Objective(expr=m.makespan, sense=pyo.minimize)
    _constraints(m, H)
    return m


def _x(m: pyo.ConcreteModel, v: str, k: str) -> object:
    return m.x[v, k] if (v, k) in m.A else 0


def _constraints(m: pyo.ConcreteModel, H: float) -> None:
    # (4) makespan is the last completion
    m.last = pyo.Constraint(m.Sink, rule=lambda m, v: m.makespan >= m.C[v])
    # valid cuts: a device's nodes, a port's transfers fit one after another before the makespan
    m.busy = pyo.Constraint(m.K, rule=lambda m, k: m.makespan >= sum(
        m.p[v, k] * m.x[v, k] for v in m.V if (v, k) in m.A))
    m.in_busy = pyo.Constraint(m.K, rule=lambda m, d: m.makespan >= sum(
        m.pc[u, k, e] * m.w[u, k, e] for u, k, e in m.W if e == d))
    m.out_busy = pyo.Constraint(m.K, rule=lambda m, k: m.makespan >= sum(
        m.pc[u, s, d] * m.w[u, s, d] for u, s, d in m.W if s == k))
    # (4c) one device per node
    m.assign = pyo.Constraint(m.V, rule=lambda m, v: sum(m.x[v, k] for k in m.K if (v, k) in m.A) == 1)
    # colocation: a member is on k iff its group's first node is
    m.colocate = pyo.Constraint(m.Col, rule=lambda m, v, r, k: (
        pyo.Constraint.Skip if (v, k) not in m.A and (r, k) not in m.A else _x(m, v, k) == _x(m, r, k)))
    # (5) memory
    m.memory = pyo.Constraint(m.Cap, rule=lambda m, k: sum(
        m.mem[v] * m.x[v, k] for v in m.V if (v, k) in m.A) <= m.cap[k])
    # (4a) precedence between nodes
    m.precede = pyo.Constraint(m.E, rule=lambda m, u, v: m.S[v] >= m.C[u])
    # (4a) a transfer starts after its producer and ends within the horizon
    m.ready = pyo.Constraint(m.T, rule=lambda m, u, d: m.TS[u, d] >= m.C[u])
    m.within = pyo.Constraint(m.T, rule=lambda m, u, d: m.TC[u, d] <= H)
    # (4a) a consumer on d starts after the transfer to d ends
    m.arrive = pyo.Constraint(m.N, rule=lambda m, u, v, d: m.S[v] >= m.TC[u, d] - H * (1 - m.x[v, d]))
    m.arrive_cut = pyo.Constraint(m.N, rule=lambda m, u, v, d: m.S[v] >= m.C[u] + m.TC[u, d] - m.TS[u, d]
                                  - m.longest[u, d] * (1 - m.x[v, d]))
    # (7) z_q: the transfer (u, d) happens if a successor is on d and u is not
    m.needed = pyo.Constraint(m.N, rule=lambda m, u, v, d: m.y[u, d] >= m.x[v, d] - _x(m, u, d))
    # (7) u_qk'k'': it goes over k' -> d iff u is on k'
    m.channel = pyo.Constraint(m.W, rule=lambda m, u, k, d: m.w[u, k, d] >= m.x[u, k] + m.y[u, d] - 1)
    m.channel_src = pyo.Constraint(m.W, rule=lambda m, u, k, d: m.w[u, k, d] <= m.x[u, k])
    # plan order: a position per node, increasing along edges and every order the model picks
    m.topological = pyo.Constraint(m.E, rule=lambda m, u, v: m.r[v] >= m.r[u] + 1)
    # (6) no overlap of unordered nodes sharing device k
    m.after = pyo.Constraint(m.PK, rule=lambda m, i, j, k: m.S[i] >= m.C[j] - H * m.delta[i, j]
                             - H * (2 - m.x[i, k] - m.x[j, k]))
    m.before = pyo.Constraint(m.PK, rule=lambda m, i, j, k: m.S[j] >= m.C[i] - H * (1 - m.delta[i, j])
                              - H * (2 - m.x[i, k] - m.x[j, k]))
    n = m.positions
    m.after_r = pyo.Constraint(m.PK, rule=lambda m, i, j, k: m.r[i] >= m.r[j] + 1 - n * m.delta[i, j]
                               - n * (2 - m.x[i, k] - m.x[j, k]))
    m.before_r = pyo.Constraint(m.PK, rule=lambda m, i, j, k: m.r[j] >= m.r[i] + 1 - n * (1 - m.delta[i, j])
                                - n * (2 - m.x[i, k] - m.x[j, k]))
    # (8) congestion: transfers into one device serialize, transfers out of one device serialize
    _serialize(m, H, m.QIn, lambda m, u, d, v, e: m.port[u, d] + m.port[v, e], "in")
    _serialize(m, H, m.QOut, lambda m, u, d, v, e, k: m.w[u, k, d] + m.w[v, k, e], "out")


def _serialize(m: pyo.ConcreteModel, H: float, pairs: pyo.Set, both: Callable[..., object], name: str) -> None:
    """(8) for ``pairs`` of transfers ``(u, d)``, ``(v, e)`` that hold one port when ``both(...)`` is 2.

    ``u``'s transfer holds the port first when ``pi[u, v]`` is 1 or the order is fixed (``u == v``:
    destination name order, ``d < e``; ``v`` a descendant of ``u``); the plan order agrees.
    """
    def idle(m, u, d, v, e, *k):  # 1 per port user that is absent
        return 2 - both(m, u, d, v, e, *k)

    def first(m, u, d, v, e, *k):  # (u, d) then (v, e)
        later = 0 if (u, v) not in m.R else 1 - m.pi[u, v]
        return m.TS[v, e] >= m.TC[u, d] - H * later - H * idle(m, u, d, v, e, *k)

    def second(m, u, d, v, e, *k):  # (v, e) then (u, d)
        if (u, v) not in m.R:
            return pyo.Constraint.Skip
        return m.TS[u, d] >= m.TC[v, e] - H * m.pi[u, v] - H * idle(m, u, d, v, e, *k)

    n = m.positions

    def first_r(m, u, d, v, e, *k):
        if (u, v) not in m.R:
            return pyo.Constraint.Skip
        return m.r[v] >= m.r[u] + 1 - n * (1 - m.pi[u, v]) - n * idle(m, u, d, v, e, *k)

    def second_r(m, u, d, v, e, *k):
        if (u, v) not in m.R:
            return pyo.Constraint.Skip
        return m.r[u] >= m.r[v] + 1 - n * m.pi[u, v] - n * idle(m, u, d, v, e, *k)

    for suffix, rule in (("first", first), ("second", second), ("first_r", first_r), ("second_r", second_r)):
        m.add_component(f"{name}_{suffix}", pyo.Constraint(pairs, rule=rule))


def extract(model: pyo.ConcreteModel, problem: Problem) -> list[Stage]:
    """Stages reproducing the solved model's assignment and plan order.

    The plan order sorts the nodes by their position ``r`` (then topological index, for nodes the
    model leaves unordered), as a topological sort so that it stays topological even if solver
    tolerances blur two positions. The order is cut into stages by :func:`torchplace.plan.stages_from_order`.
    """
    assignment = {v: k for (v, k), var in model.x.items() if var.value is not None and var.value > 0.5}
    topo = {v: i for i, v in enumerate(problem.graph.topological_order())}
    key = {v: (pyo.value(model.r[v]), topo[v]) for v in model.V}
    order = nx.lexicographical_topological_sort(problem.graph.nx, key=key.__getitem__)
    return stages_from_order(problem, list(order), assignment)


def initialize(model: pyo.ConcreteModel, problem: Problem, stages: Sequence[Stage]) -> None:
    """Set every variable of ``model`` to the simulated schedule of ``stages`` (a MIP start).

    The module docstring's first argument: positions are the plan order, ``delta`` and ``pi``
    follow them, times are the simulation's (in model units), a transfer that is not made starts
    when its producer completes. The start is feasible, so HiGHS's first incumbent is this plan.
    """
    sched = costmodel.simulate(problem, stages)
    pos = {v: i for i, (v, _) in enumerate(costmodel.plan_order(problem, stages))}
    unit, dev = model.unit, sched.device_of
    g = problem.graph
    for (v, k), var in model.x.items():
        var.value = float(dev[v] == k)
    for v in model.V:
        _set(model.S[v], sched.start[v] / unit)
        model.r[v].value = float(pos[v])
    moved = {(t.node, t.dst): t.start / unit for t in sched.transfers}
    for u, d in model.T:
        made = dev[u] != d and any(dev[w] == d for w in g.successors(u))
        model.y[u, d].value = float(made)
        _set(model.TS[u, d], moved.get((u, d), sched.finish[u] / unit))
    for (u, k, d), var in model.w.items():
        var.value = model.y[u, d].value * float(dev[u] == k)
    for (i, j), var in model.delta.items():
        var.value = float(pos[i] < pos[j])
    for (u, v), var in model.pi.items():
        var.value = float(pos[u] < pos[v])
    _set(model.makespan, sched.makespan / unit)


def _set(var: Any, value: float) -> None:
    """A start value, within the variable's bounds: the horizon bounds every plan's times, so a
    value past it is float rounding, and Pyomo would warn about it."""
    lo, hi = var.bounds
    var.value = min(max(value, lo if lo is not None else value), hi if hi is not None else value)


def _size(model: pyo.ConcreteModel) -> dict[str, int]:
    rows = sum(1 for _ in model.component_data_objects(pyo.Constraint, active=True))
    cols = sum(1 for _ in model.component_data_objects(pyo.Var))
    ints = sum(1 for v in model.component_data_objects(pyo.Var) if v.is_integer())
    return {"rows": rows, "cols": cols, "integers": ints}


def solve(problem: Problem, *, time_limit: float | None = None, mip_gap: float = 1e-6,
          verbose: bool = False, warm_start: Plan | None = None) -> Plan:
    """Minimise the latency of ``problem`` with the MOIRAI MILP; return the simulated plan.

    Contiguity is not modelled: the plan is built and validated for
    ``dataclasses.replace(problem, contiguous=False)``.

    Args:
        time_limit: seconds for everything: building the model, handing it to HiGHS, the solve
            and the plan (HiGHS gets what is left). ``None``: no limit.
        warm_start: a plan for ``problem`` (e.g. m-SCT's) that HiGHS starts from as its first
            incumbent (:func:`initialize`); the result is never slower than it, and when the time
            limit stops the solver before HiGHS has any incumbent, the result is this plan (status
            ``"time_limit"``, ``meta["stopped"]`` says where it stopped).

    Returns:
        A Plan whose objective is the simulated makespan (:func:`torchplace.costmodel.simulate`)
        and whose lower bound is the larger of the MILP's proven bound and the combinatorial
        latency bound. Status ``"optimal"`` when HiGHS proved optimality (the simulation then
        reproduces the MILP's makespan up to HiGHS's tolerances); ``"time_limit"`` when the
        limit stopped HiGHS; ``"feasible"`` only if tolerances left the simulation above the
        MILP's value by more than the slack allowed for them. ``meta`` holds ``milp_objective``,
        ``milp_bound`` (seconds), ``rows``, ``cols``, ``integers``.

    Raises:
        ValueError: for a throughput problem.
        InfeasibleError: if no placement meets memory, colocation and device support.
        SolverLimitError: if the time limit passed before HiGHS found any placement (also while
            the model was built) and there is no ``warm_start``.
        ModelTooLargeError: if the model would not fit in the solver memory budget or the time
            limit (e.g. an operator graph of hundreds of nodes: fuse it, or use method 'auto').
    """
    budget = Budget(_NAME, time_limit)
    problem = dataclasses.replace(problem, contiguous=False)
    try:
        model = build(problem, budget=budget)
        if warm_start is not None:
            initialize(model, problem, warm_start.stages)
        res = solve_model(model, name=_NAME, mip_gap=mip_gap, verbose=verbose, presolve=False,
                          warm_start=warm_start is not None, budget=budget, unit=model.unit)
    except SolverLimitError as e:
        if warm_start is None or isinstance(e, ModelTooLargeError):
            raise
        # The limit stopped the build, the hand-over or HiGHS before its first incumbent: the
        # start is that incumbent (it is feasible), so it is the answer at this limit.
        bound = max(e.bound or 0.0, latency_lower_bound(problem))
        return Plan.build(problem, warm_start.stages, solver="moirai", seconds=budget.elapsed(),
                          lower_bound=round_up_bound(problem, bound), status="time_limit",
                          meta={"milp_objective": None, "milp_bound": e.bound, "stopped": str(e)})
    except InfeasibleError as e:
        need = sum(r.param_bytes + r.temp_bytes for _, r in problem.graph.records())
        caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
        raise InfeasibleError(f"{e}: the nodes need {need} bytes in all, device memory {caps}; check memory, "
                              "colocation groups and which devices can run each node") from e
    stages = extract(model, problem)
    milp_objective, milp_bound = res.objective * model.unit, max(0.0, res.bound - _BOUND_SLACK) * model.unit
    simulated = costmodel.evaluate_stages(problem, stages)[0]
    if warm_start is not None and warm_start.objective < simulated:  # HiGHS refused the start
        stages, simulated = list(warm_start.stages), warm_start.objective
    slack = mip_gap * simulated + _BIG_M_SLACK * model.horizon * model.unit
    status = res.status if res.status == "time_limit" else (
        "optimal" if simulated <= milp_objective + slack else "feasible")
    return Plan.build(problem, stages, solver="moirai", seconds=budget.elapsed(),
                      lower_bound=round_up_bound(problem, max(milp_bound, latency_lower_bound(problem))), status=status,
                      meta={"milp_objective": milp_objective, "milp_bound": milp_bound, **_size(model)})
