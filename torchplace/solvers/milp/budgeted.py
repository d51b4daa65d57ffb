"""A Pyomo model that checks a solver's budget while it is built.

Every MILP builder makes its model with :func:`budgeted_model`. The budget
(:class:`~torchplace.solvers.limits.Budget`) is checked before each component is added, and every
``rule`` call of an indexed constraint (the components with up to millions of rows) counts towards
a check every thousand calls, so building stops within milliseconds of the deadline or of the
memory allowance, with the budget's typed error.

How the stop crosses Pyomo: a constraint's construction logs and re-raises any ``Exception`` from
its rule, so the error travels inside an internal ``BaseException`` (as ``KeyboardInterrupt``
does), Pyomo's log line about it is filtered out, and :meth:`BudgetedModel.add_component` raises
the error itself.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pyomo.environ as pyo
from pyomo.core.base.constraint import IndexedConstraint

from torchplace.errors import SolverLimitError
from torchplace.solvers.limits import Budget

__all__ = ["BudgetedModel", "budgeted_model"]

_PYOMO_LOG = logging.getLogger("pyomo.core")


class _Interrupt(BaseException):
    """Carries a limit error out of Pyomo's construction code; never seen outside this module."""

    def __init__(self, error: SolverLimitError) -> None:
        super().__init__(str(error))
        self.error = error


class _QuietInterrupts(logging.Filter):
    """Drops Pyomo's "construction failed" record for an interrupt (the error says it all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _Interrupt.__name__ not in record.getMessage()


@contextmanager
def _quiet() -> Iterator[None]:
    quiet = _QuietInterrupts()
    _PYOMO_LOG.addFilter(quiet)
    try:
        yield
    finally:
        _PYOMO_LOG.removeFilter(quiet)


class _GuardedRule:
    """A constraint's rule initializer that ticks the budget before each call (else delegates)."""

    def __init__(self, inner: Any, tick: Callable[[], None]) -> None:
        self._inner, self._tick = inner, tick

    def __call__(self, parent: Any, idx: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            self._tick()
        except SolverLimitError as e:
            raise _Interrupt(e) from None
        return self._inner(parent, idx, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class BudgetedModel(pyo.ConcreteModel):
    """A ConcreteModel whose components are built within a budget (module docstring).

    Raises (from any component assignment ``model.name = component``):
        SolverLimitError: the deadline passed while building.
        ModelTooLargeError: the process outgrew the budget's memory while building.
    """

    def add_component(self, name: str, val: Any) -> None:
        budget: Budget = self.__dict__["_budget"]
        budget.check(f"building the model ({name})")
        if type(val) is IndexedConstraint and getattr(val, "_rule", None) is not None:
            val._rule = _GuardedRule(val._rule, budget.ticks(f"building the model ({name})"))
        try:
            with _quiet():
                super().add_component(name, val)
        except _Interrupt as stop:
            raise stop.error from None


def budgeted_model(budget: Budget | None, name: str) -> pyo.ConcreteModel:
    """A :class:`BudgetedModel` for ``budget``, or a plain ConcreteModel without one."""
    if budget is None:
        return pyo.ConcreteModel(name=name)
    model = BudgetedModel(name=name)
    object.__setattr__(model, "_budget", budget)
    return model
