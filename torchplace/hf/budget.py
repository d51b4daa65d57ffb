"""accelerate's ``max_memory`` as a torchplace :class:`Cluster`.

accelerate names devices ``0, 1, ...`` (GPU ids), ``"cpu"`` and ``"disk"``; torchplace names them
``"cuda:0"``, ``"cuda:1"``, ``"cpu"`` and ``"disk"`` and converts back in the map it returns. Under
:func:`accelerate.dispatch_model` a module mapped to ``"cpu"`` (when a GPU is in the map) or to
``"disk"`` does not compute there: its weights are streamed to the *main device*
(:func:`main_device`: the lowest GPU id, else the CPU) before each call. Those devices therefore
get kinds ``"cpu-offload"`` / ``"disk-offload"`` whose time per block is the main device's time
plus the block's weight bytes over the host link (the cluster's ``bandwidth``) or the disk
(``disk_bandwidth``), and whose activations move as the main device's do (:func:`hf_cluster`'s
links): one cost model, with the times the runtime really pays put on the graph
(:func:`offload_times`).
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torchplace import machine
from torchplace.checks import brief
from torchplace.devices import DEFAULT_LINK_BANDWIDTH, Cluster, Device, Link
from torchplace.errors import UsageError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.units import parse_memory

__all__ = ["DISK_BANDWIDTH", "OFFLOAD_KINDS", "accelerate_name", "hf_cluster", "main_device", "offload_times"]

OFFLOAD_KINDS = ("cpu-offload", "disk-offload")
"""Kinds of devices that only store weights: their blocks compute on the main device."""

DISK_BANDWIDTH = 2e9
"""Bytes/s read from an offload folder (an NVMe SSD); ``disk_bandwidth=`` overrides it."""

_GPU = re.compile(r"(?:cuda:)?(0|[1-9][0-9]*)")


def _key(key: Any) -> str:
    """torchplace's name of an accelerate ``max_memory`` key: ``0`` / ``"0"`` / ``"cuda:0"`` -> ``"cuda:0"``."""
    if isinstance(key, bool):
        raise UsageError(f"max_memory keys are GPU ids, 'cpu' or 'disk', got {key!r}")
    if isinstance(key, int) and key >= 0:
        return f"cuda:{key}"
    if isinstance(key, str):
        if key in ("cpu", "disk"):
            return key
        m = _GPU.fullmatch(key.strip())
        if m:
            return f"cuda:{m.group(1)}"
    raise UsageError(f"max_memory keys are GPU ids (0, 1, ... or 'cuda:0'), 'cpu' or 'disk', got {brief(key)}")


def accelerate_name(device: str) -> int | str:
    """accelerate's name of a torchplace device: ``"cuda:1"`` -> ``1``; ``"cpu"``, ``"disk"`` as they are."""
    return int(device.split(":")[1]) if device.startswith("cuda:") else device


def _budgets(max_memory: Mapping[Any, int | str] | None, cluster: Cluster | None = None) -> dict[str, int]:
    """torchplace device name -> bytes, GPUs in id order, then cpu, then disk."""
    if max_memory is None and cluster is not None:
        max_memory = {d.name: d.memory_bytes for d in cluster.devices
                      if d.memory_bytes is not None and (d.name in ("cpu", "disk") or _GPU.fullmatch(d.name))}
        if not max_memory:  # was "max_memory must be a non-empty dict ..., got {}", of a max_memory never given
            names = [d.name for d in cluster.devices]
            raise UsageError(f"no max_memory is given, and the cluster names no device 'cuda:0', 'cuda:1', ..., 'cpu' "
                             f"or 'disk' with a memory to take it from (its devices: {names}): give max_memory "
                             "(command line: --max-memory 0=10GiB cpu=30GiB), or give those devices their memory")
    if max_memory is None:
        caps = {f"cuda:{i}": machine.cuda_memory(i) for i in range(machine.cuda_count())}
        caps["cpu"] = machine.cpu_memory()
        return caps
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise UsageError(f"max_memory must be a non-empty dict like {{0: '10GiB', 'cpu': '30GiB'}}, "
                         f"got {brief(max_memory)}")
    caps = {}
    for key, value in max_memory.items():
        name = _key(key)
        if name in caps:
            raise UsageError(f"max_memory names device {name!r} twice")
        try:
            caps[name] = parse_memory(value)
        except UsageError as e:
            raise UsageError(f"max_memory[{key!r}]: {e}") from None
    gpus = sorted((n for n in caps if n.startswith("cuda:")), key=lambda n: int(n.split(":")[1]))
    return {n: caps[n] for n in [*gpus, *(k for k in ("cpu", "disk") if k in caps)]}


def _gpu_kinds(cluster: Cluster | None, gpus: list[str]) -> dict[str, str]:
    """The kind of each GPU: the cluster device of that name (or the i-th non-CPU one), else "cuda"."""
    if cluster is None:
        return dict.fromkeys(gpus, "cuda")
    accel = [d for d in cluster.devices if d.kind != "cpu"]
    out = {}
    for i, name in enumerate(gpus):
        named = [d for d in cluster.devices if d.name in (name, name.split(":")[1])]
        if named:
            out[name] = named[0].kind
        elif i < len(accel):
            out[name] = accel[i].kind
        else:
            raise UsageError(f"the cluster file describes {len(accel)} accelerator(s) but max_memory names "
                             f"{name!r}: describe every GPU of max_memory in the cluster file")
    return out


def hf_cluster(max_memory: Mapping[Any, int | str] | None, cluster: Cluster | None = None) -> Cluster:
    """The cluster accelerate's ``max_memory`` describes (module docstring), kinds from ``cluster``.

    Args:
        max_memory: ``{0: "10GiB", 1: "10GiB", "cpu": "30GiB", "disk": "1TiB"}``; ``None``: the
            memory of ``cluster``'s devices named ``cuda:i`` / ``cpu`` / ``disk``, else every
            visible GPU and the CPU with their memory (no disk).
        cluster: a cluster (e.g. from a cluster file) giving each GPU's kind (by name ``"cuda:i"``
            or ``"i"``, else the i-th non-CPU device), the default link and the links between
            devices of those names. Offload devices get the links their blocks' activations really
            take (:func:`_offload_links`), whatever the cluster says of ``"cpu"`` and ``"disk"``.

    Raises:
        UsageError: a bad key or amount (named), or GPUs the cluster does not describe.
    """
    caps = _budgets(max_memory, cluster)
    gpus = [n for n in caps if n.startswith("cuda:")]
    kinds = _gpu_kinds(cluster, gpus)
    devices = [Device(n, n, kinds[n], caps[n]) for n in gpus]
    if "cpu" in caps:
        devices.append(Device("cpu", "cpu", "cpu-offload" if gpus else "cpu", caps["cpu"]))
    if "disk" in caps:
        devices.append(Device("disk", "cpu", "disk-offload", caps["disk"]))
    if cluster is None:
        return _offload_links(Cluster(tuple(devices)))
    names = {d.name for d in devices}
    links = {pair: link for pair, link in cluster.links.items() if set(pair) <= names}
    pairs = {pair: bw for pair, bw in cluster.pair_bandwidth.items() if set(pair) <= names}
    return _offload_links(Cluster(tuple(devices), bandwidth=cluster.bandwidth, latency=cluster.latency,
                                  links=links, pair_bandwidth=pairs))


def main_device(cluster: Cluster) -> str | None:
    """The device that computes the blocks mapped to ``"cpu"`` / ``"disk"``: the cluster's first device
    that computes (:func:`hf_cluster` lists GPUs in id order, so the lowest GPU id of ``max_memory``;
    the CPU without a GPU); ``None`` when only ``"disk"`` is given (accelerate then computes on the CPU).

    accelerate 1.15's ``dispatch_model`` (and ``from_pretrained``, which calls it without
    ``main_device``) picks ``list(set(device_map.values()) - {"cpu", "disk"})[0]``. That set of ints
    is built afresh, and an int hashes to itself, so CPython iterates it in ascending order when
    every id has its own slot: ids below 8 when the map names at most four GPUs, below 32 when it
    names five to nine (checked over every hash seed tried). So accelerate picks the lowest GPU id
    the map names, and :func:`torchplace.hf.maps.to_device_map` names this device in every map that
    offloads. (Beyond that its pick follows CPython's set layout, not the lowest id: pass
    ``main_device=`` to ``dispatch_model`` there.)
    """
    return next((d.name for d in cluster.devices if d.kind not in OFFLOAD_KINDS), None)


def _offload_links(cluster: Cluster) -> Cluster:
    """``cluster`` with the links activations really take to and from offload devices.

    An offloaded block computes on the main device (:func:`main_device`, as in
    :func:`offload_times`), so its inputs and outputs never leave it: between the main device and
    an offload device, or two offload devices, nothing moves (an infinitely fast link); between
    an offload device and another GPU, they take that GPU's link with the main device. (Its
    weights' trip to the main device is in the block's time.)
    """
    main = main_device(cluster)
    offload = [d.name for d in cluster.devices if d.kind in OFFLOAD_KINDS]
    if not offload or main is None:
        return cluster
    free = Link(math.inf, 0.0)
    links = {pair: link for pair, link in cluster.links.items() if not set(pair) & set(offload)}
    pairs = {pair: bw for pair, bw in cluster.pair_bandwidth.items() if not set(pair) & set(offload)}
    for x in offload:
        for d in cluster.devices:
            if d.name == x:
                continue
            if d.name == main or d.name in offload:
                links[(x, d.name)] = links[(d.name, x)] = free
            else:
                links[(x, d.name)] = cluster.link(main, d.name)
                links[(d.name, x)] = cluster.link(d.name, main)
    return replace(cluster, links=links, pair_bandwidth=pairs)


def offload_times(graph: OpGraph, cluster: Cluster, disk_bandwidth: float = DISK_BANDWIDTH,
                  host_bandwidth: float | None = None) -> OpGraph:
    """``graph`` with times for the offload kinds of ``cluster``: the time on the kind of
    :func:`main_device` (the CPU's when it is ``None``) plus the block's weights over the host link
    (``"cpu-offload"``: ``host_bandwidth``, else the cluster's default link) or from disk
    (``"disk-offload"``). The blocks of ``graph.meta["hf"]["buffers_only"]`` get none when a
    main device computes: they are mapped to it whatever the plan says
    (:func:`torchplace.hf.maps.buffers_only`), so a plan may not put them on an offload device and
    count their bytes there."""
    kinds = {d.kind for d in cluster.devices}
    name = main_device(cluster)
    main = "cpu" if name is None else cluster.device(name).kind
    host = host_bandwidth or cluster.bandwidth or DEFAULT_LINK_BANDWIDTH
    pinned = set(graph.meta.get("hf", {}).get("buffers_only", ())) if name is not None else set()

    def offloaded(v: str, r: NodeRecord) -> NodeRecord:
        times = {k: t for k, t in r.times.items() if k not in OFFLOAD_KINDS}
        if v in pinned:
            return replace(r, times=times)
        if "cpu-offload" in kinds:
            times["cpu-offload"] = r.times[main] + r.param_bytes / host
        if "disk-offload" in kinds:
            times["disk-offload"] = r.times[main] + r.param_bytes / disk_bandwidth
        return replace(r, times=times)

    return graph.with_records(offloaded)
