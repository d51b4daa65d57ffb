"""Number checks for values a user gives: arguments, CLI options and fields of files.

One place that turns a value into a finite ``float`` or a whole ``int``, or raises a typed error
that names the value and says what was expected. Rejected everywhere: ``NaN``, ``+-inf``,
``bool`` (``True`` is not a count), strings and other non-numbers, integers beyond float range
(solvers compute in floats; ``float(10**400)`` raises ``OverflowError``), and, where a whole
number is asked for (a count, a byte size), fractional values: ``2.7`` devices or ``1.7`` bytes
are an error, never truncated. An integral float (``4.0``, as JSON writers emit) is a whole
number. numpy scalars are numbers.

The error type is the caller's: :class:`~torchplace.errors.UsageError` (the default) for
arguments and options, :class:`~torchplace.errors.WorkloadFormatError` for a field of a file
(then ``name`` carries the file and the field, e.g. ``"w.json: nodes[3].size"``).

Torch-free: solvers may import it.

Example:
    >>> positive_int(4, "microbatches")
    4
    >>> positive_int(2.5, "microbatches")
    Traceback (most recent call last):
    ...
    torchplace.errors.UsageError: microbatches: expected a positive whole number, got 2.5
    >>> non_negative_float(float("nan"), "w.json: nodes[0].cpuLatency", error=WorkloadFormatError)
    Traceback (most recent call last):
    ...
    torchplace.errors.WorkloadFormatError: w.json: nodes[0].cpuLatency: expected a non-negative finite number, got nan
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any

from torchplace.errors import TorchplaceError, UsageError, WorkloadFormatError  # noqa: F401 (docstring)

__all__ = [
    "MOST_BYTES",
    "MOST_SECONDS",
    "brief",
    "byte_count",
    "check_float",
    "check_int",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "seconds",
]

_FLOAT_MAX = int(sys.float_info.max)  # the largest integer a float can hold
MOST_BYTES = 2**53
"""Byte counts (a node's sizes, a device's memory, a graph's sizes together) must be below this,
9.0e15 bytes (8 PiB): solvers add bytes up in floats, which hold every whole number exactly only
below 2**53, and in int64 arrays (which 4e18 bytes overflowed)."""
MOST_SECONDS = 1e100
"""Times (a node's seconds on a kind, a transfer's) must be at most this: solvers add up the times
of a whole graph, and sums of times near the float maximum (1.7e308) overflowed (OverflowError in
``fsum``, ``inf`` read as "no split"); below it a sum of 1e200 of them stays finite."""
_BRIEF = 60  # characters of a value shown in a message


def brief(value: Any) -> str:
    """``repr(value)`` cut to a readable length, so that a message stays one short line.

    Example:
        >>> brief(10**100)
        '1000000000000000000000000... (an integer of 101 digits)'
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)) > 10**_BRIEF:
        return f"{str(int(value))[:25]}... (an integer of {len(str(abs(int(value))))} digits)"
    text = repr(value)
    text = " ".join(text.split())  # one line
    return text if len(text) <= _BRIEF else f"{text[:_BRIEF - 3]}..."


def _fail(error: type[TorchplaceError], name: str, expected: str, value: Any, why: str = "") -> TorchplaceError:
    prefix = f"{name}: " if name else ""
    return error(f"{prefix}expected {expected}, got {brief(value)}{why}")


def _expected(kind: str, low: float | None, strict: bool, unit: str) -> str:
    if low == 0:
        text = f"a {'positive' if strict else 'non-negative'} {kind}"
    elif low is None:
        text = f"a {kind}"
    else:
        text = f"a {kind} {'>' if strict else '>='} {low:g}"
    return f"{text} {unit}" if unit else text


def _to_float(value: numbers.Real, name: str, expected: str, error: type[TorchplaceError]) -> float:
    """``float(value)``; an integer or fraction beyond float range is an error, not an ``OverflowError``."""
    if isinstance(value, numbers.Integral) and abs(int(value)) > _FLOAT_MAX:
        raise _fail(error, name, expected, value, " (beyond float range)")
    try:
        return float(value)
    except OverflowError:
        raise _fail(error, name, expected, value, " (beyond float range)") from None


def check_float(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    strict: bool = False,
    unit: str = "",
    error: type[TorchplaceError] = UsageError,
) -> float:
    """``value`` as a finite float, at least ``low`` (above it if ``strict``) when ``low`` is given.

    Args:
        value: an int, a float or a numpy number (not a bool, not a string).
        name: what the value is, named in the message (``"time_limit"``, ``"f.json: nodes[0].cost"``);
            ``""`` leaves the name out (argparse adds the option's name itself).
        low, strict: the lower limit and whether it is excluded.
        unit: words after the expectation in the message (``"of seconds"``).
        error: the exception type to raise.

    Returns:
        The value as a Python float.

    Raises:
        error: for a non-number, a bool, NaN, an infinity, an integer beyond float range, or a
            value below the limit; the message names ``name`` and the value.
    """
    expected = _expected("finite number", low, strict, unit)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(error, name, expected, value)
    out = _to_float(value, name, expected, error)
    if not math.isfinite(out) or (low is not None and (out <= low if strict else out < low)):
        raise _fail(error, name, expected, value)
    return out


def check_int(
    value: Any,
    name: str,
    *,
    low: int | None = None,
    unit: str = "",
    error: type[TorchplaceError] = UsageError,
) -> int:
    """``value`` as a whole number, at least ``low`` when given; an integral float counts.

    Args:
        value: an int, an integral float (``4.0``) or a numpy number (not a bool, not a string).
        name, unit, error: as for :func:`check_float`.
        low: the smallest allowed value.

    Returns:
        The value as a Python int.

    Raises:
        error: for a non-number, a bool, NaN, an infinity, a fractional value, an integer beyond
            float range, or a value below ``low``.
    """
    positive = low == 1  # "a positive whole number" reads better than "a whole number >= 1"
    expected = _expected("whole number", 0 if positive else low, positive, unit)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(error, name, expected, value)
    if isinstance(value, numbers.Integral):
        out = int(value)
        if abs(out) > _FLOAT_MAX:
            raise _fail(error, name, expected, value, " (beyond float range)")
    else:
        f = _to_float(value, name, expected, error)
        if not (math.isfinite(f) and f.is_integer()):
            raise _fail(error, name, expected, value)
        out = int(f)
    if low is not None and out < low:
        raise _fail(error, name, expected, value)
    return out


def non_negative_float(value: Any, name: str, *, unit: str = "", error: type[TorchplaceError] = UsageError) -> float:
    """A finite float ``>= 0`` (:func:`check_float`): times, costs."""
    return check_float(value, name, low=0.0, unit=unit, error=error)


def positive_float(value: Any, name: str, *, unit: str = "", error: type[TorchplaceError] = UsageError) -> float:
    """A finite float ``> 0`` (:func:`check_float`): time limits, bandwidths."""
    return check_float(value, name, low=0.0, strict=True, unit=unit, error=error)


def non_negative_int(value: Any, name: str, *, unit: str = "", error: type[TorchplaceError] = UsageError) -> int:
    """A whole number ``>= 0`` (:func:`check_int`): byte sizes, device counts."""
    return check_int(value, name, low=0, unit=unit, error=error)


def byte_count(value: Any, name: str, *, unit: str = "of bytes", error: type[TorchplaceError] = UsageError,
               whole: bool = True) -> Any:
    """A whole number of bytes ``>= 0`` and below :data:`MOST_BYTES` (:func:`check_int`); with
    ``whole=False`` any finite number there, as a float (Piper's per-sample bytes)."""
    out = check_int(value, name, low=0, unit=unit, error=error) if whole else \
        check_float(value, name, low=0.0, unit=unit, error=error)
    if out >= MOST_BYTES:
        raise _fail(error, name, f"a {'whole ' if whole else ''}number {unit} below 2**53 (9.0e15)", value,
                    ", more than the solvers count exactly; divide every size and memory limit by one "
                    "factor (memory depends on their ratios only)")
    return out


def seconds(value: Any, name: str, *, unit: str = "of seconds", error: type[TorchplaceError] = UsageError) -> float:
    """A finite number ``>= 0`` and at most :data:`MOST_SECONDS` (:func:`check_float`): times."""
    out = check_float(value, name, low=0.0, unit=unit, error=error)
    if out > MOST_SECONDS:
        raise _fail(error, name, "a number of seconds up to 1e+100", value,
                    ", so large that sums of such times overflow; give times in a larger unit")
    return out


def positive_int(value: Any, name: str, *, unit: str = "", error: type[TorchplaceError] = UsageError) -> int:
    """A whole number ``>= 1`` (:func:`check_int`): micro-batches, batch sizes, limits."""
    return check_int(value, name, low=1, unit=unit, error=error)
