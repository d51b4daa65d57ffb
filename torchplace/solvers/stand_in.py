"""A plan solved on a stand-in for a problem, built on the problem itself.

The wrappers :mod:`torchplace.solvers.liveness`, :mod:`torchplace.solvers.pipelined` and
:mod:`torchplace.solvers.shared` solve a problem whose memory no solver models (liveness peaks;
micro-batches in flight; copies of shared tensors) through stand-ins whose memory is a sum over
nodes: a *relaxation* that charges less than the truth (its lower bound holds for the problem),
and *restrictions* (groupings) or a changed plan. :func:`on_true_problem`
builds such a plan on the problem (its objective is then the cost model's evaluation of it there,
and the plan is validated) and keeps what its solver proved only where that carries over.
"""
from __future__ import annotations

from collections.abc import Sequence

from torchplace.plan import Plan, Stage
from torchplace.problem import Problem

__all__ = ["CLAIMS", "on_true_problem"]

CLAIMS = ("optimal_among", "dp_value", "contiguous")
"""What a solver's ``meta`` says of the plan it solved (the DP's optimum among contiguous splits,
its table's value): true of a stand-in's plan as it was solved, not of a restriction's plan nor
of one changed after."""


def on_true_problem(problem: Problem, plan: Plan, bound: float, how: str, *, key: str,
                    stages: Sequence[Stage] | None = None, kept: bool = False) -> Plan:
    """``stages`` (``plan``'s by default), solved on a stand-in for ``problem``, built on ``problem``
    with lower bound ``bound`` (the relaxation's) and ``meta[key] = how``.

    ``kept``: the stages are the relaxation's plan as its solver returned it, with the same
    objective on ``problem``; then its status and :data:`CLAIMS` carry over. Otherwise the claims
    are dropped and the status is ``"optimal"`` only where ``bound`` proves it (``"time_limit"``
    stays as it was).

    Raises:
        InvalidPlanError: the stages do not fit ``problem`` (or break another of its constraints).
    """
    status = "optimal" if kept and plan.status == "optimal" else \
        "time_limit" if plan.status == "time_limit" else "feasible"
    meta = plan.meta if kept else {k: v for k, v in plan.meta.items() if k not in CLAIMS}
    out = Plan.build(problem, plan.stages if stages is None else stages, solver=plan.solver, seconds=plan.seconds,
                     lower_bound=bound, status=status, meta={**meta, key: how})
    if out.status == "feasible" and out.objective <= bound * (1 + 1e-9):
        out.status = "optimal"  # the relaxation's bound proves it
    return out
