"""Devices and clusters: what can hold a stage, how much memory it has, how fast links are.

Device strings follow torch (``"cpu"``, ``"cuda:0"``), plus *logical* CPU devices ``"cpu:0"``,
``"cpu:1"``, ...: each maps to the CPU but gets its own pipeline worker, so stages on them
overlap. A device of kind ``"cpu"`` pays no transfer cost (the CPU reads host RAM directly), as in
the cost model of Tarnawski et al. 2020, Sec. 3; every other kind pays ``latency + bytes /
bandwidth`` for each tensor crossing its boundary.

Links between devices (MOIRAI, Sec. III-A and III-C) are directed: ``links[(src, dst)]`` gives a
:class:`Link` (bandwidth in bytes/s, latency in s), so up- and downlink may differ. With
``topology="mesh"`` every pair is directly connected and a pair without an entry uses the
cluster's default ``bandwidth`` / ``latency``. With ``topology="graph"`` the entries are the only
direct links; any other pair communicates over the *widest path* of the link graph: the path whose
slowest hop is fastest, since "the bandwidth of a multi-hop path depends on the minimum bandwidth
on the path" (MOIRAI Sec. III-C), taking the sum of the hops' latencies (ties between equally wide
paths go to the smallest total latency). Cluster files (JSON/YAML) are read and written by
:mod:`torchplace.clusterfile` (:func:`~torchplace.clusterfile.load_cluster`, :meth:`Cluster.save`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import networkx as nx

from torchplace import machine
from torchplace.checks import brief, byte_count
from torchplace.errors import UsageError
from torchplace.units import parse_bandwidth, parse_memory, parse_seconds, parse_torch_device

__all__ = [
    "Cluster",
    "Device",
    "Link",
    "Topology",
    "cap_memory",
    "check_attached",
    "discover_devices",
    "kind_threads",
    "make_cluster",
    "parse_bandwidth",
    "parse_memory",
    "parse_seconds",
    "parse_torch_device",
]

# PCIe 3.0 x16 effective host<->device bandwidth; replaced by a measurement where one is made.
DEFAULT_LINK_BANDWIDTH = 12e9  # bytes / s
DEFAULT_LINK_LATENCY = 10e-6  # s

Topology = Literal["mesh", "graph"]

@dataclass(frozen=True)
class Device:
    """One place a stage can run.

    Attributes:
        name: the name the user gave (``"cpu:1"``, ``"cuda:0"``, ``"fpga3"``).
        torch_device: the torch device its tensors live on (``"cpu"`` for logical CPUs).
        kind: device kind used to look up node times (``"cpu"``, ``"cuda"``, ``"accel"``).
        memory_bytes: capacity for this device's stages; ``None`` means unlimited.
        threads: intra-op threads its worker computes with (``None``: the process's setting);
            profiling times the device's kind with it. ``make_cluster(..., share_cores=True)``
            splits this machine's cores among the CPU devices, so two logical CPUs do not fight
            over the same cores.
    """

    name: str
    torch_device: str
    kind: str
    memory_bytes: int | None = None
    threads: int | None = None

    @property
    def pays_transfer(self) -> bool:
        """Whether tensors crossing this device's boundary cost transfer time (all but CPUs)."""
        return self.kind != "cpu"


@dataclass(frozen=True)
class Link:
    """A directed link: ``bandwidth`` bytes/s and ``latency`` s; ``None`` takes the cluster's default."""

    bandwidth: float | None = None
    latency: float | None = None

    def time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over this (resolved) link; 0 for nothing to move."""
        if self.bandwidth is None or self.latency is None:
            raise ValueError("an unresolved Link has no time: use Cluster.link(src, dst)")
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


@dataclass(frozen=True)
class _Route:
    link: Link  # resolved: bandwidth = slowest hop, latency = sum of hops
    path: tuple[str, ...]  # device names from src to dst
    explicit: bool  # built from given links (False: the mesh default)


@dataclass(frozen=True)
class Cluster:
    """Devices plus the links between them.

    Every non-CPU device talks to host memory over a link of ``bandwidth`` bytes/s and
    ``latency`` s (a PCIe bus in the model of Tarnawski et al. 2020, Sec. 3); that default is what
    :meth:`transfer_time` (throughput objective) uses. :meth:`link_time` (latency objective) uses
    the per-pair links described in the module docstring.

    Attributes:
        devices: the devices, names unique.
        bandwidth, latency: default link (bytes/s, s; strings such as ``"25GB/s"``, ``"5us"`` are
            read with :func:`parse_bandwidth` / :func:`parse_seconds` and kept as numbers).
        pair_bandwidth: legacy per-pair bandwidth: ``{(src, dst): bw}`` is the same as
            ``links={(src, dst): Link(bw)}`` (latency = the default).
        links: directed direct links ``{(src, dst): Link}``; a pair may not be in both mappings.
        topology: ``"mesh"`` (unlisted pairs use the default link) or ``"graph"`` (unlisted pairs
            use the widest path over the listed links).

    The route of every pair is computed once, at construction; treat the mappings as immutable.

    Raises:
        UsageError: (a ``ValueError``) for a device that is not a :class:`Device` or has an empty
            name or kind, a ``torch_device`` that is not a torch device string (only the syntax:
            a cluster may describe hardware that is not attached, for planning), a negative,
            fractional or non-finite ``memory_bytes``, repeated device names, a link naming an
            unknown device or joining a device to itself, a ``links`` value that is not a
            :class:`Link`, a non-positive bandwidth, a negative latency, or
            (``topology="graph"``) two devices with no path between them (naming the pair).
    """

    devices: tuple[Device, ...]
    bandwidth: float = DEFAULT_LINK_BANDWIDTH
    latency: float = DEFAULT_LINK_LATENCY
    pair_bandwidth: Mapping[tuple[str, str], float] = field(default_factory=dict)
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    topology: Topology = "mesh"
    _routes: dict[tuple[str, str], _Route] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.devices, (str, Device)) or not isinstance(self.devices, Sequence):
            raise UsageError(f"devices must be a sequence of Device objects, got {brief(self.devices)}")
        for d in self.devices:
            _check_device(d)
        names = [d.name for d in self.devices]
        if len(set(names)) != len(names):
            raise UsageError(f"device names must be unique, got {names}")
        if not self.devices:
            raise UsageError("a cluster needs at least one device")
        if self.topology not in ("mesh", "graph"):
            raise UsageError(f"topology must be 'mesh' or 'graph', got {brief(self.topology)}")
        object.__setattr__(self, "bandwidth", parse_bandwidth(self.bandwidth))  # "25GB/s" -> 25e9: the
        object.__setattr__(self, "latency", parse_seconds(self.latency))  # times below divide by them
        direct = self._direct_links(set(names))
        routes = {p: _Route(link, p, True) for p, link in direct.items()}
        if self.topology == "graph":
            routes = {**_widest_routes(names, direct), **routes}
            missing = next(((s, d) for s in names for d in names if s != d and (s, d) not in routes), None)
            if missing is not None:
                raise UsageError(
                    f"no path from device {missing[0]!r} to {missing[1]!r} over the links of this "
                    f"topology='graph' cluster: add a link between them (or a chain of links), "
                    f"or use topology='mesh' so that unlisted pairs use the default link"
                )
        object.__setattr__(self, "_routes", routes)

    def _direct_links(self, names: set[str]) -> dict[tuple[str, str], Link]:
        """The given direct links with defaults filled in, validated."""
        both = set(self.pair_bandwidth) & set(self.links)
        if both:
            raise UsageError(f"pairs {sorted(both)} are in both pair_bandwidth and links: give each pair once")
        given = {**{p: Link(bw) for p, bw in self.pair_bandwidth.items()}, **self.links}
        out: dict[tuple[str, str], Link] = {}
        for pair, link in given.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and set(pair) <= names):
                raise UsageError(f"link {brief(pair)} must be a (src, dst) pair of device names {sorted(names)}")
            if pair[0] == pair[1]:
                raise UsageError(f"link {pair!r} joins a device to itself (a device needs no link to itself)")
            if not isinstance(link, Link):
                raise UsageError(f"link {pair!r} must be a Link(bandwidth, latency), got {brief(link)}")
            bw = self.bandwidth if link.bandwidth is None else link.bandwidth
            lat = self.latency if link.latency is None else link.latency
            try:
                out[pair] = Link(parse_bandwidth(bw), parse_seconds(lat))
            except UsageError as e:
                raise UsageError(f"link {pair!r}: {e}") from None
        return out

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

    def _route(self, src: str, dst: str) -> _Route:
        route = self._routes.get((src, dst))
        if route is not None:
            return route
        self.device(src), self.device(dst)  # KeyError naming an unknown device
        if src == dst:
            return _Route(Link(math.inf, 0.0), (src,), False)
        return _Route(Link(float(self.bandwidth), float(self.latency)), (src, dst), False)

    def link(self, src: str, dst: str) -> Link:
        """The resolved link a transfer from ``src`` to ``dst`` uses (bandwidth and latency set).

        Raises:
            KeyError: for an unknown device name.
        """
        return self._route(src, dst).link

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """The devices a transfer from ``src`` to ``dst`` passes, both ends included."""
        return self._route(src, dst).path

    def has_explicit_link(self, src: str, dst: str) -> bool:
        """Whether the pair's route comes from given links (direct or multi-hop), not the default."""
        return src != dst and self._route(src, dst).explicit

    def transfer_time(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` between host memory and an accelerator."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def link_time(self, nbytes: int, src: str, dst: str) -> float:
        """Seconds to move ``nbytes`` from device ``src`` to device ``dst`` (0 on one device).

        ``latency + nbytes / bandwidth`` of :meth:`link`: the pair's direct link, the default link
        (``topology="mesh"``) or the widest path (``topology="graph"``).
        """
        if src == dst or nbytes <= 0:
            return 0.0
        return self.link(src, dst).time(nbytes)

    # -- cluster files: torchplace.clusterfile ----------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict in the cluster file format (:func:`torchplace.clusterfile.cluster_to_json`)."""
        from torchplace.clusterfile import cluster_to_json

        return cluster_to_json(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "cluster") -> Cluster:
        """The cluster a cluster-file dict describes (:func:`torchplace.clusterfile.cluster_from_json`).

        Raises:
            WorkloadFormatError: naming ``source`` and the malformed field.
        """
        from torchplace.clusterfile import cluster_from_json

        return cluster_from_json(data, source)

    def save(self, path: str | Path) -> None:
        """Write the cluster file (:func:`torchplace.clusterfile.save_cluster`)."""
        from torchplace.clusterfile import save_cluster

        save_cluster(self, path)


def _check_device(d: Any) -> None:
    """Raise UsageError naming a cluster member that is not a well-formed :class:`Device`."""
    if not isinstance(d, Device):
        raise UsageError(f"a cluster's devices must be Device objects, got {brief(d)}")
    if not isinstance(d.name, str) or not d.name.strip():
        raise UsageError(f"a device name must be a non-empty string, got {brief(d.name)}")
    if not isinstance(d.kind, str) or not d.kind.strip():
        raise UsageError(f"device {d.name!r}: kind must be a non-empty string, got {brief(d.kind)}")
    try:
        parse_torch_device(d.torch_device)
    except UsageError as e:
        raise UsageError(f"device {d.name!r}: torch_device {e}") from None
    if d.memory_bytes is not None:
        byte_count(d.memory_bytes, f"device {d.name!r}: memory_bytes", unit="of bytes (None: unlimited)")
    if d.threads is not None and (isinstance(d.threads, bool) or not isinstance(d.threads, int) or d.threads < 1):
        raise UsageError(f"device {d.name!r}: threads must be a positive whole number (or None), got {brief(d.threads)}")


def _widest_routes(names: Sequence[str], direct: Mapping[tuple[str, str], Link]) -> dict[tuple[str, str], _Route]:
    """Widest path (max bottleneck bandwidth), ties to the least total latency, for every pair.

    MOIRAI Sec. III-C: a multi-hop path's bandwidth is its minimum hop bandwidth. Adding links in
    decreasing bandwidth order, a pair first becomes reachable when the links added so far have
    bandwidth >= its widest-path width ``W``; every path in that subgraph has bottleneck exactly
    ``W``, so the least-latency path there (Dijkstra) is the widest path with the least latency.
    """
    g = nx.DiGraph()
    g.add_nodes_from(names)
    routes: dict[tuple[str, str], _Route] = {}
    for width in sorted({link.bandwidth for link in direct.values() if link.bandwidth is not None}, reverse=True):
        g.add_edges_from((s, d, {"latency": link.latency}) for (s, d), link in direct.items() if link.bandwidth == width)
        for s in names:
            dist, paths = nx.single_source_dijkstra(g, s, weight="latency")
            for d, p in paths.items():
                if d != s and (s, d) not in routes:
                    routes[(s, d)] = _Route(Link(width, float(dist[d])), tuple(p), True)
    return routes


def discover_devices() -> list[Device]:
    """The devices of this machine: ``cpu`` (available RAM) and every visible ``cuda:i``."""
    devs = [Device("cpu", "cpu", "cpu", machine.cpu_memory())]
    for i in range(machine.cuda_count()):
        devs.append(Device(f"cuda:{i}", f"cuda:{i}", "cuda", machine.cuda_memory(i)))
    return devs


_LOGICAL_CPU = re.compile(r"cpu:(\d+)")


def check_attached(cluster: Cluster) -> None:
    """Refuse a cluster that cannot run here: every device's ``torch_device`` must be attached.

    For a :class:`Cluster` built directly or loaded from a cluster file (which may describe
    hardware elsewhere, for planning) before running on it; :func:`make_cluster` checks this itself.

    Raises:
        UsageError: naming the first device whose ``torch_device`` is ``meta`` or not on this
            machine (e.g. ``"cuda:7"`` with two GPUs), or whose ``threads`` are more than the
            cores this process may run on.
    """
    n_cuda = machine.cuda_count()
    for d in cluster.devices:
        machine.require_attached(d.name, d.torch_device, n_cuda)
        _check_threads_here(d)


def _check_threads_here(d: Device) -> None:
    """Refuse a device that would compute here with more intra-op threads than this process has cores."""
    cores = machine.cpu_cores()
    if d.threads is not None and d.threads > cores:
        raise UsageError(
            f"device {d.name!r}: threads={d.threads}, but this process may run on {cores} core(s); more threads "
            f"than cores only slow every kernel down: give it at most {cores} (share_cores=True splits the cores "
            f"among the CPU devices named by strings)"
        )


def _device_from_spec(spec: Any, n_cuda: int, cpu_memory: int) -> Device:
    """The :class:`Device` a device string (or a Device, checked to be attached) stands for."""
    if isinstance(spec, Device):
        _check_device(spec)
        machine.require_attached(spec.name, spec.torch_device, n_cuda)
        _check_threads_here(spec)
        return spec
    if not isinstance(spec, str):
        raise UsageError(f"a device must be a string like 'cuda:0' or a Device, got {brief(spec)}")
    name = spec.strip()
    if name == "cpu" or _LOGICAL_CPU.fullmatch(name):
        return Device(name, "cpu", "cpu", cpu_memory)
    m = re.fullmatch(r"cuda:(0|[1-9][0-9]*)", name)
    if m and int(m.group(1)) < n_cuda:
        return Device(name, name, "cuda", machine.cuda_memory(int(m.group(1))))
    try:
        parse_torch_device(name)
    except UsageError:
        why = "not a torch device string"
    else:
        why = "not a device of this machine"
    raise UsageError(f"unknown device {brief(name)} ({why}); valid devices on this machine: {machine.names(n_cuda)}")


def make_cluster(
    devices: Sequence[str | Device],
    max_memory: Mapping[str, int | str] | None = None,
    bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    latency: float = DEFAULT_LINK_LATENCY,
    share_cores: bool = False,
) -> Cluster:
    """Build a :class:`Cluster` of this machine's devices from device strings (or :class:`Device` s).

    This is the cluster :func:`torchplace.place` runs on, so every device must exist here: a
    string must be ``"cpu"``, a logical CPU ``"cpu:i"`` or a visible ``"cuda:i"``, and a
    :class:`Device` must have a ``torch_device`` that is attached (``"cpu"``, a visible
    ``"cuda:i"``, or a device of another torch backend that reports it; never ``"meta"``). To
    plan for hardware that is not attached, build a :class:`Cluster` directly or load a cluster
    file (:func:`torchplace.clusterfile.load_cluster`), which check only the syntax.

    Args:
        devices: e.g. ``["cuda:0", "cpu"]`` or ``["cpu:0", "cpu:1"]``.
        max_memory: per-device caps in bytes or strings (``{"cuda:0": "20GiB"}``), like
            accelerate's ``max_memory``. Devices not named keep their discovered capacity.
        bandwidth, latency: the default link (bytes/s, s).
        share_cores: give the CPU devices named by strings an equal share of this process's cores
            as their ``threads`` (intra-op threads per worker). Pipelines over logical CPUs then
            stop competing for every core; CPU kernels round by thread count, so outputs equal
            the model run with that many threads rather than bit for bit the model run with all.

    Raises:
        UsageError: (a ``ValueError``) for a single string instead of a list, an unknown device
            string or one that is not on this machine (the message lists the valid ones), a
            Device whose torch_device is malformed or not attached or whose threads are more than
            this process's cores, a repeated device, a
            ``max_memory`` that is not a mapping or names a device not in ``devices``, or a bad
            memory amount, bandwidth or latency (the message names it).
    """
    if isinstance(devices, (str, Device)) or not isinstance(devices, Sequence):
        raise UsageError(f"devices must be a list of device strings like ['cuda:0', 'cpu'], got {brief(devices)}")
    if max_memory is not None and not isinstance(max_memory, Mapping):
        raise UsageError(f"max_memory must be a dict like {{'cuda:0': '20GiB'}}, got {brief(max_memory)}")
    n_cuda = machine.cuda_count()
    cpu_memory = machine.cpu_memory()
    out = cap_memory([_device_from_spec(spec, n_cuda, cpu_memory) for spec in devices], max_memory)
    if share_cores:
        out = _share_cores(out, [isinstance(spec, str) for spec in devices])
    return Cluster(tuple(out), bandwidth=bandwidth, latency=latency)


def cap_memory(devices: Sequence[Device], max_memory: Mapping[Any, int | str] | None) -> list[Device]:
    """``devices`` with the caps of ``max_memory`` (``{"cuda:0": "20GiB"}``, by device name) as
    their ``memory_bytes``; devices not named keep theirs.

    Raises:
        UsageError: for a ``max_memory`` that is not a mapping, names a device not in ``devices``
            (an accelerate-style GPU index such as ``0`` is told to write ``"cuda:0"``), or has a
            bad amount.
    """
    if max_memory is None:
        return list(devices)
    if not isinstance(max_memory, Mapping):
        raise UsageError(f"max_memory must be a dict like {{'cuda:0': '20GiB'}}, got {brief(max_memory)}")
    names = {d.name for d in devices}
    for key in max_memory:
        if key not in names:
            hint = (f" (accelerate's GPU index {key} is the device named 'cuda:{key}' here)"
                    if isinstance(key, int) and not isinstance(key, bool) else "")
            raise UsageError(f"max_memory names {brief(key)}, which is not one of the devices {sorted(names)}{hint}: "
                             f"key max_memory by the device names")
    out = list(devices)
    for i, d in enumerate(out):
        if d.name in max_memory:
            try:
                out[i] = replace(d, memory_bytes=parse_memory(max_memory[d.name]))
            except UsageError as e:
                raise UsageError(f"max_memory[{d.name!r}]: {e}") from None
    return out


def kind_threads(cluster: Cluster) -> dict[str, int]:
    """Intra-op threads to profile each device kind with: the fewest any of its devices has
    (devices without ``threads`` are left out; kinds with none are absent)."""
    out: dict[str, int] = {}
    for d in cluster.devices:
        if d.threads is not None:
            out[d.kind] = min(out.get(d.kind, d.threads), d.threads)
    return out


def _share_cores(devices: Sequence[Device], named: Sequence[bool]) -> list[Device]:
    """Give each CPU device named by a string an equal share of this process's cores as its
    ``threads`` (at least one); a :class:`Device` the caller built keeps its own ``threads``."""
    cpus = [i for i, d in enumerate(devices) if d.kind == "cpu" and named[i]]
    if not cpus:
        return list(devices)
    share = max(1, machine.cpu_cores() // len(cpus))
    return [replace(d, threads=share) if i in cpus else d for i, d in enumerate(devices)]
