"""What this machine has: CUDA devices, memory, and whether a torch device is attached.

Used by :func:`torchplace.devices.make_cluster` and :func:`~torchplace.devices.check_attached`,
which build and check the clusters models run on. torch is imported on first use only, so this
module (and :mod:`torchplace.devices`) stays importable without torch being imported; tests
replace :func:`cuda_count` and :func:`cuda_memory` to act as a machine with GPUs.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from torchplace.errors import UsageError
from torchplace.units import parse_torch_device

__all__ = ["cpu_memory", "cpu_model", "cuda_count", "cuda_memory", "device_count", "names", "require_attached"]


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 without CUDA)."""
    import torch  # profiling-side only; solvers never reach here

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_memory(index: int) -> int:
    """Total memory of ``cuda:index`` in bytes."""
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; else what :mod:`platform` says)."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads in the calling thread (``None``: as is),
    then put the previous count back. torch's OpenMP thread count belongs to the calling thread
    (``torch.set_num_threads`` also sets the default of threads started later, and MKL's count)."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_memory() -> int:
    """Available host memory in bytes."""
    return int(psutil.virtual_memory().available)


def device_count(kind: str) -> int:
    """Devices of a torch type other than cpu/cuda/meta this process sees (``torch.xpu.device_count()``, ...)."""
    import torch

    module = getattr(torch, kind, None)
    count = getattr(module, "device_count", None)
    available = getattr(module, "is_available", None)
    if count is None or (available is not None and not available()):
        return 0
    return int(count())


def names(n_cuda: int) -> list[str]:
    """The device strings :func:`~torchplace.devices.make_cluster` accepts here, for messages."""
    return ["cpu", *(f"cuda:{i}" for i in range(n_cuda)), "cpu:0", "cpu:1", "..."]


def require_attached(name: str, torch_device: str, n_cuda: int) -> None:
    """Raise unless ``torch_device`` is a device of this machine that can hold tensors.

    Args:
        name: the device's name, for the message.
        torch_device: its torch device string.
        n_cuda: :func:`cuda_count` (passed in: counted once per cluster).

    Raises:
        UsageError: for a malformed string, ``meta`` (holds no data), or a device this machine
            does not have (``cuda:7`` with two GPUs), naming the device and what is here.
    """
    kind, index = parse_torch_device(torch_device)
    where = f"device {name!r}: torch_device {torch_device!r}"
    if kind == "meta":
        raise UsageError(f"{where} holds no data, so nothing can run there: use 'cpu' or 'cuda:i' "
                         f"(a meta device is for planning only: build a Cluster or a cluster file)")
    if kind == "cpu":
        return
    count = n_cuda if kind == "cuda" else device_count(kind)
    if (index or 0) >= count:
        have = f"{count} {kind} device{'s' if count != 1 else ''}"
        raise UsageError(f"{where} is not on this machine, which has {have}; devices here: {names(n_cuda)}")
