"""Time and memory limits that hold for every solver, model building included.

A solver makes one :class:`Budget` when it is called. Its deadline covers everything the solver
does: its own tables, building a Pyomo model, handing the model to HiGHS, the solve or search, and
the plan; HiGHS gets only the time that is left (:meth:`Budget.remaining`). Long loops call
:meth:`Budget.check` (or :meth:`Budget.ticks`), which stops the solver with
:class:`~torchplace.errors.SolverLimitError` once the deadline has passed, and with
:class:`~torchplace.errors.ModelTooLargeError` once the process has grown by more than
:data:`MEMORY_BUDGET` since the solver started. Before a model is built its size is estimated from
the problem's dimensions (:class:`ModelSize`, :mod:`torchplace.solvers.milp.size`) and a model that
would not fit is refused at once (:meth:`Budget.admit`). Pyomo models are built as
:class:`torchplace.solvers.milp.budgeted.BudgetedModel`, which checks the budget while it builds.

Example:
    >>> budget = Budget("max-load IP", time_limit=5.0, way_out="use method 'auto'")
    >>> budget.check("building the model")   # raises once 5 s have passed
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from torchplace.errors import ModelTooLargeError, SolverLimitError

__all__ = ["MEMORY_BUDGET", "MILP_WAY_OUT", "Budget", "ModelSize", "in_phases", "stop_if_interrupted"]

MEMORY_BUDGET = 3 * 2**30
"""Bytes a solver may add to the process (tables, Pyomo model, HiGHS): with the interpreter and the
libraries (about 0.2 GB) a solve stays under 4 GB. Tests may lower it."""

MILP_WAY_OUT = ("coarsen the graph (place(..., fuse=True) or granularity='module'), use method 'auto' "
                "(--method auto), or solve a smaller graph")
"""What to do when a MILP is too large for its limits."""

# Measured on a 2-core machine (five models of 10^4 to 2 * 10^6 rows, Pyomo 6.10, HiGHS 1.15):
# building a model and handing it to HiGHS through appsi costs about this much per row, nonzero
# and column, and 95 us per row plus 10 us per nonzero.
_BYTES_PER_ROW, _BYTES_PER_NONZERO, _BYTES_PER_COL = 1500, 250, 500
# Half the measured seconds: a faster machine must not be refused what it could build in time.
_SECONDS_PER_ROW, _SECONDS_PER_NONZERO = 45e-6, 5e-6

_POLL_EVERY = 1024  # loop iterations between two looks at the clock and the memory


@dataclass(frozen=True)
class ModelSize:
    """The size of a MILP, estimated from the problem's dimensions before it is built.

    Attributes:
        rows, cols, nonzeros: constraints, variables and nonzero coefficients.
        extra_bytes: memory for the builder's own index sets beyond the model (e.g. descendant sets).
    """

    rows: int
    cols: int
    nonzeros: int
    extra_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """Bytes to build the model and hand it to HiGHS (Pyomo objects, appsi maps, HiGHS copy)."""
        return (self.rows * _BYTES_PER_ROW + self.nonzeros * _BYTES_PER_NONZERO + self.cols * _BYTES_PER_COL
                + self.extra_bytes)

    @property
    def build_seconds(self) -> float:
        """Seconds to build and hand over the model on a fast machine (an optimistic estimate)."""
        return self.rows * _SECONDS_PER_ROW + self.nonzeros * _SECONDS_PER_NONZERO

    def __str__(self) -> str:
        return f"{self.rows:,} rows, {self.cols:,} columns and {self.nonzeros:,} nonzeros"


_PROCESS = psutil.Process()


def stop_if_interrupted(meta: Mapping[str, Any]) -> None:
    """Raise ``KeyboardInterrupt`` for a plan a search returned on Ctrl-C (``meta["interrupted"]``)
    where a wrapper would go on to another phase: its plan stands alone, a phase after it would
    need a second Ctrl-C."""
    if meta.get("interrupted"):
        raise KeyboardInterrupt


def in_phases(error: SolverLimitError, time_limit: float | None, how: str) -> SolverLimitError:
    """``error``, from one phase of a solve that splits the user's ``time_limit`` into phases
    (``how`` says which), restated against that limit: the phase's own share means nothing to
    the user who set the whole."""
    refused_for_time = type(error) is ModelTooLargeError and error.needed_bytes is None
    restated = type(error) is SolverLimitError or refused_for_time
    if time_limit is None or not restated or error.time_limit == time_limit:
        return error
    phase = f"{error.time_limit:g} s" if error.time_limit is not None else "part"
    message = f"no plan within the {time_limit:g} s time limit: {how}, and the phase that stopped had {phase} of it"
    if refused_for_time:  # a model too large for the phase's share of the time: same type, same way out
        return ModelTooLargeError(f"{message} ({error})", time_limit, error.needed_bytes)
    return SolverLimitError(f"{message} ({error}); raise time_limit", time_limit, error.bound)


def _rss() -> int:
    return int(_PROCESS.memory_info().rss)


class Budget:
    """A solver's deadline and memory allowance, counted from when it is made.

    Args:
        what: the solver, for messages (e.g. ``"MOIRAI latency MILP"``).
        time_limit: seconds for everything the solver does; ``None``: no deadline.
        memory_bytes: how much the process may grow (default :data:`MEMORY_BUDGET`).
        way_out: what the user can do when a limit stops the solver (ends every message).
    """

    def __init__(self, what: str, time_limit: float | None, *, memory_bytes: int | None = None,
                 way_out: str = MILP_WAY_OUT) -> None:
        self.what, self.time_limit, self.way_out = what, time_limit, way_out
        self.memory_bytes = MEMORY_BUDGET if memory_bytes is None else memory_bytes
        self.start = time.monotonic()
        self.deadline = None if time_limit is None else self.start + time_limit
        self.rss0 = _rss()

    def _budget_text(self) -> str:
        return (f"the solver memory budget of {self.memory_bytes / 2**30:.1f} GiB "
                "(torchplace.solvers.limits.MEMORY_BUDGET)")

    def elapsed(self) -> float:
        """Seconds since the budget was made."""
        return time.monotonic() - self.start

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never negative); ``None`` without a deadline."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def time_error(self, doing: str, found: str = "") -> SolverLimitError:
        """The error for a deadline that passed while ``doing``."""
        return SolverLimitError(
            f"{self.what}: the {self.time_limit:g} s time limit passed while {doing} (after {self.elapsed():.1f} s)"
            f"{found}; raise the time limit, or {self.way_out}", self.time_limit)

    def check(self, doing: str) -> None:
        """Raise if the deadline has passed or the process has outgrown the memory allowance.

        Raises:
            SolverLimitError: the deadline has passed.
            ModelTooLargeError: the process grew by more than ``memory_bytes``.
        """
        if self.expired():
            raise self.time_error(doing)
        grown = _rss() - self.rss0
        if grown > self.memory_bytes:
            raise ModelTooLargeError(
                f"{self.what}: {doing} grew the process by {grown / 2**30:.1f} GiB, more than {self._budget_text()}; "
                f"{self.way_out}", self.time_limit, grown)

    def ticks(self, doing: str, every: int = _POLL_EVERY) -> Callable[[], None]:
        """A function to call once per loop iteration: it runs :meth:`check` every ``every`` calls."""
        counter = itertools.count(1)

        def tick() -> None:
            if next(counter) % every == 0:
                self.check(doing)

        return tick

    def admit_memory(self, need: int, what: str) -> None:
        """Refuse ``what`` when its ``need`` bytes exceed the memory allowance.

        Raises:
            ModelTooLargeError: naming ``what``, the bytes and :attr:`way_out`.
        """
        if need > self.memory_bytes:
            raise ModelTooLargeError(
                f"{self.what}: {what} would take about {need / 2**30:.1f} GiB, more than {self._budget_text()}; "
                f"{self.way_out}", self.time_limit, need)

    def admit(self, size: ModelSize, doing: str = "building the model") -> None:
        """Refuse a model whose estimated ``size`` does not fit the memory allowance or the time left.

        Raises:
            ModelTooLargeError: naming the size, the limit it breaks and :attr:`way_out`.
        """
        need, seconds, left = size.memory_bytes, size.build_seconds, self.remaining()
        cost = f"about {need / 2**30:.1f} GiB and {seconds:.0f} s to build"
        way_out = self.way_out
        if need > self.memory_bytes:
            broken = f"more than {self._budget_text()}"
        elif left is not None and seconds > left:
            broken = f"more than the {left:.2g} s left of the {self.time_limit:g} s time limit"
            if seconds <= 1.0:  # a small model and a tiny limit: the limit is what to change
                way_out = f"raise the time limit (time_limit=, --time-limit) to a second or more, or {way_out}"
        else:
            return
        raise ModelTooLargeError(f"{self.what}: the model would have {size} ({cost}), {broken}; {way_out}",
                                 self.time_limit, need if need > self.memory_bytes else None)  # None: the time
