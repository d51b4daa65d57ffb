"""m-SCT: Small Communication Time scheduling with memory constraints (Baechi Sec. 2.4, 4.2, 4.3).

Step 1, favourite children (Hanen & Munier 1995; Baechi eq. (2)). With unlimited devices, each
task ``i`` has at most one *favourite child* that runs right after it on its device without a
transfer, and each task at most one *favourite parent*. With ``x_ij = 0`` when ``j`` is ``i``'s
favourite child (``x_ij = 1``: the edge pays its communication time ``c_ij``):

    min  w
    s.t. t_i + p_i <= w                              every task ends by the makespan
         t_j >= t_i + p_i + c_ij x_ij                 (i, j) in E
         sum_{j in succ(i)} x_ij >= |succ(i)| - 1     at most one favourite child
         sum_{i in pred(j)} x_ij >= |pred(j)| - 1     at most one favourite parent
         t >= 0,  0 <= x <= 1                          relaxed (Baechi Sec. 2.4)

Baechi's printed constraints are garbled in extraction; this is Hanen-Munier's form, whose rows
read exactly the captions of eq. (2). The LP goes to HiGHS through
:func:`torchplace.solvers.milp.highs.solve_model` (Baechi uses Mosek's interior point, Sec. 4.2).

Step 2, rounding (Sec. 2.4, 4.3): ``j`` is ``i``'s favourite child iff ``x_ij < threshold``. With
``threshold <= 0.5`` the rows above allow at most one such child per parent and one such parent
per child (two values below 0.5 with every other value at most 1 sum to less than ``k - 1``), so
Baechi's repair of lowering the threshold to 0.1 is not needed here; larger thresholds are
accepted and the conflicts resolved by the smallest ``x``, then the topological order.

Heterogeneous data. ``p_i`` is the node's time on its fastest device; ``c_ij`` the mean of
:meth:`Problem.link_time` over ordered pairs of distinct devices that can run ``i`` and ``j``
(0 inside one colocation group); an edge whose ends share no device has ``x_ij`` fixed to 1. So the
LP value is not a bound for this cost model (the Hanen-Munier model is exact only on identical
devices with ``max c <= min p``); it is reported in ``meta`` only.

Step 3, finite devices with memory (Sec. 2.4): the ETF loop of
:func:`torchplace.solvers.baechi.etf.list_schedule` in which a ready node whose favourite parent
is still the last node on its device goes to that device when it has room, and wins ties on start
time. A device without room is skipped (m-SCT "excludes it from future placements").
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping

import pyomo.environ as pyo

from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.baechi.etf import DeviceRule, list_schedule
from torchplace.solvers.baechi.state import SCHEDULER_WAY_OUT, ListState, check_latency
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.highs import MilpResult, solve_model

__all__ = ["build_lp", "favourite_children", "m_sct", "sct_costs"]


def sct_costs(problem: Problem, tick: Callable[[], None] = lambda: None,
              ) -> tuple[dict[str, float], dict[tuple[str, str], float], set[tuple[str, str]]]:
    """``p_i``, ``c_ij`` and the edges that must communicate (module docstring, heterogeneous data);
    ``tick`` is called once per device pair of an edge (a time limit's check: thousands of
    devices make millions of pairs on one edge)."""
    g, devices = problem.graph, problem.cluster.devices
    runs = {v: [d for d in devices if math.isfinite(problem.node_time(v, d))] for v in g}
    p = {v: min((problem.node_time(v, d) for d in runs[v]), default=0.0) for v in g}
    c: dict[tuple[str, str], float] = {}
    split: set[tuple[str, str]] = set()

    def pair_times(u: str, v: str) -> Iterator[float]:
        for a in runs[u]:
            for b in runs[v]:
                if a.name != b.name:
                    tick()
                    yield problem.link_time(u, a, b)

    for u, v in g.edges:
        colocated = g.record(u).colocation is not None and g.record(u).colocation == g.record(v).colocation
        shared = len({d.name for d in runs[u]} & {d.name for d in runs[v]})
        pairs = len(runs[u]) * len(runs[v]) - shared
        c[u, v] = 0.0 if colocated or not pairs else math.fsum(pair_times(u, v)) / pairs
        if not shared:
            split.add((u, v))
    return p, c, split


def build_lp(problem: Problem, *, budget: Budget | None = None) -> pyo.ConcreteModel:
    """The relaxed SCT program of the module docstring (Baechi eq. (2), ``x`` continuous); with a
    ``budget``, building stops when it runs out (SolverLimitError)."""
    g = problem.graph
    p, c, split = sct_costs(problem, budget.ticks("computing the LP's costs", every=4096) if budget else lambda: None)
    m = budgeted_model(budget, "sct_lp")
    # tasks in topological order, and precedence edges
    m.V = pyo.Set(initialize=g.topological_order(), ordered=True)
    m.E = pyo.Set(initialize=sorted(g.edges), dimen=2, ordered=True)
    # tasks with children / with parents
    m.S = pyo.Set(initialize=[v for v in m.V if g.nx.out_degree(v) > 0], ordered=True)
    m.P = pyo.Set(initialize=[v for v in m.V if g.nx.in_degree(v) > 0], ordered=True)
    # fastest compute time p_i and mean communication time c_ij
    m.p = pyo.Param(m.V, initialize=p)
    m.c = pyo.Param(m.E, initialize=c)
    # start times, makespan, and "edge (i, j) communicates" (0: j is i's favourite child)
    m.t = pyo.Var(m.V, domain=pyo.NonNegativeReals)
    m.w = pyo.Var(domain=pyo.NonNegativeReals)
    m.x = pyo.Var(m.E, bounds=lambda m, i, j: (1.0 if (i, j) in split else 0.0, 1.0))
    # minimise the makespan
    m.obj = pyo.Objective(expr=m.w, sense=pyo.minimize)
    # every task ends by the makespan
    m.ends = pyo.Constraint(m.V, rule=lambda m, i: m.t[i] + m.p[i] <= m.w)
    # a child starts after its parent ends plus the communication it pays
    m.prec = pyo.Constraint(m.E, rule=lambda m, i, j: m.t[j] >= m.t[i] + m.p[i] + m.c[i, j] * m.x[i, j])
    # at most one favourite child
    m.one_child = pyo.Constraint(
        m.S, rule=lambda m, i: sum(m.x[i, j] for j in g.successors(i)) >= g.nx.out_degree(i) - 1)
    # at most one favourite parent
    m.one_parent = pyo.Constraint(
        m.P, rule=lambda m, j: sum(m.x[i, j] for i in g.predecessors(j)) >= g.nx.in_degree(j) - 1)
    return m


def favourite_children(model: pyo.ConcreteModel, threshold: float = 0.5) -> dict[str, str]:
    """child -> favourite parent from a solved :func:`build_lp` (rounding of Baechi Sec. 4.3)."""
    order = {v: i for i, v in enumerate(model.V)}
    below = sorted(
        ((pyo.value(model.x[i, j]), order[i], order[j], i, j) for i, j in model.E
         if pyo.value(model.x[i, j]) < threshold),
    )
    parent_of: dict[str, str] = {}
    has_child: set[str] = set()
    for *_, i, j in below:
        if i not in has_child and j not in parent_of:
            parent_of[j] = i
            has_child.add(i)
    return parent_of


def m_sct(problem: Problem, *, threshold: float = 0.5, sequential_comm: bool = False,
          device_rule: DeviceRule = "finish", time_limit: float | None = None) -> Plan:
    """Place and order ``problem``'s nodes with m-SCT (Baechi Sec. 2.4, 4.3).

    Args:
        problem: a latency problem.
        threshold: ``x_ij`` below it makes ``j`` the favourite child of ``i`` (Baechi uses 0.1).
        sequential_comm: sequential communication queues in the scheduler's estimate (Sec. 3.4).
        device_rule: device choice of non-pinned nodes, as in :func:`m_etf`.
        time_limit: seconds for everything: building and solving the LP, then the list schedule
            (which has no plan before every node is placed).

    Returns:
        A ``"feasible"`` non-contiguous plan; ``meta`` holds ``lp_status``, ``lp_objective``,
        ``lp_seconds``, ``lp_rows``, ``lp_cols`` and ``favourite_children`` (their count).

    Raises:
        InfeasibleError: when a ready node fits on no device.
        SolverLimitError: when HiGHS finds no LP solution within ``time_limit``.
    """
    t0 = time.perf_counter()
    check_latency(problem, "m-SCT")
    budget = Budget("m-SCT LP relaxation", time_limit, way_out="use method 'm-etf'")
    model = build_lp(problem, budget=budget)
    lp = solve_model(model, name="m-SCT LP relaxation", budget=budget)
    parent_of = favourite_children(model, threshold)
    budget.way_out = SCHEDULER_WAY_OUT
    state = ListState(problem, sequential_comm=sequential_comm, check=lambda: budget.check("preparing"))
    list_schedule(state, solver="m-SCT", device_rule=device_rule, favourite_parent=parent_of, budget=budget)
    return state.plan("m-sct", t0, _lp_meta(model, lp, parent_of, threshold))


def _lp_meta(model: pyo.ConcreteModel, lp: MilpResult, parent_of: Mapping[str, str], threshold: float) -> dict[str, object]:
    return {
        "lp_status": lp.status,
        "lp_objective": lp.objective,
        "lp_seconds": lp.seconds,
        "lp_rows": model.nconstraints(),
        "lp_cols": model.nvariables(),
        "favourite_children": len(parent_of),
        "threshold": threshold,
    }
