"""Measure the links between devices: fit ``time = latency + bytes / bandwidth`` per device pair.

Baechi (Jeon et al. 2020, Sec. 4.1): "For communication time, we use a linear model proportional
to data size. We implemented a microbenchmark tool [...] to measure communication times for
various data sizes, and generated a communication cost function through the linear regression."
Here the microbenchmark times tensor copies for every ordered pair of devices and several sizes;
:func:`fit_link` fits the line by least squares (intercept = latency, 1 / slope = bandwidth).

What one copy of ``n`` bytes is (a ``uint8`` tensor ``x`` of ``n`` elements on ``src``):

* by default ``buf.copy_(x)`` into a buffer ``buf`` allocated on ``dst`` beforehand: the bus (or,
  within host memory, the memcpy) alone. With ``allocate=True`` it is ``x.to(dst)`` (``x.clone()``
  within one torch device), which also pays for allocating the destination, as the runtime does;
  on a busy machine fresh host buffers make that noisy (measured here with 7 other jobs on 2 cores:
  a 64 KiB ``clone()`` had a median of 23 ms against 3 us for ``copy_`` into a kept buffer).
* accelerator copies come from pageable host memory and are bracketed by
  ``torch.cuda.synchronize`` of both ends, timed with ``time.perf_counter``, so the
  synchronisation overhead is part of the fitted latency, as it is of a real transfer.
* between CPU devices (``"cpu"``, logical ``"cpu:0"``, ``"cpu:1"``, ...: all host memory) the copy
  is a host memcpy: an upper bound on handing a tensor from one logical CPU worker to another (the
  runtime passes the tensor itself, and the cost model charges CPU to CPU nothing).

Sizes are interleaved (each round copies every size once) and the point fitted per size is the
*fastest* of its ``repeats`` timed copies (after ``warmup`` untimed rounds) by default: preemption by other processes, page faults and clock ticks only ever add time,
so the minimum is the stable estimate of the link itself on a busy machine, where a median of a few
copies is not (pass ``statistic="median"`` for the typical time).
"""
from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from torchplace.devices import Cluster, Link
from torchplace.errors import warn_caller

__all__ = ["HOST_LINK_SIZES", "LinkFit", "cluster_with_measured_links", "default_sizes", "fit_link",
           "measure_host_links", "measure_links", "time_copies", "with_measured_host_links"]

Pair = tuple[str, str]
_POOR_FIT = 0.9  # r2 below which measure_links warns
_STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


@dataclass(frozen=True)
class LinkFit:
    """A fitted link model ``seconds = latency + nbytes / bandwidth``.

    Attributes:
        latency: the intercept in seconds (clamped at 0 when noise makes it negative).
        bandwidth: ``1 / slope`` in bytes/s (``inf`` when the slope is not positive, i.e. the
            sizes were too small to see the bandwidth).
        r2: coefficient of determination of the least-squares line on the fitted points.
        samples: the number of (bytes, seconds) points fitted (one per size in
            :func:`measure_links`).
    """

    latency: float
    bandwidth: float
    r2: float
    samples: int

    def time(self, nbytes: int) -> float:
        """Predicted seconds to move ``nbytes`` (0 for nothing to move)."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def to_link(self) -> Link:
        return Link(self.bandwidth, self.latency)


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Least-squares fit of ``seconds = latency + nbytes / bandwidth`` (Baechi Sec. 4.1).

    Sizes are scaled by their maximum before the solve so that the 2-column system stays well
    conditioned for sizes up to 2**30 and more; times from an exact line give it back to rounding.

    Raises:
        ValueError: for fewer than two distinct sizes, mismatched lengths, or non-finite values.
    """
    x = np.asarray(nbytes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"nbytes and seconds must be 1-d and of one length, got {x.shape} and {t.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("nbytes and seconds must be finite")
    if len(np.unique(x)) < 2:
        raise ValueError(f"fitting a line needs at least two distinct sizes, got {sorted(set(x.tolist()))}")
    scale = float(np.max(np.abs(x)))
    design = np.column_stack([np.ones_like(x), x / scale])
    (intercept, scaled_slope), *_ = np.linalg.lstsq(design, t, rcond=None)
    slope = float(scaled_slope) / scale
    residual = t - design @ np.array([intercept, scaled_slope])
    spread = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - float(np.sum(residual**2)) / spread if spread > 0 else 1.0
    return LinkFit(
        latency=max(float(intercept), 0.0),
        bandwidth=1.0 / slope if slope > 0 else math.inf,
        r2=r2,
        samples=len(x),
    )


_LOGICAL_CPU = re.compile(r"cpu(:\d+)?")


def _torch_device(name: str) -> torch.device:
    """The torch device behind a device string; logical ``cpu:i`` are the CPU."""
    if _LOGICAL_CPU.fullmatch(name):
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"cannot measure links of {name!r}: not a torch device ({e})") from e
    if dev.type == "meta":
        raise ValueError(f"cannot measure links of {name!r}: a meta device holds no data to copy")
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()


def _copy(src: torch.device, dst: torch.device, n: int, allocate: bool) -> Callable[[torch.Tensor], object]:
    """The copy to time (see the module docstring)."""
    if allocate:
        return (lambda x: x.clone()) if src == dst else (lambda x: x.to(dst))
    buf = torch.empty(n, dtype=torch.uint8, device=dst)
    return lambda x: buf.copy_(x)


def time_copies(
    src: str, dst: str, sizes: Iterable[int], repeats: int = 5, warmup: int = 2, allocate: bool = False
) -> dict[int, list[float]]:
    """Seconds of ``repeats`` timed copies from ``src`` to ``dst`` per size (see module docstring).

    The sizes are interleaved (round ``r`` copies every size once), so that a burst of load from
    other processes slows one copy of many sizes rather than every copy of one size.

    Raises:
        ValueError: for a device that is not a torch device (or is ``meta``).
    """
    s, d = _torch_device(src), _torch_device(dst)
    sources = {n: torch.ones(n, dtype=torch.uint8, device=s) for n in map(int, sizes)}
    copies = {n: _copy(s, d, n, allocate) for n in sources}
    out: dict[int, list[float]] = {n: [] for n in sources}
    for round_ in range(warmup + repeats):
        for n, x in sources.items():
            _sync(s)
            _sync(d)
            t0 = time.perf_counter()
            y = copies[n](x)
            _sync(s)
            _sync(d)
            elapsed = time.perf_counter() - t0
            del y
            if round_ >= warmup:
                out[n].append(elapsed)
    return out


def default_sizes(devices: Sequence[str]) -> tuple[int, ...]:
    """1 KiB to 64 MiB in factors of 4; to 16 MiB when all devices are CPUs (fast on CPU)."""
    top = 24 if all(_LOGICAL_CPU.fullmatch(n) for n in devices) else 26
    return tuple(2**k for k in range(10, top + 1, 2))


def measure_links(
    devices: Sequence[str],
    sizes: Sequence[int] | None = None,
    repeats: int = 20,
    warmup: int = 2,
    statistic: Literal["min", "median"] = "min",
    allocate: bool = False,
    progress: bool = True,
) -> dict[Pair, LinkFit]:
    """Fit a :class:`LinkFit` for every ordered pair of distinct ``devices`` (Baechi Sec. 4.1).

    Args:
        devices: device strings (``"cuda:0"``, ``"cpu"``, logical ``"cpu:1"``), as in the cluster.
        sizes: bytes per copy; :func:`default_sizes` when ``None``. At least two distinct sizes.
        repeats: timed copies per size.
        warmup: untimed copies per size first.
        statistic: which of a size's ``repeats`` times is fitted: ``"min"`` (default, see the
            module docstring) or ``"median"``.
        allocate: time ``x.to(dst)`` (allocating the destination) instead of ``copy_`` into a
            kept buffer.
        progress: show a tqdm bar over the pairs.

    Warns:
        RuntimeWarning: for a pair whose fit has r2 < 0.9 (noisy timings).

    Returns:
        ``{(src, dst): LinkFit}``; pass it to :func:`cluster_with_measured_links`.

    Raises:
        ValueError: for a repeated device, a device that is not a torch device, fewer than two
            sizes, ``repeats < 1`` or an unknown ``statistic``.
    """
    names = list(devices)
    if len(set(names)) != len(names):
        raise ValueError(f"devices must be distinct, got {names}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(_STATISTICS)}, got {statistic!r}")
    pick = _STATISTICS[statistic]
    sizes = tuple(default_sizes(names) if sizes is None else sizes)
    for name in names:
        _torch_device(name)  # fail before timing anything
    pairs = [(s, d) for s in names for d in names if s != d]
    fits: dict[Pair, LinkFit] = {}
    with tqdm(pairs, desc="measuring links", disable=not progress, leave=False) as bar:
        for src, dst in bar:
            times = time_copies(src, dst, sizes, repeats, warmup, allocate)
            fits[(src, dst)] = fit = fit_link(sizes, [pick(times[n]) for n in sizes])
            if fit.r2 < _POOR_FIT:
                warn_caller(f"link {src} -> {dst}: times fit latency + bytes / bandwidth poorly (r2 = {fit.r2:.2f}); "
                            f"measure on a quieter machine or with more repeats (now {repeats})", RuntimeWarning)
    return fits


def cluster_with_measured_links(cluster: Cluster, fits: Mapping[Pair, LinkFit]) -> Cluster:
    """``cluster`` with the measured pairs' links set to their fits (other links kept).

    A measured pair replaces its entry in ``links`` or ``pair_bandwidth``.

    Raises:
        ValueError: for a fitted pair naming a device that is not in the cluster.
    """
    for pair in fits:
        unknown = [n for n in pair if n not in cluster.names]
        if unknown:
            raise ValueError(f"measured pair {pair} names {unknown[0]!r}, not a device of the cluster {cluster.names}")
    links = {**cluster.links, **{pair: fit.to_link() for pair, fit in fits.items()}}
    pair_bandwidth = {p: bw for p, bw in cluster.pair_bandwidth.items() if p not in fits}
    return replace(cluster, links=links, pair_bandwidth=pair_bandwidth)


HOST_LINK_SIZES = tuple(2**k for k in range(16, 27, 2))
"""64 KiB to 64 MiB: the sizes :func:`measure_host_links` times (activations and weights)."""


def measure_host_links(device: str, repeats: int = 5) -> dict[Pair, LinkFit]:
    """:func:`measure_links` between host memory (``"cpu"``) and ``device``, both ways, over
    :data:`HOST_LINK_SIZES`: copies from pageable memory into a buffer kept on the other side."""
    return measure_links(["cpu", device], sizes=HOST_LINK_SIZES, repeats=repeats, warmup=1, progress=False)


def with_measured_host_links(cluster: Cluster, hosts: Sequence[str] | None = None, *, repeats: int = 5) -> Cluster:
    """``cluster`` with the links between host memory and each attached CUDA device measured
    (:func:`measure_host_links`).

    Measured on an H100: 5.5 GB/s to the GPU and 13 GB/s back, where the old default took PCIe's
    nominal 12 GB/s both ways. Timing ``x.to(dst)`` with a fresh destination instead gave 1.2 GB/s
    back (a new host buffer pays its page faults), which made the cost model charge a GPU -> CPU
    pipeline 6x the time it ran in (the runtime's host buffers are reused by the allocator in a
    steady state).

    The fits become the links between every host device (``hosts``; default the devices of kind
    ``"cpu"``) and each CUDA device, for the latency objective's per-pair transfers
    (:func:`cluster_with_measured_links`); the cluster's default link becomes the mean of the two
    directions, the per-side price the throughput model charges an accelerator for each tensor
    crossing its boundary (Tarnawski Sec. 3: one price per side). With several CUDA devices the
    default takes the slowest device's mean.

    A cluster without an attached CUDA device is returned unchanged.
    """
    accel = [d for d in cluster.devices if d.torch_device.startswith("cuda")]
    host_names = [d.name for d in cluster.devices if d.kind == "cpu"] if hosts is None else list(hosts)
    if not accel or not host_names or not torch.cuda.is_available():
        return cluster
    fits: dict[Pair, LinkFit] = {}
    default: list[tuple[float, float]] = []
    for d in accel:
        measured = measure_host_links(d.torch_device, repeats)
        there, back = measured[("cpu", d.torch_device)], measured[(d.torch_device, "cpu")]
        for h in host_names:
            fits[(h, d.name)], fits[(d.name, h)] = there, back
        default.append(((there.latency + back.latency) / 2, (1 / there.bandwidth + 1 / back.bandwidth) / 2))
    latency, per_byte = max(default, key=lambda lp: lp[0] + lp[1] * 2**20)
    return replace(cluster_with_measured_links(cluster, fits), latency=latency,
                   bandwidth=1 / per_byte if per_byte > 0 else cluster.bandwidth)
