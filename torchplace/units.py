"""Amounts a user writes: memory sizes, bandwidths, times, torch device strings.

``parse_memory("20GiB")``, ``parse_bandwidth("25GB/s")``, ``parse_seconds("5us")`` and
``parse_torch_device("cuda:1")`` turn a number or a string into a checked value or raise a
:class:`~torchplace.errors.UsageError` (a ``ValueError``) that names the value and shows a valid
form. Callers that read a file re-raise it as a
:class:`~torchplace.errors.WorkloadFormatError` naming the file and the field. Numbers go through
:mod:`torchplace.checks` (no NaN, no infinity, no bool, nothing beyond float range, whole bytes).
Re-exported by :mod:`torchplace.devices`. Torch-free.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from torchplace.checks import brief, non_negative_float, non_negative_int, positive_float
from torchplace.errors import UsageError

__all__ = ["format_bytes", "parse_bandwidth", "parse_memory", "parse_seconds", "parse_torch_device"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_ACCELERATE_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
"""The units accelerate's ``convert_file_size_to_int`` reads (any case)."""
_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}  # divisors: 20 / 1e6 rounds to 2e-05
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]{1,3})?)\s*([A-Za-z]*)\s*")


def _number(value: Any, check: Any, expected: str) -> Any:
    """``check(value)`` (a :mod:`torchplace.checks` function), its error worded as ``expected``."""
    try:
        return check(value, "")
    except UsageError:
        raise UsageError(f"{expected}, got {brief(value)}") from None


def _amount(text: str, units: Mapping[str, Any], what: str, example: str) -> tuple[Fraction, str]:
    """The exact number and the (lower-case) unit of ``"1.5 GB"``-like text."""
    m = _AMOUNT.fullmatch(text)
    if not m or m.group(2).lower() not in units:
        raise UsageError(
            f"cannot read {what} {brief(text)}: use {example} (units: {', '.join(u for u in units if u)})"
        )
    return Fraction(m.group(1)), m.group(2).lower()


def parse_memory(value: float | str) -> int:
    """Bytes from a whole number or a string like ``"20GiB"``, ``"512MB"``, ``"1.5 GB"`` (accelerate's form).

    The units accelerate 1.15's ``convert_file_size_to_int`` reads (``KiB``, ``MiB``, ``GiB``,
    ``KB``, ``MB``, ``GB``, in any case) give the bytes it gives: ``int(float(number) * unit)``, and
    a decimal unit written with a lower-case ``b`` is in *bits*, divided by 8 (``"8Gb"`` and
    ``"8gb"`` are 1e9 bytes), as accelerate reads a ``max_memory`` copied from it. Beyond those,
    ``TB`` / ``TiB`` (``"Tb"``: terabits) and bytes (no unit or ``B``) are read exactly: a number,
    or a string in bytes, must be a whole number of bytes (``1.7`` is an error, not 1), and
    ``"1.5TiB"`` is rounded down to whole bytes (a cap is never exceeded). A number may carry an
    exponent, as accelerate's ``float`` reads it (``"1e3MB"``).

    Raises:
        UsageError: (a ``ValueError``) for a negative, fractional, non-finite or huge amount, a
            bool, a string that is not a number with a known unit, or a lone ``b`` (bits or bytes:
            write ``B``).
    """
    expected = "memory must be a non-negative whole number of bytes (or a string like '20GiB')"
    if not isinstance(value, str):
        return int(_number(value, non_negative_int, expected))
    amount, unit = _amount(value, _UNITS, "memory size", "bytes or a number with a unit, e.g. '20GiB', '512MB'")
    written = value.strip()[-len(unit):] if unit else ""
    if written == "b":
        raise UsageError(f"cannot read memory size {brief(value)}: a lower-case 'b' is bits in accelerate's units; "
                         "write 'B' for bytes")
    per = 8 if unit in ("kb", "mb", "gb", "tb") and written.endswith("b") else 1  # bits, as accelerate reads them
    if unit in _ACCELERATE_UNITS:  # accelerate's float arithmetic, to its byte
        product = float(amount) * _ACCELERATE_UNITS[unit] if amount < 2**1000 else math.inf
        if not math.isfinite(product):
            raise UsageError(f"{expected}, got {brief(value)}")
        nbytes = int(product) // per
    else:
        exact = amount * _UNITS[unit] / per
        if unit in ("", "b") and exact.denominator != 1:
            raise UsageError(f"{expected}, got {brief(value)}")
        nbytes = math.floor(exact)
    return int(_number(nbytes, non_negative_int, expected))


def parse_bandwidth(value: float | str) -> float:
    """Bytes/s from a positive number or a string like ``"25GB/s"``, ``"100 MiB/s"``.

    A unit ending in a capital ``B`` is bytes, in a lower-case ``b`` bits, as network links are
    written: ``"100Gb/s"`` is 12.5e9 bytes/s, ``"10 Mb/s"`` 1.25e6, ``"8b/s"`` 1.
    ``math.inf`` (a link whose transfers cost only its latency, as a fitted link with no
    measurable slope has) is allowed; NaN, zero, negatives and integers beyond float range are not.

    Raises:
        UsageError: (a ``ValueError``) for a bandwidth that is not a positive number or a string
            without ``/s`` or with an unknown unit.
    """
    expected = "bandwidth must be a positive number of bytes/s"
    if isinstance(value, str):
        text = value.strip()
        unreadable = UsageError(f"cannot read bandwidth {brief(value)}: use a number of bytes/s (1e9, unquoted) or "
                                f"a string ending in '/s', e.g. '25GB/s', '100MiB/s', '10Gb/s' (a lower-case b is "
                                f"bits; units: {', '.join(u for u in _UNITS if u)})")
        if not text.endswith("/s"):
            raise unreadable
        try:
            amount, unit = _amount(text[:-2], _UNITS, "bandwidth", "")
        except UsageError:
            raise unreadable from None  # naming what the user wrote, '/s' included
        bits = text[:-2].rstrip().endswith("b")  # "Gb/s": gigabits, an eighth of "GB/s"
        rate = amount * _UNITS[unit] / (8 if bits else 1)
        try:
            return float(positive_float(rate, ""))
        except UsageError:
            raise UsageError(f"{expected}, got {brief(value)}") from None  # the text, not the Fraction
    if isinstance(value, float) and value == math.inf:
        return value
    return float(_number(value, positive_float, expected))


def parse_seconds(value: float | str) -> float:
    """Seconds from a non-negative number or a string like ``"5us"``, ``"2ms"``, ``"0.1 s"``.

    Raises:
        UsageError: (a ``ValueError``) for a negative, NaN, infinite or unreadable time.
    """
    expected = "time must be a non-negative finite number of seconds"
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*", value)
        if not m or m.group(2) not in _PER_SECOND:
            raise UsageError(
                f"cannot read time {brief(value)}: use seconds or e.g. '5us', '2ms' (units: s, ms, us, ns)"
            )
        value = float(m.group(1)) / _PER_SECOND[m.group(2)]
    return float(_number(value, non_negative_float, expected))


_TORCH_TYPES = frozenset({
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia", "xla",
    "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
})  # the device types torch.device accepts (c10/core/DeviceType.cpp)
_TORCH_DEVICE = re.compile(r"([a-z_]+)(?::(0|[1-9][0-9]*))?")
_MAX_INDEX = 127  # c10::DeviceIndex is an int8: torch.device("cuda:128") silently becomes cuda:-128


def parse_torch_device(text: Any) -> tuple[str, int | None]:
    """The type and index of a torch device string (``"cuda:1"`` -> ``("cuda", 1)``), without torch.

    Only the syntax is checked (what ``torch.device`` accepts, up to index 127): not whether the
    device is attached to this machine (:func:`make_cluster` checks that).

    Raises:
        UsageError: for text that is not a torch device string, naming it and the valid types.
    """
    m = _TORCH_DEVICE.fullmatch(text) if isinstance(text, str) else None
    if m is None or m.group(1) not in _TORCH_TYPES or (m.group(2) and int(m.group(2)) > _MAX_INDEX):
        raise UsageError(
            f"{brief(text)} is not a torch device: use 'type' or 'type:index' (index 0..{_MAX_INDEX}) with a type "
            f"of {', '.join(sorted(_TORCH_TYPES))}, e.g. 'cpu', 'cuda:0'"
        )
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def format_bytes(n: float) -> str:
    """``n`` bytes as people read them: ``"512 B"``, ``"1.5 KiB"``, ... ``"2.0 GiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
