"""Devices and clusters: what can hold a stage, how much memory it has, how fast links are.

Device strings follow torch (``"cpu"``, ``"cuda:0"``), plus *logical* CPU devices ``"cpu:0"``,
``"cpu:1"``, ...: each maps to the CPU but gets its own pipeline worker, so stages on them
overlap. A device of kind ``"cpu"`` pays no transfer cost (the CPU reads host RAM directly), as in
the cost model of Tarnawski et al. 2020, Sec. 3; every other kind pays ``latency + bytes /
bandwidth`` for each tensor crossing its boundary.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import psutil

__all__ = ["Cluster", "Device", "discover_devices", "make_cluster", "parse_memory"]

# PCIe 3.0 x16 effective host<->device bandwidth; replaced by a measurement where one is made.
DEFAULT_LINK_BANDWIDTH = 12e9  # bytes / s
DEFAULT_LINK_LATENCY = 10e-6  # s

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_memory(value: float | str) -> int:
    """Bytes from an int or a string like ``"20GiB"``, ``"512MB"``, ``"1.5 GB"`` (accelerate's form).

    Raises:
        ValueError: for a negative amount or an unknown unit.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"memory must be non-negative, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read memory size {value!r}: use bytes or a number with a unit, "
            f"e.g. '20GiB', '512MB' (units: {', '.join(u for u in _UNITS if u)})"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Device:
    """One place a stage can run.

    Attributes:
        name: the name the user gave (``"cpu:1"``, ``"cuda:0"``, ``"fpga3"``).
        torch_device: the torch device its tensors live on (``"cpu"`` for logical CPUs).
        kind: device kind used to look up node times (``"cpu"``, ``"cuda"``, ``"accel"``).
        memory_bytes: capacity for this device's stages; ``None`` means unlimited.
    """

    name: str
    torch_device: str
    kind: str
    memory_bytes: int | None = None

    @property
    def pays_transfer(self) -> bool:
        """Whether tensors crossing this device's boundary cost transfer time (all but CPUs)."""
        return self.kind != "cpu"


@dataclass(frozen=True)
class Cluster:
    """Devices plus the links between them.

    Every non-CPU device talks to host memory over a link of ``bandwidth`` bytes/s and
    ``latency`` s (a PCIe bus in the model of Tarnawski et al. 2020, Sec. 3).
    ``pair_bandwidth`` may override the bandwidth of a specific (src, dst) pair.
    """

    devices: tuple[Device, ...]
    bandwidth: float = DEFAULT_LINK_BANDWIDTH
    latency: float = DEFAULT_LINK_LATENCY
    pair_bandwidth: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise ValueError(f"device names must be unique, got {names}")
        if not self.devices:
            raise ValueError("a cluster needs at least one device")

    def __len__(self) -> int:
        return len(self.devices)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"no device named {name!r}; devices: {[d.name for d in self.devices]}")

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.devices]

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` between host memory and an accelerator."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def link_time(self, nbytes: int, src: str, dst: str) -> float:
        """Seconds to move ``nbytes`` from device ``src`` to device ``dst`` (0 on one device).

        The pair's own bandwidth when ``pair_bandwidth`` gives one, else the cluster's.
        """
        if src == dst or nbytes <= 0:
            return 0.0
        return self.latency + nbytes / self.pair_bandwidth.get((src, dst), self.bandwidth)


def _cuda_count() -> int:
    import torch  # profiling-side only; solvers never reach here

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def discover_devices() -> list[Device]:
    """The devices of this machine: ``cpu`` (available RAM) and every visible ``cuda:i``."""
    import torch

    devs = [Device("cpu", "cpu", "cpu", psutil.virtual_memory().available)]
    for i in range(_cuda_count()):
        devs.append(Device(f"cuda:{i}", f"cuda:{i}", "cuda", torch.cuda.get_device_properties(i).total_memory))
    return devs


_LOGICAL_CPU = re.compile(r"cpu:(\d+)")


def make_cluster(
    devices: Sequence[str | Device],
    max_memory: Mapping[str, int | str] | None = None,
    bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    latency: float = DEFAULT_LINK_LATENCY,
) -> Cluster:
    """Build a :class:`Cluster` from device strings (or :class:`Device` s) and optional memory caps.

    Args:
        devices: e.g. ``["cuda:0", "cpu"]`` or ``["cpu:0", "cpu:1"]``.
        max_memory: per-device caps in bytes or strings (``{"cuda:0": "20GiB"}``), like
            accelerate's ``max_memory``. Devices not named keep their discovered capacity.

    Raises:
        ValueError: for an unknown device string (the message lists the valid ones), a repeated
            device, or a ``max_memory`` key that is not one of ``devices``.
    """
    present = {d.name: d for d in discover_devices()}
    out: list[Device] = []
    for spec in devices:
        if isinstance(spec, Device):
            out.append(spec)
            continue
        name = str(spec).strip()
        if name in present:
            out.append(present[name])
        elif _LOGICAL_CPU.fullmatch(name):
            out.append(Device(name, "cpu", "cpu", present["cpu"].memory_bytes))
        else:
            valid = sorted(present) + ["cpu:0", "cpu:1", "..."]
            raise ValueError(f"unknown device {name!r}; valid devices on this machine: {valid}")
    caps = dict(max_memory or {})
    names = {d.name for d in out}
    for key in caps:
        if key not in names:
            raise ValueError(f"max_memory names {key!r}, which is not one of the devices {sorted(names)}")
    out = [
        Device(d.name, d.torch_device, d.kind, parse_memory(caps[d.name])) if d.name in caps else d
        for d in out
    ]
    return Cluster(tuple(out), bandwidth=bandwidth, latency=latency)
