"""The max-load integer program (Tarnawski et al. 2020, App. C, Fig. 7), contiguous or not.

    min MaxLoad
    s.t. sum_i x[u,i] = 1                                   every unit on one device      (15)
         the devices' sets ordered contiguous (optional)    see below                    (16)
         sum_u m_u x[u,i] <= M_i                            devices with a memory limit   (17)
         CommIn[p,i]  >= x[w,i] - x[p,i]   (p -> w)         input tensor p enters i       (18)
         CommOut[p,i] >= x[p,i] - x[w,i]   (p -> w)         output tensor p leaves i      (19)
         MaxLoad >= sum_u t_u(i) x[u,i] + sum_p c_p (CommIn[p,i] + CommOut[p,i])  paying (20)
         MaxLoad >= sum_u t_u(i) x[u,i]                     CPUs: no transfer cost        (21)

The IP's value is exactly the cost model's (:mod:`torchplace.costmodel`): each producer ``p`` is
paid at most once per side of a device however many consumers it has there, because ``CommIn`` and
``CommOut`` are indexed by producer, not by edge (App. A, the text under Fig. 5).

Generalisations of Fig. 7, each following the cost model:

* devices of any kind: a device that pays transfers (``Device.pays_transfer``) gets (20), a CPU gets
  (21); a memory limit is enforced on every device that has one, CPUs included (17);
* a unit is a colocation group (or a single node): one ``x`` per unit and device, which is the
  paper's ``x[u,i] = x[v,i]`` for colocated ``u, v`` (App. A, "Non-pipelined model-parallel
  training") with the equalities substituted; a unit that cannot run on a device (no time for its
  kind) or does not fit its memory has no ``x`` there (fixed to 0);
* contiguity (16), when asked for, means what the ideals DP searches (:mod:`torchplace.solvers.dp`,
  Sec. 5.1.1, Fact 5.2; Sec. 5.3 for training) and :func:`torchplace.plan.Plan.validate` checks:
  each device holds one contiguous piece of the forward graph (and one of the backward graph), and
  the pieces can be ordered so that data only flows forward (Archer et al. 2024, Sec. 2.2, the
  acyclic quotient; their MTPP), the backward pieces in the forward pieces' order or in its
  reverse. :mod:`~torchplace.solvers.milp.contiguity` states it: Lemma A.1 (11)-(13) per device on
  each side's induced subgraph, per side an order of the devices that every path follows, and the
  backward order tied to the forward one by one binary. Devices of one class are fixed in index
  order on the first side (relabel them by pipeline position) when ``symmetry="none"``: without
  that, every relabelling and every order of empty devices is a separate solution (BERT-24
  layers: not proven in 9 minutes, against 1.5 s).

Symmetry (devices of one class, i.e. same kind, memory and transfer rule, are
interchangeable, and branch-and-bound may explore every relabelling of a solution):

* ``"none"`` (default): HiGHS detects the permutation symmetry of identical devices itself
  (option ``mip_detect_symmetry``, on by default); on BERT-3/6 and BERT-24 the explicit rules
  below made it slower. A contiguous model fixes each class's devices in pipeline order (above);
  the rules below replace that fixing (BERT-24 layers, contiguous: ``"index"`` 73 s, ``"load"``
  not proven in 120 s).
* ``"index"``: within a class ``d_1, ..., d_r``, a unit may go on ``d_j`` only if
  ``d_{j-1}`` holds a unit of smaller index (units are in topological order):
  ``x[u, d_j] <= F[u-1, d_{j-1}]`` with prefix sums ``F[u, d] = F[u-1, d] + x[u, d]``.
  Valid: sort any solution's non-empty devices of the class by their smallest unit, empty ones last.
* ``"load"``: ``Load[d_1] >= Load[d_2] >= ...``. Valid: sort the class's devices by load.

The IP and the DP search the same space, training graphs included (the DP once per orientation of
the backward pieces, :mod:`torchplace.solvers.contract`), and agree;
:mod:`torchplace.solvers.milp.mtpp` is Archer's position-indexed MIP of the same space for
inference.

Non-contiguous plans: any assignment runs as a pipeline of stages (Sec. 5.2, "virtual devices"):
:func:`stages_from_assignment` cuts each device's nodes into pieces whose stage order is acyclic.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import pyomo.environ as pyo

from torchplace import costmodel
from torchplace.errors import InfeasibleError, ModelTooLargeError, SolverLimitError, UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.dp import device_classes
from torchplace.solvers.dp_infeasible import kind_fix
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp import contiguity
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.contiguity import stages_from_assignment
from torchplace.solvers.milp.highs import MilpResult, solve_model
from torchplace.solvers.milp.size import maxload_size
from torchplace.solvers.pipelined import solve_pipelined, training_pipeline

__all__ = ["START_SECONDS", "START_SHARE", "Units", "assignment_units", "build", "byte_unit", "extract", "initialize",
           "model_size", "row", "solve", "solve_started", "stages_from_assignment", "time_unit", "unit_for"]

SYMMETRY = ("none", "index", "load")
_MOST_UNITS = 1e4  # largest time, in model units, below which times are not scaled down (time_unit)
_MOST_BYTES = 1e12  # largest byte count below which memory rows are not scaled down (byte_unit)
START_SHARE = 0.25
"""Share of the time limit that :func:`solve_started` gives the search for its start."""
START_SECONDS = 10.0
"""Seconds :func:`solve_started` gives the search for its start when there is no time limit."""


@dataclass(frozen=True)
class Units:
    """What the IP assigns: colocation groups and single nodes, in topological order.

    Attributes:
        nodes: every node in the graph's topological order.
        members: node ids of each unit; unit ``i`` starts before unit ``i + 1`` in ``nodes``.
        of: node id -> unit index.
        time: ``time[i][d]`` seconds of unit ``i`` on device index ``d`` (``inf``: cannot run).
        memory: bytes of each unit (parameters plus working memory).
        allowed: ``(unit, device index)`` pairs where the unit can run and fits alone.
        fanout: producer node -> the other units reading its output, for producers whose transfer
            costs time.
    """

    nodes: tuple[str, ...]
    members: tuple[tuple[str, ...], ...]
    of: Mapping[str, int]
    time: tuple[tuple[float, ...], ...]
    memory: tuple[int, ...]
    allowed: frozenset[tuple[int, int]]
    fanout: Mapping[str, tuple[int, ...]]

    def x_or_zero(self, m: pyo.ConcreteModel, u: int, d: int) -> pyo.Var | int:
        """``m.x[u, d]``, or 0 where the unit cannot go."""
        return m.x[u, d] if (u, d) in self.allowed else 0


def assignment_units(problem: Problem) -> Units:
    """Group ``problem``'s nodes into :class:`Units` and tabulate their costs per device.

    Raises:
        InfeasibleError: if some unit can run on no device (no time for any present kind, or too
            big for every device that could run it).
    """
    g, devices = problem.graph, problem.cluster.devices
    nodes = tuple(g.topological_order())
    first: dict[str, int] = {}
    of: dict[str, int] = {}
    groups: list[list[str]] = []
    for v in nodes:
        key = g.record(v).colocation
        key = f"c:{key}" if key is not None else f"n:{v}"
        if key not in first:
            first[key] = len(groups)
            groups.append([])
        of[v] = first[key]
        groups[first[key]].append(v)
    times = tuple(tuple(math.fsum(problem.node_time(v, d) for v in grp) for d in devices) for grp in groups)
    memory = tuple(sum(g.record(v).param_bytes + g.record(v).temp_bytes for v in grp) for grp in groups)
    allowed = frozenset(
        (u, i) for u in range(len(groups)) for i, d in enumerate(devices)
        if math.isfinite(times[u][i]) and (d.memory_bytes is None or memory[u] <= d.memory_bytes)
    )
    for u, grp in enumerate(groups):  # first what no memory fixes
        if not any(math.isfinite(t) for t in times[u]):
            raise InfeasibleError(
                f"nodes {grp[:5]} (one colocation group) can run on none of the device kinds "
                f"{sorted({d.kind for d in devices})}: {kind_fix(problem, grp)}")
    for u, grp in enumerate(groups):
        if not any((u, i) in allowed for i in range(len(devices))):
            # a floor, not a memory that fits (the other units need room too): no min_memory_bytes
            raise InfeasibleError(
                f"nodes {grp[:5]} (one colocation group) need {memory[u]} bytes, more than any device that can "
                f"run them has: raise max_memory to at least {memory[u]} bytes")
    fanout = {
        p: tuple(sorted({of[w] for w in g.successors(p)} - {of[p]}))
        for p in nodes if problem.transfer_time(p) > 0
    }
    fanout = {p: ws for p, ws in fanout.items() if ws}
    return Units(nodes, tuple(tuple(grp) for grp in groups), of, times, memory, allowed, fanout)


def row(expr: object, what: str) -> object:
    """A constraint expression, or Feasible for one that no variable is left in; a constant
    infeasible one raises InfeasibleError naming ``what``."""
    if expr is True:
        return pyo.Constraint.Feasible
    if expr is False:
        raise InfeasibleError(f"{what} cannot be met by any placement")
    return expr


def _device_loads(m: pyo.ConcreteModel, units: Units, problem: Problem) -> None:
    """``m.device_load[d]``: (20) for devices that pay transfers, (21) for the others."""
    pays = [d.pays_transfer for d in problem.cluster.devices]

    def load(m, d):
        work = sum(units.time[u][d] / m.unit * m.x[u, d] for u in m.U if (u, d) in units.allowed)
        if not pays[d]:
            return work
        return work + sum(m.c[p] * (m.cin[p, d] + m.cout[p, d]) for p in m.P)

    m.device_load = pyo.Expression(m.D, rule=load)


def _contiguity(m: pyo.ConcreteModel, units: Units, problem: Problem, fix_classes: bool) -> None:
    """(16): Lemma A.1 per device on each side's induced subgraph, and per side an order of the
    devices that data follows (:mod:`~torchplace.solvers.milp.contiguity`). With ``fix_classes``
    the devices of one class come in index order on the first side."""
    g = problem.graph
    side = contiguity.side_of(problem)
    m.E = pyo.Set(dimen=2, initialize=sorted((u, v) for u, v in g.edges if side[u] == side[v]))  # edges within a side
    m.z = contiguity.reach_var(m.V, m.D)  # some node of v's side on d is reachable from v

    def x(v: str, d: int) -> pyo.Var | int:
        return units.x_or_zero(m, units.of[v], d)

    contiguity.add_lemma_a1(m, z=m.z, x=x, nodes=m.V, edges=m.E, places=m.D)
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    fixed = [pair for c in device_classes(problem) if fix_classes
             for pair in itertools.combinations(sorted(index[name] for name in c.devices), 2)]
    sources = [(side[v], v) for v in units.nodes if any(side[w] == side[v] for w in g.successors(v))]
    contiguity.add_device_order(m, z=m.z, x=x, sides=contiguity.side_edges(problem, units.of), sources=sources,
                                places=range(len(problem.cluster)), fixed=fixed)


def _symmetry(m: pyo.ConcreteModel, units: Units, problem: Problem, rule: str) -> None:
    """Order interchangeable devices (see the module docstring)."""
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    pairs = [
        (index[a], index[b])
        for c in device_classes(problem) for a, b in zip(c.devices, c.devices[1:])
    ]
    m.SYM = pyo.Set(dimen=2, initialize=pairs)  # (earlier, later) devices of one class
    if rule == "load":
        m.sym_load = pyo.Constraint(m.SYM, rule=lambda m, a, b: m.device_load[a] >= m.device_load[b])
    elif rule == "index":
        m.PRE = pyo.Set(initialize=sorted({a for a, _ in pairs}))
        m.F = pyo.Var(m.U, m.PRE, bounds=(0, None))  # units up to u on device d
        m.sym_prefix = pyo.Constraint(
            m.U, m.PRE, rule=lambda m, u, d: m.F[u, d] == (m.F[u - 1, d] if u else 0) + units.x_or_zero(m, u, d))
        m.sym_first = pyo.Constraint(
            m.U, m.SYM, rule=lambda m, u, a, b: (m.x[u, b] <= (m.F[u - 1, a] if u else 0))
            if (u, b) in units.allowed else pyo.Constraint.Skip)
    elif rule != "none":
        raise UsageError(f"symmetry must be one of {SYMMETRY}, got {rule!r}")


def build(problem: Problem, *, contiguous: bool | None = None, symmetry: str = "none",
          budget: Budget | None = None) -> pyo.ConcreteModel:
    """The max-load IP of Fig. 7 for ``problem`` (see the module docstring).

    Args:
        contiguous: add (16); ``None`` takes ``problem.contiguous``.
        symmetry: ``"none"``, ``"index"`` or ``"load"`` (module docstring).
        budget: refuse a model too large for it, and stop building when it runs out.

    Raises:
        InfeasibleError: if some unit fits on no device.
        ModelTooLargeError: if the model would not fit ``budget`` (or outgrows it).
        SolverLimitError: if ``budget``'s deadline passes while building.
    """
    contiguous = problem.contiguous if contiguous is None else contiguous
    units = assignment_units(problem)
    if budget is not None:
        budget.admit(maxload_size(problem, units, contiguous, symmetry))
    devices = problem.cluster.devices
    pays = [d for d, dev in enumerate(devices) if dev.pays_transfer]
    m = budgeted_model(budget, "max-load IP")
    m.units = units
    m.unit = time_unit(units, problem)  # seconds per model time unit
    # Sets
    m.U = pyo.Set(initialize=range(len(units.members)))  # units, topological
    m.D = pyo.Set(initialize=range(len(devices)))  # devices, cluster order
    m.V = pyo.Set(initialize=units.nodes)  # nodes
    m.A = pyo.Set(dimen=2, initialize=sorted(units.allowed))  # (unit, device) that may be chosen
    m.P = pyo.Set(initialize=list(units.fanout))  # producers whose transfer costs time
    m.PD = pyo.Set(dimen=2, initialize=[(p, d) for p in units.fanout for d in pays])  # (producer, paying device)
    m.IN = pyo.Set(dimen=3, initialize=[  # (p, consumer unit w, d): p may enter d because of w
        (p, w, d) for p, ws in units.fanout.items() for w in ws for d in pays if (w, d) in units.allowed])
    m.OUT = pyo.Set(dimen=3, initialize=[  # (p, w, d): p may leave d towards w
        (p, w, d) for p, ws in units.fanout.items() for w in ws for d in pays if (units.of[p], d) in units.allowed])
    m.MEM = pyo.Set(initialize=[d for d, dev in enumerate(devices) if dev.memory_bytes is not None])
    # Params
    m.c = pyo.Param(m.P, initialize={p: problem.transfer_time(p) / m.unit for p in units.fanout})  # transfer time
    m.mem_unit = byte_unit([*units.memory, *(devices[d].memory_bytes for d in m.MEM)])  # bytes per memory unit
    m.cap = pyo.Param(m.MEM, initialize={d: devices[d].memory_bytes / m.mem_unit for d in m.MEM})  # memory units
    # Vars
    m.x = pyo.Var(m.A, domain=pyo.Binary)  # unit u on device d
    m.cin = pyo.Var(m.PD, bounds=(0, 1))  # CommIn: p's output is read on d but made elsewhere
    m.cout = pyo.Var(m.PD, bounds=(0, 1))  # CommOut: p's output is made on d and read elsewhere
    m.max_load = pyo.Var(bounds=(0, None))  # MaxLoad
    _device_loads(m, units, problem)
    # Objective
    m.obj = pyo.Objective(expr=m.max_load, sense=pyo.minimize)
    # Constraints
    m.assign = pyo.Constraint(m.U, rule=lambda m, u: sum(m.x[u, d] for d in m.D if (u, d) in units.allowed) == 1)
    m.memory = pyo.Constraint(  # (17)
        m.MEM, rule=lambda m, d: row(sum(units.memory[u] / m.mem_unit * m.x[u, d] for u in m.U if (u, d) in units.allowed) <= m.cap[d],
                                     f"the memory of {devices[d].name}"))
    m.comm_in = pyo.Constraint(  # (18)
        m.IN, rule=lambda m, p, w, d: m.cin[p, d] >= m.x[w, d] - units.x_or_zero(m, units.of[p], d))
    m.comm_out = pyo.Constraint(  # (19)
        m.OUT, rule=lambda m, p, w, d: m.cout[p, d] >= m.x[units.of[p], d] - units.x_or_zero(m, w, d))
    m.bottleneck = pyo.Constraint(m.D, rule=lambda m, d: m.max_load >= m.device_load[d])  # (20), (21)
    if contiguous:
        _contiguity(m, units, problem, fix_classes=symmetry == "none")
    _symmetry(m, units, problem, symmetry)
    return m


def time_unit(units: Units, problem: Problem) -> float:
    """Seconds per model time unit of a max-load MIP: :func:`unit_for` of its times."""
    finite = [t for row in units.time for t in row if math.isfinite(t)]
    return unit_for([*finite, *(problem.transfer_time(p) for p in units.fanout)])


def unit_for(times: Iterable[float]) -> float:
    """Seconds per model time unit: a power of ten that brings the largest of ``times`` into 1-10,000.

    Measured times can be 1e-5 s; HiGHS's absolute tolerances (1e-7 and so on) would then be a
    visible fraction of the objective, so such times are scaled up to 1-10. Times of 1e9 and more
    (a workload in nanoseconds or cycles) next to the 0/1 coefficients of the assignment rows are
    beyond what HiGHS's presolve handles (it fixed every column and proved an optimum twice the
    true one), so they are scaled down to 1,000-10,000 (not further: the tolerances again). Times
    come back in seconds on the way out. Every max-load MIP (this IP,
    :mod:`~torchplace.solvers.milp.mtpp`, the bounds in :mod:`~torchplace.solvers.milp.bounds`)
    works in these units, and so does the latency IP (:mod:`~torchplace.solvers.milp.latency`).
    """
    largest = max((t for t in times if 0 < t < math.inf), default=1.0)
    if largest < 1.0:
        return 10.0 ** math.floor(math.log10(largest))
    return 1.0 if largest < _MOST_UNITS else 10.0 ** (math.floor(math.log10(largest)) - 3)


def byte_unit(nbytes: Iterable[float]) -> float:
    """Bytes per model memory unit: 1, or for byte counts of 1e12 and more a power of ten that
    brings the largest of ``nbytes`` (memories and capacities of one model) into 1e9-1e10.

    HiGHS treats a matrix coefficient of 1e15 or more as infinite (its ``large_matrix_value``):
    memory rows of such nodes beside 0/1 rows ended in a model error read as a solution (no ``x``
    set: KeyError in extract), or in a plan over memory. Every MILP's memory rows (this IP,
    :mod:`~torchplace.solvers.milp.mtpp`, :mod:`~torchplace.solvers.milp.bounds`,
    :mod:`~torchplace.solvers.milp.latency`, :mod:`~torchplace.solvers.milp.moirai`) divide bytes by
    this unit; below 1e12 bytes (a GPU's memory, most hosts') they are unchanged, and larger ones are only rescaled.
    """
    largest = max((b for b in nbytes if 0 < b < math.inf), default=1.0)
    return 1.0 if largest < _MOST_BYTES else 10.0 ** (math.floor(math.log10(largest)) - 9)


def model_size(m: pyo.ConcreteModel) -> tuple[int, int]:
    """(rows, columns) of a built model."""
    rows = sum(1 for _ in m.component_data_objects(pyo.Constraint, active=True))
    cols = sum(1 for _ in m.component_data_objects(pyo.Var))
    return rows, cols


def extract(m: pyo.ConcreteModel, problem: Problem) -> dict[str, str]:
    """node id -> device name from the solved model's ``x``."""
    units: Units = m.units
    names = problem.cluster.names
    device_of = {u: names[d] for u, d in m.A if pyo.value(m.x[u, d]) > 0.5}
    return {v: device_of[units.of[v]] for v in units.nodes}


def _bound_for_plan(result: MilpResult, objective: float) -> float:
    """HiGHS's proven bound, clipped to the plan's objective when it exceeds it by rounding only."""
    if result.bound > objective and result.bound <= objective * (1 + 1e-7) + 1e-9:
        return objective  # integrality tolerance (x = 1 - 1e-9) shifts the bound by rounding only
    return result.bound


def initialize(m: pyo.ConcreteModel, problem: Problem, assignment: Mapping[str, str], symmetry: str) -> None:
    """Set every variable of ``m`` to the values of ``assignment`` (a MIP start).

    Devices of one class are relabelled to satisfy the symmetry rule first (in a contiguous model
    with ``symmetry="none"``: to follow the pipeline order). Contiguity's ``z`` is the proof's "some
    node of the set is reachable" (App. A, Lemma A.1, "only if"); the device orders are a
    topological order of the quotient graph, the backward one the same or reversed
    (:func:`~torchplace.solvers.milp.contiguity.device_orders`; left unset if there is none: then
    the assignment is not contiguous and no start).
    """
    units: Units = m.units
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    dev_of = {units.of[v]: index[assignment[v]] for v in units.nodes}
    orders = contiguity.device_orders(m.side_edges, m.D, dev_of) if hasattr(m, "o") else {}
    first = orders[m.S.first()] if orders and m.order_fixed else None
    mapping = _relabel(dev_of, problem, symmetry, units, first)
    dev_of = {u: mapping[d] for u, d in dev_of.items()}
    for (u, d) in m.A:
        m.x[u, d].value = float(dev_of[u] == d)
    for p, d in m.PD:
        m.cin[p, d].value = float(any(dev_of[w] == d for w in units.fanout[p]) and dev_of[units.of[p]] != d)
        m.cout[p, d].value = float(dev_of[units.of[p]] == d and any(dev_of[w] != d for w in units.fanout[p]))
    if hasattr(m, "z"):
        m.z.set_values(contiguity.reach_values(units.nodes, m.E, m.D, {v: dev_of[units.of[v]] for v in units.nodes}))
        contiguity.order_values(m, {s: None if o is None else [mapping[d] for d in o] for s, o in orders.items()})
    if hasattr(m, "F"):
        for d in m.PRE:
            total = 0.0
            for u in m.U:
                total += float(dev_of[u] == d)
                m.F[u, d].value = total
    m.max_load.value = max(pyo.value(m.device_load[d]) for d in m.D)


def _relabel(
    dev_of: Mapping[int, int], problem: Problem, symmetry: str, units: Units, order: list[int] | None = None
) -> dict[int, int]:
    """A permutation of the devices of each class after which ``dev_of`` meets the symmetry rule
    (``order``: the pipeline order that a contiguous model fixes within each class)."""
    devices = problem.cluster.devices
    index = {d.name: i for i, d in enumerate(devices)}
    held: dict[int, list[int]] = {}
    for u in sorted(dev_of):
        held.setdefault(dev_of[u], []).append(u)
    mapping: dict[int, int] = {}
    for c in device_classes(problem):
        members = [index[n] for n in c.devices]
        if order is not None:
            ranked = sorted(members, key=order.index)
        elif symmetry == "index":
            ranked = sorted(members, key=lambda d: (held[d][0] if d in held else math.inf, d))
        elif symmetry == "load":
            nodes = {d: {v for u in held.get(d, []) for v in units.members[u]} for d in members}
            load = {d: costmodel.device_cost(problem, nodes[d], devices[d]).load for d in members}
            ranked = sorted(members, key=lambda d: (-load[d], d))
        else:
            ranked = members
        mapping.update(zip(ranked, members))
    return mapping


def solve(
    problem: Problem,
    *,
    contiguous: bool | None = None,
    time_limit: float | None = None,
    mip_gap: float = 1e-6,
    warm_start: Plan | None = None,
    symmetry: str = "none",
) -> Plan:
    """Minimum max-load placement by the IP of Fig. 7, solved by HiGHS.

    Args:
        problem: a throughput problem.
        contiguous: each device's forward and backward nodes contiguous (``None``: the problem's
            own setting). A non-contiguous plan is validated against
            ``dataclasses.replace(problem, contiguous=False)``.
        time_limit: seconds for everything: building the model, handing it to HiGHS, the solve
            and the plan (HiGHS gets what is left). ``None``: no limit.
        mip_gap: relative gap at which HiGHS stops.
        warm_start: a plan whose assignment HiGHS starts from as its first incumbent (see
            :func:`initialize`); when the time limit stops the solver before HiGHS has any
            incumbent, the result is this plan (status ``"time_limit"``, ``meta["stopped"]``).
        symmetry: symmetry breaking among identical devices (module docstring).

    Returns:
        A Plan with status ``"optimal"`` or ``"time_limit"``. Its lower bound holds for every split,
        contiguous or not: HiGHS's proven bound for a non-contiguous IP, the simple bound
        (:func:`simple_lower_bound`) for a contiguous one (whose own proven bound, valid among
        contiguous splits only, is ``meta["milp_bound"]``).

    Training with a :class:`~torchplace.problem.Pipeline`: the memory rows (17) are sums over
    nodes, so the IP solves the per-node relaxation (one micro-batch's activations per node) and,
    if its plan does not fit at its pipeline positions even recomputing, the restriction (all ``m``
    in flight, no recomputation): :mod:`torchplace.solvers.pipelined`. The bound is the
    relaxation's, valid for the true problem; the plan is ``"optimal"`` only when the relaxation's
    optimum fits as it is.

    Raises:
        InfeasibleError: if no placement satisfies memory, support and colocation (and contiguity).
        SolverLimitError: if the time limit passed before HiGHS found any placement (also while
            the model was built) and there is no ``warm_start``.
        ModelTooLargeError: if the model would not fit in the solver memory budget or the time
            limit (:mod:`torchplace.solvers.limits`).
    """
    if training_pipeline(problem) is not None:
        return solve_pipelined(problem, solve, time_limit, contiguous=contiguous, mip_gap=mip_gap,
                               warm_start=warm_start, symmetry=symmetry)
    budget = Budget("max-load IP", time_limit)
    contiguous = problem.contiguous if contiguous is None else contiguous
    target = problem if problem.contiguous == contiguous else replace(problem, contiguous=contiguous)
    try:
        m = build(target, contiguous=contiguous, symmetry=symmetry, budget=budget)
        if warm_start is not None:
            initialize(m, target, warm_start.assignment, symmetry)
        build_seconds = budget.elapsed()
        scaled = solve_model(m, name="max-load IP", mip_gap=mip_gap, budget=budget, unit=m.unit,
                             warm_start=warm_start is not None, known_bound=simple_lower_bound(target))
    except SolverLimitError as e:
        if warm_start is None or isinstance(e, ModelTooLargeError):
            raise
        # Stopped before HiGHS's first incumbent, which would have been the start: return it.
        bound = simple_lower_bound(target)
        if not contiguous and e.bound is not None:
            bound = max(bound, e.bound)
        return Plan.build(target, warm_start.stages, solver="maxload-ip", seconds=budget.elapsed(),
                          lower_bound=bound, status="time_limit",
                          meta={"contiguous": contiguous, "symmetry": symmetry, "stopped": str(e)})
    res = scaled.scaled(m.unit)
    stages = stages_from_assignment(target, extract(m, target))
    objective = costmodel.evaluate_stages(target, stages)[0]
    bound = simple_lower_bound(target)
    if not contiguous:
        bound = max(bound, _bound_for_plan(res, objective))
    rows, cols = model_size(m)
    meta = {
        "milp_objective": res.objective, "milp_bound": res.bound, "rows": rows, "cols": cols,
        "build_seconds": build_seconds, "solve_seconds": res.seconds, "contiguous": contiguous,
        "symmetry": symmetry,
    }
    plan = Plan.build(target, stages, solver="maxload-ip", seconds=budget.elapsed(),
                      lower_bound=bound, status=res.status, meta=meta)
    if res.status == "optimal" and not math.isclose(objective, res.objective, rel_tol=max(mip_gap, 1e-6), abs_tol=1e-9):
        raise AssertionError(f"max-load IP value {res.objective} differs from the cost model's {objective}")
    return plan


def solve_started(problem: Problem, *, contiguous: bool | None = None, time_limit: float | None = None,
                  mip_gap: float = 1e-6, warm_start: Plan | None = None, symmetry: str = "none",
                  find_start: bool = True) -> Plan:
    """:func:`solve` from ``warm_start``, or else from the contiguous plan ``auto`` finds first
    (the ideals DP, or SliceGraph and BRKGA past its limits; :mod:`torchplace.solvers.auto`) within
    :data:`START_SHARE` of ``time_limit`` (:data:`START_SECONDS` without one). Method ``"ip"``.

    From no start, in 30 s, HiGHS found on ResNet-50's layer graph and on BERT-6's and ResNet-50's
    training operator graphs placements worth 46.7, 192.9 and 685.0 (none at all on a busy
    machine), where the DP's plans, found in 0.1-2.5 s, are worth 33.8, 72.9 and 255.2. A
    contiguous plan is a placement of any problem, and the IP returns it (status ``"time_limit"``)
    where HiGHS finds nothing better in time. Without a start (none found in time, or none fits)
    it is :func:`solve`.

    Args and Raises: as :func:`solve`; ``find_start=False`` looks for no start (``auto`` once it
    knows that no contiguous split fits).
    """
    t0 = time.perf_counter()
    if warm_start is None and find_start:
        warm_start = _start(problem, START_SECONDS if time_limit is None else time_limit * START_SHARE)
    left = None if time_limit is None else max(0.0, time_limit - (time.perf_counter() - t0))
    return solve(problem, contiguous=contiguous, time_limit=left, mip_gap=mip_gap, warm_start=warm_start,
                 symmetry=symmetry)


def _start(problem: Problem, seconds: float) -> Plan | None:
    """auto's first contiguous plan within ``seconds``, as a plan of ``problem``; ``None`` if none."""
    from torchplace.solvers import auto

    contiguous = problem if problem.contiguous else replace(problem, contiguous=True)
    try:
        plan = auto.contiguous_plan(contiguous, seconds)
    except (InfeasibleError, SolverLimitError):
        return None  # the IP decides: a non-contiguous split may fit where no contiguous one does
    if problem.contiguous:
        return plan
    return Plan.build(problem, plan.stages, solver=plan.solver, seconds=plan.seconds, lower_bound=plan.lower_bound,
                      status="feasible", meta=plan.meta)
