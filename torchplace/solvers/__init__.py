"""Solvers: every algorithm behind one contract, ``solve(problem, **opts) -> Plan``.

Solvers see only a Problem and return a validated Plan whose objective is the cost model's value
(:mod:`torchplace.costmodel`). They never import torch.

Example:
    >>> from torchplace.solvers import solve
    >>> plan = solve(problem)                  # doctest: +SKIP
    >>> plan = solve(problem, method="dp")     # doctest: +SKIP
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torchplace.errors import TooManyIdealsError
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers import dp

__all__ = ["SOLVERS", "solve"]

SOLVERS: dict[str, Callable[..., Plan]] = {
    "dp": dp.solve,
    "dpl": functools.partial(dp.solve, linearize=True),
}


def solve(problem: Problem, method: str = "auto", **opts: Any) -> Plan:
    """Solve ``problem`` with ``method`` (a key of :data:`SOLVERS`, or ``"auto"``).

    ``"auto"`` runs the exact ideals DP and, if the graph has too many ideals for it, the DP over
    one linearization (DPL), whose plan is marked ``"feasible"`` rather than proven optimal.

    Raises:
        ValueError: for an unknown method (the message lists the known ones).
    """
    if method == "auto":
        try:
            return dp.solve(problem, **opts)
        except TooManyIdealsError:
            opts.pop("ideal_limit", None)
            return SOLVERS["dpl"](problem, **opts)
    if method not in SOLVERS:
        raise ValueError(f"unknown solver {method!r}; choose one of {['auto', *SOLVERS]}")
    return SOLVERS[method](problem, **opts)
