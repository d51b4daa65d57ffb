"""Solvers: every algorithm behind one contract, ``solve(problem, **opts) -> Plan``.

Solvers see only a Problem and return a validated Plan whose objective is the cost model's value
(:mod:`torchplace.costmodel`). They never import torch.

Example:
    >>> from torchplace.solvers import solve
    >>> plan = solve(problem)                  # doctest: +SKIP
    >>> plan = solve(problem, method="dp")     # doctest: +SKIP
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers import dp

__all__ = ["SOLVERS", "solve"]

SOLVERS: dict[str, Callable[..., Plan]] = {
    "dp": dp.solve,
}


def solve(problem: Problem, method: str = "auto", **opts: Any) -> Plan:
    """Solve ``problem`` with ``method`` (a key of :data:`SOLVERS`, or ``"auto"``).

    ``"auto"`` picks the ideals DP, the exact method for contiguous throughput problems.

    Raises:
        ValueError: for an unknown method (the message lists the known ones).
    """
    if method == "auto":
        method = "dp"
    if method not in SOLVERS:
        raise ValueError(f"unknown solver {method!r}; choose one of {['auto', *SOLVERS]}")
    return SOLVERS[method](problem, **opts)
