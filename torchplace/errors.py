"""Exception types. Every error a user can cause is one of these, with a message that says what to do.

All derive from :class:`TorchplaceError`, so ``except torchplace.TorchplaceError`` catches them all.
"""
from __future__ import annotations

import os
import sys
import warnings

__all__ = [
    "DistributedError",
    "InfeasibleError",
    "InvalidPlanError",
    "MicrobatchError",
    "MissingDependencyError",
    "ModelTooLargeError",
    "PlacementWarning",
    "SolverError",
    "SolverLimitError",
    "StageError",
    "TooManyIdealsError",
    "TorchplaceError",
    "TraceError",
    "UnsupportedError",
    "UsageError",
    "WorkloadFormatError",
    "warn_caller",
]


class TorchplaceError(Exception):
    """Base class of every torchplace error."""


class UsageError(TorchplaceError, ValueError):
    """An argument, option or input the user gave is invalid; the message names it and the fix.

    Derives from ``ValueError`` too, so code that catches ``ValueError`` for bad arguments keeps
    working.
    """


class MicrobatchError(UsageError):
    """The model does not run on one micro-batch of its example inputs (it fixes its batch size,
    e.g. a reshape to the example's size), so it cannot be split into micro-batches."""


class UnsupportedError(TorchplaceError):
    """An operation a placed model cannot do exactly (e.g. pickling it, ``.to()``); the message
    says what to do instead."""


class TraceError(TorchplaceError):
    """The model could not be traced into a graph (names the failing module and what to try)."""


class InfeasibleError(TorchplaceError):
    """No placement satisfies the constraints (memory, supported devices, colocation).

    Attributes:
        min_memory_bytes: the smallest per-device memory that would make the problem feasible,
            when it is known (``None`` otherwise).
    """

    def __init__(self, message: str, min_memory_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes


class InvalidPlanError(TorchplaceError, ValueError):
    """A plan breaks coverage, memory, colocation, support or acyclicity of its stages."""


class WorkloadFormatError(TorchplaceError, ValueError):
    """An input file (workload JSON, plan JSON) is malformed; the message names the field."""


class TooManyIdealsError(TorchplaceError):
    """The graph has more ideals than the configured limit of an ideals-based solver."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class StageError(TorchplaceError, RuntimeError):
    """A pipeline stage raised while running; the original exception is chained as ``__cause__``."""


class SolverError(TorchplaceError, RuntimeError):
    """An exact solver ended without a verdict it could vouch for (HiGHS reporting a solve error,
    e.g. an "optimal" solution that fails its own feasibility check). The message names the solver
    version and the way out: another method (``method="auto"`` goes on with the others) or another
    version of the solver."""


class SolverLimitError(TorchplaceError):
    """A solver stopped at its time limit before it found any feasible plan (the limit covers
    building its model too).

    Attributes:
        time_limit: the limit in seconds.
        bound: the best proven lower bound at the stop, in seconds (``None`` if none was proven).
    """

    def __init__(self, message: str, time_limit: float | None, bound: float | None = None) -> None:
        super().__init__(message)
        self.time_limit = time_limit
        self.bound = bound


class ModelTooLargeError(SolverLimitError):
    """A solver's model or tables would not fit in the memory budget or in the time limit, so it was
    refused before (or while) building it. The message names the size and the way out (fuse the
    graph, ``method="auto"``, a smaller graph).

    Attributes:
        needed_bytes: the estimated memory the model needs (``None`` when the time refused it).
    """

    def __init__(self, message: str, time_limit: float | None, needed_bytes: int | None = None) -> None:
        super().__init__(message, time_limit)
        self.needed_bytes = needed_bytes


class MissingDependencyError(TorchplaceError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the pip command."""


class PlacementWarning(UserWarning):
    """``place()`` ran something other than the split it solved for, and says why: the whole model
    on one device is predicted faster than the plan, or the plan faster by less than
    :data:`~torchplace.callplan.SPLIT_MARGIN` (:mod:`torchplace.callplan`); pass
    ``allow_single_device=False`` to keep the split. Also: the model takes a path under
    ``no_grad`` that no trace captures (PyTorch's attention fast path), so there the placed model
    equals it to float rounding only. And: ``infer_device_map`` found no map that fits the GPUs of
    ``max_memory``, so the map it returns names none and the CPU computes every block."""


class DistributedError(TorchplaceError, RuntimeError):
    """A multi-process run (:mod:`torchplace.distributed`) failed or was launched wrongly: the message
    names the rank (and the stage and pass) that failed, or the launch setting to change."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_caller(message: str, category: type[Warning] = PlacementWarning) -> None:
    """``warnings.warn`` at the user's line: the first frame outside torchplace and torch (so a
    warning of ``place()``, or of a call through ``nn.Module.__call__``, names the line that made
    it, however deep inside the package it was raised)."""
    inside = (_PACKAGE, *_torch_dirs())
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _torch_dirs() -> list[str]:
    torch = sys.modules.get("torch")
    return [os.path.dirname(os.path.abspath(torch.__file__)) + os.sep] if torch is not None and torch.__file__ else []
