"""Solvers: every algorithm behind one contract, ``solve(problem, **opts) -> Plan``.

Solvers see only a Problem and return a validated Plan whose objective is the cost model's value
(:mod:`torchplace.costmodel`). They never import torch. Methods are imported on first use, so
``import torchplace.solvers`` stays light (Pyomo loads only for the MILPs).

Example:
    >>> from torchplace.solvers import solve
    >>> plan = solve(problem)                                  # doctest: +SKIP
    >>> plan = solve(problem, method="ip", time_limit=60)      # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchplace.costmodel import uses_liveness
from torchplace.errors import UsageError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers.auto import DEFAULT_TIME_LIMIT, solve_auto

__all__ = ["METHODS", "PARALLEL_METHODS", "SOLVERS", "Method", "check_method", "solve"]

PARALLEL_METHODS = ("piper", "piper-equi")
"""The methods for problems with a :class:`~torchplace.problem.Parallel` setting (and the only ones)."""


@dataclasses.dataclass(frozen=True)
class Method:
    """A registered solver: where it lives, which objective it optimises, and what it proves."""

    target: str
    objective: str
    summary: str

    def load(self) -> Callable[..., Plan]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


METHODS: dict[str, Method] = {
    "dp": Method("torchplace.solvers.dp:solve", "throughput",
                 "ideals DP, optimal contiguous split (Tarnawski 5.1.1)"),
    "dpl": Method("torchplace.solvers.dp:solve_linearized", "throughput",
                  "DP over one DFS linearization (Tarnawski 5.1.2)"),
    "slicegraph": Method("torchplace.solvers.slicegraph:solve", "throughput",
                         "SliceGraph over random topological orders (Archer 4)"),
    "brkga": Method("torchplace.solvers.brkga:solve", "throughput",
                    "BRKGA search over orders, decoded by SliceGraph (Archer C.1)"),
    "ip": Method("torchplace.solvers.milp.maxload:solve_started", "throughput",
                 "max-load MILP, contiguous or not (Tarnawski App. C)"),
    "mtpp": Method("torchplace.solvers.milp.mtpp:solve", "throughput",
                   "exact MTPP MIP for identical accelerators (Archer 3.1)"),
    "latency-ip": Method("torchplace.solvers.milp.latency:solve", "latency",
                         "latency MILP with atomic accelerator subgraphs (Tarnawski App. A)"),
    "moirai": Method("torchplace.solvers.milp.moirai:solve", "latency",
                     "heterogeneous latency MILP (MOIRAI III-D)"),
    "piper": Method("torchplace.solvers.piper:solve", "throughput",
                    "data x tensor x pipeline DP with recomputation, Piper problems (Piper 4)"),
    "piper-equi": Method("torchplace.solvers.piper_equi:solve", "throughput",
                         "equi-partitioned stages, same d and t everywhere (Piper 5 baseline)"),
    "m-topo": Method("torchplace.solvers.baechi:m_topo", "latency", "Baechi m-TOPO"),
    "m-etf": Method("torchplace.solvers.baechi:m_etf", "latency", "Baechi m-ETF"),
    "m-sct": Method("torchplace.solvers.baechi:m_sct", "latency", "Baechi m-SCT"),
}
"""Every method by name (``"auto"`` is not one of them: it chooses among them)."""


class _Solvers(Mapping[str, Callable[..., Plan]]):
    """``name -> solve function``, importing each method's module on first access."""

    def __getitem__(self, name: str) -> Callable[..., Plan]:
        return METHODS[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)


SOLVERS: Mapping[str, Callable[..., Plan]] = _Solvers()


def call_method(name: str, problem: Problem, **opts: Any) -> Plan:
    """Run method ``name`` with ``opts`` (``None`` values dropped).

    ``time_limit`` is dropped for a method that runs to completion (the list schedulers m-TOPO and
    m-ETF: under a second on every shared workload); any other option the method does not take is
    an error, so nothing a user asks for is silently ignored.

    Raises:
        UsageError: (a ValueError) naming the options ``name`` does not take.
    """
    fn = SOLVERS[name]
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    given = {k: v for k, v in opts.items() if v is not None and not (k == "time_limit" and k not in params)}
    unknown = sorted(k for k in given if not takes_all and k not in params)
    if unknown:
        takes = sorted(k for k, p in params.items() if p.kind is p.KEYWORD_ONLY)
        raise UsageError(f"method {name!r} does not take {unknown}; its options are {takes}")
    return fn(problem, **given)


def _claim_no_more(problem: Problem, plan: Plan) -> Plan:
    """``plan`` with status ``"feasible"`` where it says ``"optimal"`` only among contiguous splits
    (``meta["contiguous"]``: the DP, MTPP) of a problem that allows any split, and no proven bound
    meets it; ``meta["optimal_among"]`` keeps what was proven."""
    if (plan.status == "optimal" and plan.meta.get("contiguous") and not problem.contiguous
            and plan.lower_bound < plan.objective * (1 - 1e-9)):
        plan.status = "feasible"
        plan.meta["optimal_among"] = "contiguous splits"
    return plan


def check_method(method: str, objective: str, parallel: bool | None = None) -> None:
    """Raise :class:`~torchplace.errors.UsageError` unless ``method`` is ``"auto"`` or a method
    of :data:`METHODS` that optimises ``objective``, and, where ``parallel`` says whether the
    problem is a Piper problem, one of that problem's family (:data:`PARALLEL_METHODS` or the
    others). The message lists the methods that apply."""
    if method != "auto" and method not in METHODS:
        raise UsageError(f"unknown solver {method!r}; choose one of {['auto', *METHODS]}")
    family = [m for m in METHODS if parallel is None or (m in PARALLEL_METHODS) == parallel]
    fits = [m for m in family if METHODS[m].objective == objective]
    if method != "auto" and parallel is not None and method not in family:
        if parallel:
            raise UsageError(f"method {method!r} places nodes on devices, but this is a Piper problem (data x tensor "
                             f"x pipeline); use one of {['auto', *fits]}")
        raise UsageError(f"method {method!r} needs a Piper problem (Problem.parallel, e.g. from "
                         f"torchplace.workloads.read_piper: a JSON with 'mbsInBatch'); for this problem use one of "
                         f"{['auto', *fits]}")
    if method != "auto" and METHODS[method].objective != objective:
        raise UsageError(
            f"method {method!r} optimises {METHODS[method].objective}, but the objective is {objective!r}: ask for "
            f"objective={METHODS[method].objective!r} (command line: --objective {METHODS[method].objective}), "
            f"or use one of {['auto', *fits]}"
        )


def solve(problem: Problem, method: str = "auto", *, time_limit: float | None = None, **opts: Any) -> Plan:
    """Solve ``problem`` with ``method`` (a key of :data:`METHODS`, or ``"auto"``).

    ``"auto"`` (:func:`torchplace.solvers.auto.solve_auto`) picks by objective and size and
    reports the best lower bound it proved; for a Piper problem (``problem.parallel``) it is
    ``"piper"``, and only :data:`PARALLEL_METHODS` apply. ``time_limit`` (seconds) goes to every method that
    takes one; other options go to the method when it takes them. A graph with shared tensors
    (tied weights) is solved through problems whose memory is a sum over nodes
    (:mod:`torchplace.solvers.shared`), and so is a problem whose working memory is a liveness
    peak (:mod:`torchplace.solvers.liveness`).

    Raises:
        UsageError: for an unknown method (the message lists the known ones) or a method that
            optimises the other objective (:func:`check_method`).
    """
    check_method(method, problem.objective, parallel=problem.parallel is not None)
    if problem.parallel is not None:
        return call_method("piper" if method == "auto" else method, problem, time_limit=time_limit, **opts)
    if opts.get("contiguous") is False and problem.contiguous:
        # the method may give a device several pieces (Tarnawski Sec. 5.2): its plan is a plan of the
        # problem that allows them, as the method checks it, and so in the wrappers below too
        problem = dataclasses.replace(problem, contiguous=False)

    wrapped = uses_liveness(problem) or bool(problem.graph.shared_tensors())
    if method == "auto" and time_limit is None and wrapped:
        time_limit = DEFAULT_TIME_LIMIT  # auto's default for the whole solve, shared by the wrappers' phases

    def one(p: Problem, time_limit: float | None = None, **o: Any) -> Plan:
        if method == "auto":
            return _claim_no_more(p, solve_auto(p, time_limit=time_limit, **o))
        return _claim_no_more(p, call_method(method, p, time_limit=time_limit, **o))

    if uses_liveness(problem):
        from torchplace.solvers.liveness import solve_live

        return solve_live(problem, lambda p, time_limit=None, **o: solve(p, method, time_limit=time_limit, **o),
                          time_limit, **opts)
    if problem.graph.shared_tensors():
        from torchplace.solvers.shared import solve_shared

        return solve_shared(problem, one, time_limit, **opts)
    return one(problem, time_limit=time_limit, **opts)
