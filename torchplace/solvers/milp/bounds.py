"""MIP lower bounds on the optimal max-load (Archer et al. 2024, Sec. 3.2 and 3.3), for any split.

Archer's relaxations keep one *bottleneck block* exactly and merge the others into superblocks.
Their blocks are ordered (acyclic quotient graph), so the others split into the blocks before and
after the bottleneck. Our bounds must hold for *every* placement, non-contiguous ones included,
where no such order exists; so the bottleneck set ``S`` may be any union of units (colocation
groups), and the other devices are merged by device class instead of by position. Devices may be
of several classes (kind, memory, transfer rule; :func:`torchplace.solvers.dp.device_classes`).

The argument (Lemma 3.3 generalised). In any placement let ``d*`` be the device of greatest *work*
(compute time on its own kind). With ``L`` = :func:`simple_lower_bound` (max over colocation groups
of their cheapest time, and the cheapest total time over the device count), ``work(d*) >= L``: the
works add up to at least the cheapest total, and the device holding the heaviest group has at
least its cheapest time. So for the class ``c`` of ``d*`` and ``S`` its node set:

* ``S`` runs on and fits a class-``c`` device, and ``work_c(S) >= L``;                        (14)
* the max-load is at least ``f_c(S)``, the cost model's load of ``S`` on class ``c``;
* (guess only) let ``R_k`` be the nodes on the ``n_k`` other devices of class ``k`` (``n_c`` is one
  less than the class size). Their mean load is at most the max-load and at least
  ``(work_k(R_k) + [k pays transfers] io(R_k)) / n_k``, where ``io(R_k)`` counts once each tensor
  crossing the boundary of ``R_k`` (one leaving ``R_k`` is paid by its producer's device, one
  entering by some consumer's device); ``R_k`` fits in ``n_k`` times a device's memory; and
  ``work_c(S) >= work_k(R_k) / n_k`` (``d*`` has the most work).

Minimising over ``S`` (and the ``R_k``) and over the class ``c`` gives a proven bound.
``three_superblock_bound`` is Sec. 3.2's MIP (min ``f(S)`` subject to (14)) with the superblocks
before and after the bottleneck merged into the unconstrained rest. ``guess_the_bottleneck_bound``
is Sec. 3.3's idea: Archer guesses the position ``j`` of the bottleneck among ordered blocks and
bounds the superblocks before and after it by ``(j - 1)`` and ``(k - j)`` times the bottleneck;
without an order we guess the bottleneck's device class and bound each class's superblock by
``n_k`` times the bottleneck. With one class and ``n`` devices the rest is one superblock of
``n - 1`` devices.

Hierarchy (Archer Table 1 and Sec. 3.3; here by inclusion of the MIPs' constraints, when solved
to optimality):

    simple_lower_bound  <=  three_superblock_bound  <=  guess_the_bottleneck_bound
                        <=  optimal non-contiguous max-load  <=  optimal contiguous max-load

A MIP stopped by its time limit contributes its proven bound (never its incumbent), so a bound
under a limit is still valid but may break the middle inequality; both functions return at least
the simple bound. With a CPU class (no transfer cost) the CPU guess of the three-superblock bound
is ``min work_cpu(S) >= L``, i.e. little above the simple bound; the per-class superblocks of the
guess bound are what lift it there.

Under a training :class:`~torchplace.problem.Pipeline` both bound the per-node memory relaxation
(:func:`torchplace.solvers.pipelined.relaxed`: no device needs less than it says, and
recomputation only adds load), so they hold for the true problem.
"""
from __future__ import annotations

import math

import pyomo.environ as pyo

from torchplace.errors import InfeasibleError, SolverError, SolverLimitError
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound
from torchplace.solvers.dp import device_classes
from torchplace.solvers.limits import Budget
from torchplace.solvers.milp.budgeted import budgeted_model
from torchplace.solvers.milp.highs import solve_model
from torchplace.solvers.milp.maxload import Units, assignment_units, byte_unit, row, time_unit
from torchplace.solvers.milp.size import bottleneck_size
from torchplace.solvers.pipelined import bounding_problem

__all__ = ["build_bottleneck", "guess_the_bottleneck_bound", "three_superblock_bound"]


def _rest_classes(problem: Problem, device: int) -> list[tuple[int, int]]:
    """(representative device index, number of devices) of each class without ``device``."""
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    out = []
    for c in device_classes(problem):
        members = [index[n] for n in c.devices]
        n = len(members) - (device in members)
        if n:
            out.append((members[0] if members[0] != device else members[-1], n))
    return out


def build_bottleneck(problem: Problem, units: Units, device: int, floor: float, *, guess: bool,
                     budget: Budget | None = None) -> pyo.ConcreteModel:
    """The bottleneck-set MIP with ``device``'s class as the greatest-work class (module docstring).

    Args:
        units: :func:`assignment_units` of ``problem``.
        device: index of a device of the guessed class.
        floor: ``L``, the work the bottleneck set must reach (14).
        guess: add one superblock per class of the other devices (Sec. 3.3); else Sec. 3.2.
        budget: refuse a model too large for it, and stop building when it runs out.

    Raises:
        InfeasibleError: if a constraint is constant and false (the class cannot be the bottleneck).
        ModelTooLargeError: if the model would not fit ``budget`` (or outgrows it).
        SolverLimitError: if ``budget``'s deadline passes while building.
    """
    if budget is not None:
        budget.admit(bottleneck_size(problem, units, device, guess))
    devices = problem.cluster.devices
    dev = devices[device]
    rest = _rest_classes(problem, device) if guess else []
    part = {k: (d, n) for k, (d, n) in enumerate(rest)}
    m = budgeted_model(budget, "bottleneck-set MIP")
    m.unit = unit = time_unit(units, problem)  # seconds per model time unit
    m.mem_unit = mu = byte_unit([*units.memory, *(d.memory_bytes for d in devices if d.memory_bytes is not None)])
    # Sets
    m.U = pyo.Set(initialize=range(len(units.members)))  # units
    m.S = pyo.Set(initialize=[u for u in m.U if (u, device) in units.allowed])  # may join S
    m.K = pyo.Set(initialize=list(part))  # superblocks: classes of the other devices
    m.R = pyo.Set(dimen=2, initialize=[(u, k) for k in m.K for u in m.U if (u, part[k][0]) in units.allowed])
    m.KP = pyo.Set(initialize=[k for k in m.K if devices[part[k][0]].pays_transfer])  # paying superblocks
    m.P = pyo.Set(initialize=list(units.fanout))  # producers whose transfer costs time
    m.IN = pyo.Set(dimen=2, initialize=[(p, w) for p in m.P for w in units.fanout[p] if w in m.S])
    m.OUT = pyo.Set(dimen=2, initialize=[(p, w) for p in m.P for w in units.fanout[p] if units.of[p] in m.S])
    m.PK = pyo.Set(dimen=3, initialize=[(p, w, k) for p in m.P for w in units.fanout[p] for k in m.KP])
    # Params
    m.c = pyo.Param(m.P, initialize={p: problem.transfer_time(p) / unit for p in m.P})  # transfer time
    # Vars
    m.x = pyo.Var(m.S, domain=pyo.Binary)  # unit in the bottleneck set S
    m.r = pyo.Var(m.R, domain=pyo.Binary)  # unit in superblock k
    m.cin = pyo.Var(m.P, bounds=(0, 1))  # p's output enters S
    m.cout = pyo.Var(m.P, bounds=(0, 1))  # p's output leaves S
    m.kin = pyo.Var(m.P, m.KP, bounds=(0, 1))  # p's output enters superblock k
    m.kout = pyo.Var(m.P, m.KP, bounds=(0, 1))  # p's output leaves superblock k
    m.bottleneck = pyo.Var(bounds=(0, None))

    def X(u: int):
        return m.x[u] if u in m.S else 0

    def Rk(u: int, k: int):
        return m.r[u, k] if (u, k) in m.R else 0

    def work(k: int):  # work_k(R_k)
        return sum(units.time[u][part[k][0]] / unit * m.r[u, k] for u in m.U if (u, k) in m.R)

    def io(k: int):  # io(R_k)
        return sum(m.c[p] * (m.kin[p, k] + m.kout[p, k]) for p in m.P)

    s_work = sum(units.time[u][device] / unit * m.x[u] for u in m.S)  # work_c(S)
    s_io = sum(m.c[p] * (m.cin[p] + m.cout[p]) for p in m.P) if dev.pays_transfer else 0  # io(S)
    # Objective
    m.obj = pyo.Objective(expr=m.bottleneck, sense=pyo.minimize)
    # Constraints
    m.comm_in = pyo.Constraint(m.IN, rule=lambda m, p, w: m.cin[p] >= m.x[w] - X(units.of[p]))
    m.comm_out = pyo.Constraint(m.OUT, rule=lambda m, p, w: m.cout[p] >= m.x[units.of[p]] - X(w))
    m.own_load = pyo.Constraint(expr=m.bottleneck >= s_work + s_io)  # f_c(S)
    m.floor = pyo.Constraint(expr=row(s_work >= floor / unit, "the work floor"))  # (14)
    m.memory = pyo.Constraint(expr=row(
        sum(units.memory[u] / mu * m.x[u] for u in m.S) <= dev.memory_bytes / mu, "the memory")
        if dev.memory_bytes is not None else pyo.Constraint.Skip)
    if not guess:
        return m
    m.partition = pyo.Constraint(  # every unit in S or in one superblock
        m.U, rule=lambda m, u: row(X(u) + sum(Rk(u, k) for k in m.K) == 1, "the placement of every unit"))
    m.super_in = pyo.Constraint(m.PK, rule=lambda m, p, w, k: m.kin[p, k] >= Rk(w, k) - Rk(units.of[p], k))
    m.super_out = pyo.Constraint(m.PK, rule=lambda m, p, w, k: m.kout[p, k] >= Rk(units.of[p], k) - Rk(w, k))
    m.mean = pyo.Constraint(  # n_k devices carry R_k: their mean load is at most the bottleneck
        m.K, rule=lambda m, k: part[k][1] * m.bottleneck >= work(k) + (io(k) if k in m.KP else 0))
    m.most_work = pyo.Constraint(  # d* has the greatest work
        m.K, rule=lambda m, k: row(part[k][1] * s_work >= work(k), "the greatest work"))

    def super_memory(m, k):  # R_k fits in its n_k devices together
        cap = devices[part[k][0]].memory_bytes
        if cap is None:
            return pyo.Constraint.Skip
        return row(sum(units.memory[u] / mu * Rk(u, k) for u in m.U) <= part[k][1] * cap / mu,
                   "the memory of a superblock")

    m.super_memory = pyo.Constraint(m.K, rule=super_memory)
    return m


def _class_bound(problem: Problem, units: Units, device: int, floor: float, guess: bool, budget: Budget) -> float:
    """Proven optimum of one bottleneck-set MIP (``inf`` when the class cannot be the bottleneck);
    the floor when the budget stops it before it proves more (too large, or out of time)."""
    try:
        m = build_bottleneck(problem, units, device, floor, guess=guess, budget=budget)
        res = solve_model(m, name="bottleneck-set MIP", mip_gap=1e-9, budget=budget, unit=m.unit)
    except InfeasibleError:
        return math.inf
    except SolverLimitError as e:  # no incumbent: keep what it proved, at least the floor
        return max(floor, e.bound if e.bound is not None else floor)
    except SolverError:  # HiGHS vouched for nothing: the floor still holds
        return floor
    return max(floor, res.bound * m.unit)


def _bound(problem: Problem, guess: bool, time_limit: float | None) -> float:
    """The bound on ``problem``, or under a training pipeline on its per-node memory relaxation,
    whose bound holds for it (:func:`~torchplace.solvers.pipelined.bounding_problem`)."""
    problem = bounding_problem(problem)
    budget = Budget("bottleneck-set MIP bound", time_limit)
    floor = simple_lower_bound(problem)
    units = assignment_units(problem)
    index = {d.name: i for i, d in enumerate(problem.cluster.devices)}
    best = min(_class_bound(problem, units, index[c.devices[0]], floor, guess, budget)
               for c in device_classes(problem))
    if math.isinf(best):
        raise InfeasibleError("no placement satisfies memory, support and colocation: every device class fails")
    return max(floor, best)


def three_superblock_bound(problem: Problem, *, time_limit: float | None = 60.0) -> float:
    """Archer Sec. 3.2's three-superblock bound, generalised to any split (module docstring).

    ``min over classes c, unit sets S`` of ``f_c(S)`` subject to ``work_c(S) >= L``, ``S`` fitting
    a class-``c`` device.

    Args:
        problem: a throughput problem; contiguity is ignored (the bound holds for every split).
        time_limit: seconds for all the MIPs (one per device class), building included; a MIP the
            limit stops contributes its proven bound, one it leaves no time for (or too large
            for the memory budget) the simple bound.

    Returns:
        A proven lower bound on the optimal max-load, at least :func:`simple_lower_bound`.

    Raises:
        InfeasibleError: if no placement exists.
    """
    return _bound(problem, False, time_limit)


def guess_the_bottleneck_bound(problem: Problem, *, time_limit: float | None = 60.0) -> float:
    """Archer Sec. 3.3's guess-the-bottleneck bound, generalised to any split (module docstring).

    The three-superblock MIP plus one superblock per class of the other devices, whose mean load
    is at most the bottleneck, for each guessed class of the greatest-work device.

    Args:
        problem: a throughput problem; contiguity is ignored (the bound holds for every split).
        time_limit: seconds for all the MIPs (one per device class), building included (see
            :func:`three_superblock_bound`).

    Returns:
        A proven lower bound on the optimal max-load, at least :func:`simple_lower_bound`.

    Raises:
        InfeasibleError: if no placement exists.
    """
    return _bound(problem, True, time_limit)
