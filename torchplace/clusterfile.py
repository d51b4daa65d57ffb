"""Cluster files: a cluster's devices and links as JSON (or YAML), read and written.

The format (``"torchplace.cluster/1"``) is described in :func:`load_cluster`; the link model it
describes (directed links, ``"mesh"`` and ``"graph"`` topologies, MOIRAI Sec. III-A and III-C) in
:mod:`torchplace.devices`. ``Cluster.to_json`` / ``Cluster.from_json`` / ``Cluster.save`` delegate
here.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplace.checks import brief
from torchplace.devices import (
    DEFAULT_LINK_BANDWIDTH,
    DEFAULT_LINK_LATENCY,
    Cluster,
    Device,
    Link,
    parse_bandwidth,
    parse_memory,
    parse_seconds,
    parse_torch_device,
)
from torchplace.errors import WorkloadFormatError
from torchplace.files import json_kind, parse_json, read_text, write_json, write_text

__all__ = ["FORMAT", "cluster_from_json", "cluster_to_json", "load_cluster", "save_cluster"]

FORMAT = "torchplace.cluster/1"  # the "format" field of a cluster file
_TOP_KEYS = {"format", "description", "bandwidth", "latency", "topology", "devices", "links"}
_DEVICE_KEYS = {"name", "kind", "torch_device", "memory", "threads", "description"}
_LINK_KEYS = {"src", "dst", "bandwidth", "latency", "bidirectional", "description"}
_REQUIRED = object()  # a _value default: the field must be present and not null


def _fields(obj: Any, allowed: set[str], required: tuple[str, ...], where: str, source: str) -> dict[str, Any]:
    """``obj`` as a dict, checked for unknown and missing keys."""
    if not isinstance(obj, Mapping):
        raise WorkloadFormatError(f"{source}: {where}: expected an object, got {brief(obj)}")
    unknown = sorted(set(obj) - allowed, key=str)
    if unknown:
        raise WorkloadFormatError(f"{source}: {where}: unknown field {unknown[0]!r} (fields: {sorted(allowed)})")
    for key in required:
        if key not in obj:
            raise WorkloadFormatError(f"{source}: {where}: missing field {key!r}")
    return dict(obj)


def _value(parse: Any, obj: Mapping[str, Any], key: str, default: Any, where: str, source: str) -> Any:
    """``parse(obj[key])`` (``default`` when absent or null), a parse error naming the field and file."""
    if obj.get(key) is None and default is not _REQUIRED:
        return default
    try:
        return parse(obj[key])
    except (ValueError, TypeError) as e:
        raise WorkloadFormatError(f"{source}: {where}.{key}: {e}") from None


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a non-empty string, got {brief(value)}")
    return value


def _torch_device(value: Any) -> str:
    parse_torch_device(value)  # the syntax only: the file may describe hardware not attached here
    return str(value)


def _threads(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a positive whole number of threads, got {brief(value)}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {brief(value)}")
    return value


def _device_from_json(obj: Any, where: str, source: str) -> Device:
    d = _fields(obj, _DEVICE_KEYS, ("name", "kind"), where, source)
    return Device(
        name=_value(_text, d, "name", _REQUIRED, where, source),
        torch_device=_value(_torch_device, d, "torch_device", "meta", where, source),
        kind=_value(_text, d, "kind", _REQUIRED, where, source),
        memory_bytes=_value(parse_memory, d, "memory", None, where, source),
        threads=_value(_threads, d, "threads", None, where, source),
    )


def _links_from_json(items: Any, names: set[str], source: str) -> dict[tuple[str, str], Link]:
    if not isinstance(items, list):
        raise WorkloadFormatError(f"{source}: links: expected a list of links, got {brief(items)}")
    out: dict[tuple[str, str], Link] = {}
    given_at: dict[tuple[str, str], int] = {}
    for i, obj in enumerate(items):
        where = f"links[{i}]"
        e = _fields(obj, _LINK_KEYS, ("src", "dst"), where, source)
        for end in ("src", "dst"):
            if not isinstance(e[end], str) or e[end] not in names:
                raise WorkloadFormatError(
                    f"{source}: {where}.{end}: {brief(e[end])} is not a device; devices: {sorted(names)}"
                )
        if e["src"] == e["dst"]:
            raise WorkloadFormatError(f"{source}: {where}: src and dst are both {e['src']!r}")
        link = Link(_value(parse_bandwidth, e, "bandwidth", None, where, source),
                    _value(parse_seconds, e, "latency", None, where, source))
        pairs = [(e["src"], e["dst"])]
        if _value(_flag, e, "bidirectional", True, where, source):
            pairs.append((e["dst"], e["src"]))
        for pair in pairs:
            if pair in out:
                raise WorkloadFormatError(
                    f"{source}: {where}: link {pair[0]} -> {pair[1]} is already given by links[{given_at[pair]}] "
                    f"(for different up- and downlinks give two links with bidirectional: false)"
                )
            out[pair], given_at[pair] = link, i
    return out


def cluster_from_json(data: Any, source: str = "cluster") -> Cluster:
    """The cluster a cluster-file dict describes (the format of :func:`load_cluster`).

    Raises:
        WorkloadFormatError: naming ``source`` (the file) and the malformed field.
    """
    kind = json_kind(data)
    if kind is not None and kind != "a torchplace cluster file":
        raise WorkloadFormatError(f"{source} is {kind}, not a cluster file (format {FORMAT!r}): give the cluster file")
    top = _fields(data, _TOP_KEYS, ("devices",), "top level", source)
    if top.get("format", FORMAT) != FORMAT:
        raise WorkloadFormatError(f"{source}: format: {brief(top['format'])} is not {FORMAT!r}")
    if not isinstance(top["devices"], list) or not top["devices"]:
        raise WorkloadFormatError(
            f"{source}: devices: expected a non-empty list of devices, got {brief(top['devices'])}"
        )
    devices = tuple(_device_from_json(obj, f"devices[{i}]", source) for i, obj in enumerate(top["devices"]))
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise WorkloadFormatError(f"{source}: devices: the name {dup!r} is used twice; names must be unique")
    topology = top.get("topology", "mesh")
    if topology not in ("mesh", "graph"):
        raise WorkloadFormatError(f"{source}: topology: expected 'mesh' or 'graph', got {brief(topology)}")
    links = _links_from_json(top.get("links", []), set(names), source)
    bandwidth = _value(parse_bandwidth, top, "bandwidth", DEFAULT_LINK_BANDWIDTH, "top level", source)
    latency = _value(parse_seconds, top, "latency", DEFAULT_LINK_LATENCY, "top level", source)
    try:
        return Cluster(devices, bandwidth=bandwidth, latency=latency, links=links, topology=topology)
    except ValueError as e:
        raise WorkloadFormatError(f"{source}: links: {e}") from e


def cluster_to_json(cluster: Cluster) -> dict[str, Any]:
    """A JSON-able dict in the cluster file format (see :func:`load_cluster`).

    A link given in both directions with equal values is written once, with ``bidirectional: true``,
    from the side of the device listed first.
    """
    given = {**{p: Link(bw) for p, bw in cluster.pair_bandwidth.items()}, **cluster.links}
    order = {n: i for i, n in enumerate(cluster.names)}
    links: list[dict[str, Any]] = []
    for (s, d), link in sorted(given.items(), key=lambda kv: (order[kv[0][0]], order[kv[0][1]])):
        mirrored = given.get((d, s)) == link
        if mirrored and order[d] < order[s]:
            continue  # written once, with bidirectional: true, from the first device's side
        entry: dict[str, Any] = {"src": s, "dst": d}
        entry.update({k: v for k, v in (("bandwidth", link.bandwidth), ("latency", link.latency)) if v is not None})
        links.append({**entry, "bidirectional": mirrored})
    return {
        "format": FORMAT,
        "bandwidth": cluster.bandwidth,
        "latency": cluster.latency,
        "topology": cluster.topology,
        "devices": [
            {"name": d.name, "kind": d.kind, "torch_device": d.torch_device, "memory": d.memory_bytes,
             **({} if d.threads is None else {"threads": d.threads})}
            for d in cluster.devices
        ],
        "links": links,
    }


def save_cluster(cluster: Cluster, path: str | Path) -> None:
    """Write ``cluster`` to ``path``: JSON, or YAML for a ``.yaml``/``.yml`` path (needs PyYAML).

    Raises:
        WorkloadFormatError: for a YAML path without PyYAML installed.
    """
    path = Path(path)
    if path.suffix.lower() in (".yaml", ".yml"):
        write_text(path, _yaml(path).safe_dump(cluster_to_json(cluster), sort_keys=False))
    else:
        write_json(path, cluster_to_json(cluster))


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file: JSON, or YAML (``.yaml``/``.yml``) when PyYAML is installed.

    The file holds one object (``[]`` marks an optional field; any object may also carry a
    ``"description"`` string; any other unknown field is an error, to catch typos)::

        {"format": ["torchplace.cluster/1"],
         "bandwidth": [bytes/s or "25GB/s" ("Gb/s": bits); default 12e9], "latency": [s or "5us"; default 1e-5],
         "topology": ["mesh" (default) | "graph"],
         "devices": [{"name": str, "kind": str, "torch_device": [str; default "meta"],
                      "memory": [bytes or "16GiB"; null/absent = unlimited],
                      "threads": [intra-op threads of its worker; absent = the process's]}, ...],
         "links": [[{"src": name, "dst": name, "bandwidth": [..; default: top level],
                     "latency": [..; default: top level], "bidirectional": [bool; default true]}, ...]]}

    Links are directed; ``bidirectional: true`` also sets ``dst -> src`` to the same values, and
    a directed pair given twice is an error (give up- and downlink as two one-way links). The
    topologies are described in :mod:`torchplace.devices`.

    A cluster file may describe hardware that is not attached to this machine (it is for
    planning), so a ``torch_device`` is checked for its syntax only (``"cuda:7"`` is accepted on a
    machine without GPUs; ``"potato"`` is refused): :func:`torchplace.devices.make_cluster` is
    what refuses devices that are not here. Numbers must be finite (a bandwidth may be
    ``Infinity``: transfers that cost only latency); memory is a whole number of bytes.

    Example:
        >>> cluster = load_cluster("examples/clusters/edge-devices.json")  # doctest: +SKIP
        >>> cluster.path("camera-pi", "edge-server")  # doctest: +SKIP
        ('camera-pi', 'jetson-nano', 'jetson-orin', 'edge-server')

    Raises:
        WorkloadFormatError: naming the file and the field that is missing or malformed.
    """
    path = Path(path)
    text = read_text(path, "cluster")
    if path.suffix.lower() not in (".yaml", ".yml"):
        return cluster_from_json(parse_json(text, str(path)), str(path))
    yaml = _yaml(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WorkloadFormatError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise WorkloadFormatError(f"{path}: YAML nested too deeply to read") from None
    return cluster_from_json(data, str(path))


def _yaml(path: Path) -> Any:
    try:
        import yaml
    except ImportError:
        raise WorkloadFormatError(
            f"{path}: reading or writing YAML cluster files needs PyYAML (pip install pyyaml); "
            f"or use a .json file"
        ) from None
    return yaml
