"""Readers for published workload files.

``read_dnn_partitioning`` reads the JSON of msr-fiddle/dnn-partitioning (Tarnawski et al. 2020):

    {"maxSizePerFPGA": bytes, "maxFPGAs": k, "maxCPUs": l,
     "nodes": [{"id", "supportedOnFpga", "cpuLatency", "fpgaLatency", "isBackwardNode",
                "colorClass" (optional), "size" (optional), "name" (optional), ...}],
     "edges": [{"sourceId", "destId", "cost", "size" (optional)}]}

into a :class:`~torchplace.problem.Problem` with ``k`` accelerators of kind ``"accel"`` (names
``acc0`` ...) holding ``maxSizePerFPGA`` bytes each and ``l`` CPUs (``cpu0`` ...) without a memory
limit. A node's ``size`` is its memory on a device; an edge's ``cost`` is the transfer time of its
source's output, which must be the same on all edges out of one node (the paper's Sec. 3 model).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchplace.checks import brief, byte_count, non_negative_float, non_negative_int, seconds
from torchplace.devices import Cluster, Device
from torchplace.errors import UsageError, WorkloadFormatError
from torchplace.files import json_kind, read_json
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem

__all__ = ["MAX_DEVICES", "read_dnn_partitioning", "read_expert_split"]

MAX_DEVICES = 4096
"""The most devices (``maxFPGAs + maxCPUs``) a workload file may ask for: more is a typo, not a cluster."""


def _field(obj: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    if key in obj:
        return obj[key]
    if default is not None:
        return default
    raise WorkloadFormatError(f"{where}: missing field {key!r}")


def _number(obj: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    """A finite non-negative number of seconds, at most MOST_SECONDS (times, costs)."""
    return seconds(_field(obj, key, where, default), f"{where}.{key}", unit="", error=WorkloadFormatError)


def _count(obj: Mapping[str, Any], key: str, where: str, default: int | None = None, unit: str = "") -> int:
    """A non-negative whole number (device counts, bytes): ``2.7`` is an error, never truncated."""
    check = byte_count if unit == "of bytes" else non_negative_int
    return check(_field(obj, key, where, default), f"{where}.{key}", unit=unit, error=WorkloadFormatError)


def _flag(obj: Mapping[str, Any], key: str, where: str) -> bool:
    v = _field(obj, key, where)
    if isinstance(v, bool) or (type(v) in (int, float) and v in (0, 1)):  # 0/1 or true/false
        return bool(v)
    raise WorkloadFormatError(f"{where}.{key}: expected 0/1 or true/false, got {brief(v)}")


def _node_record(nd: Mapping[str, Any], where: str) -> tuple[str, NodeRecord]:
    if "id" not in nd or isinstance(nd["id"], bool) or not isinstance(nd["id"], (int, str)):
        raise WorkloadFormatError(f"{where}.id: expected an integer or string id, got {brief(nd.get('id'))}")
    times = {"cpu": _number(nd, "cpuLatency", where)}
    accel = _number(nd, "fpgaLatency", where)  # checked even where unused: a bad field is a bad file
    if _flag(nd, "supportedOnFpga", where):
        times["accel"] = accel
    color = nd.get("colorClass")
    node_id = str(nd["id"])
    return node_id, NodeRecord(
        name=str(nd.get("name", node_id)),
        op="workload",
        param_bytes=_count(nd, "size", where, default=0, unit="of bytes"),
        times=times,
        colocation=None if color is None else str(color),
        backward=_flag(nd, "isBackwardNode", where),
    )


def _edge_costs(edges: list[Any], ids: set[str], path: str) -> tuple[list[tuple[str, str]], dict[str, float]]:
    pairs: list[tuple[str, str]] = []
    cost: dict[str, float] = {}
    for i, e in enumerate(edges):
        where = f"{path}: edges[{i}]"
        if not isinstance(e, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object, got {brief(e)}")
        ends = []
        for key in ("sourceId", "destId"):
            n = e.get(key)
            if isinstance(n, bool) or not isinstance(n, (int, str)) or str(n) not in ids:
                raise WorkloadFormatError(f"{where}.{key}: {brief(n)} is not the id of any node")
            ends.append(str(n))
        u, v = ends
        c = _number(e, "cost", where)
        if "size" in e:
            non_negative_float(e["size"], f"{where}.size", error=WorkloadFormatError)  # unused, but a bad field is a bad file
        if u in cost and abs(cost[u] - c) > 1e-6 * max(1.0, abs(c)):
            raise WorkloadFormatError(
                f"{where}.cost: node {u} has out-edges with different costs ({cost[u]} and {c}); "
                "the model charges one transfer per produced tensor, so all edges out of a node need one cost"
            )
        if u == v:
            raise WorkloadFormatError(f"{where}: edge {u} -> {v} is a self-loop")
        cost.setdefault(u, c)
        pairs.append((u, v))
    return pairs, cost


def _cluster(data: Mapping[str, Any], path: str, accelerators: int | None = None, cpus: int | None = None) -> Cluster:
    """``maxFPGAs`` accelerators of ``maxSizePerFPGA`` bytes and ``maxCPUs`` CPUs (or the counts given)."""
    where = f"{path}: top level"
    k, l_ = _count(data, "maxFPGAs", where), _count(data, "maxCPUs", where)
    mem = _count(data, "maxSizePerFPGA", where, unit="of bytes")
    for name, given in (("accelerators", accelerators), ("cpus", cpus)):
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
            raise UsageError(f"{name} must be a whole number >= 0, got {given!r}")
    k = k if accelerators is None else accelerators
    l_ = l_ if cpus is None else cpus
    if not 1 <= k + l_ <= MAX_DEVICES:
        if accelerators is not None or cpus is not None:
            raise UsageError(f"{k} accelerators + {l_} CPUs: a workload needs between 1 and {MAX_DEVICES} devices; "
                             "change --accelerators / --cpus")
        raise WorkloadFormatError(
            f"{path}: maxFPGAs + maxCPUs is {k + l_}; a workload needs between 1 and {MAX_DEVICES} devices"
        )
    devices = [Device(f"acc{i}", "meta", "accel", mem) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(l_)]
    return Cluster(tuple(devices))


def read_dnn_partitioning(path: str | Path, *, accelerators: int | None = None, cpus: int | None = None) -> Problem:
    """Read a dnn-partitioning workload JSON into a Problem (throughput objective, contiguous).

    Numbers must be finite and non-negative; ``maxFPGAs``, ``maxCPUs``, ``maxSizePerFPGA`` and a
    node's ``size`` must be whole numbers (``2.0`` is 2; ``2.7`` is an error).

    Args:
        path: the workload file.
        accelerators, cpus: override the file's ``maxFPGAs`` (k) and ``maxCPUs`` (l), e.g. to
            solve one workload at k = 2, 4, 8, 16 (Tarnawski Table 1 uses the file's counts).

    Raises:
        UsageError: for a negative count, or counts giving no device or more than the maximum.
        WorkloadFormatError: naming the file and the offending field for a malformed file (also
            for a file that cannot be read, is not UTF-8 or not JSON).
    """
    data = read_json(path, "workload")
    if not isinstance(data, Mapping):
        raise WorkloadFormatError(f"{path}: expected a JSON object at the top level, got {brief(data)}")
    kind = json_kind(data)
    if kind is not None and kind != "a dnn-partitioning workload":
        raise WorkloadFormatError(f"{path} is {kind}, not a dnn-partitioning workload: give the workload file (a JSON "
                                  "with 'nodes' and 'edges', a MOIRAI CSV, or a Piper JSON)")
    for key in ("nodes", "edges"):
        if not isinstance(data.get(key), list):
            raise WorkloadFormatError(f"{path}: field {key!r} must be a list")
    cluster = _cluster(data, str(path), accelerators, cpus)
    if not data["nodes"]:
        raise WorkloadFormatError(f"{path}: field 'nodes' is empty; a workload needs at least one node")
    g = OpGraph(meta={"source": str(path), "format": "dnn-partitioning"})
    for i, nd in enumerate(data["nodes"]):
        if not isinstance(nd, Mapping):
            raise WorkloadFormatError(f"{path}: nodes[{i}]: expected an object, got {brief(nd)}")
        node_id, rec = _node_record(nd, f"{path}: nodes[{i}]")
        if node_id in g:
            raise WorkloadFormatError(f"{path}: nodes[{i}].id: duplicate id {brief(nd['id'])}")
        g.add_node(node_id, rec)
    pairs, cost = _edge_costs(data["edges"], set(g), str(path))
    for v, r in list(g.records()):
        g.replace_record(v, replace(r, transfer_time=cost.get(v, 0.0)))
    for u, v in pairs:
        g.add_edge(u, v)
    try:
        g.check_dag()
        g.check_numbers()
    except ValueError as e:
        raise WorkloadFormatError(f"{path}: {e}") from None
    training = any(r.backward for _, r in g.records())
    return Problem(g, cluster, objective="throughput", mode="training" if training else "inference")


def _expert_nodes(machine: Any, where: str, problem: Problem) -> list[str]:
    if not isinstance(machine, Mapping) or not isinstance(machine.get("nodes"), list):
        raise WorkloadFormatError(f"{where}: expected an object with a list 'nodes', got {brief(machine)}")
    out = []
    for j, n in enumerate(machine["nodes"]):
        if isinstance(n, bool) or not isinstance(n, (int, str)) or str(n) not in problem.graph:
            raise WorkloadFormatError(f"{where}.nodes[{j}]: {brief(n)} is not the id of a node of the workload")
        out.append(str(n))
    return out


def read_expert_split(path: str | Path, problem: Problem) -> dict[str, str]:
    """Read a human-expert split (``{"cpus": [{"nodes": [...]}], "fpgas": [...]}``) as node -> device.

    Nodes the file leaves out (backward nodes of training graphs) follow their colocation group.

    Raises:
        WorkloadFormatError: naming the file and the field for an unreadable or malformed file, a
            node id the workload does not have, a node given twice, or more machines than the
            workload's ``maxFPGAs`` / ``maxCPUs``.
    """
    data = read_json(path, "expert split")
    if not isinstance(data, Mapping):
        raise WorkloadFormatError(f"{path}: expected a JSON object with 'fpgas' and 'cpus', got {brief(data)}")
    names = set(problem.cluster.names)
    assignment: dict[str, str] = {}
    for key, prefix in (("fpgas", "acc"), ("cpus", "cpu")):
        machines = data.get(key, [])
        if not isinstance(machines, list):
            raise WorkloadFormatError(f"{path}: {key}: expected a list of machines, got {brief(machines)}")
        for i, machine in enumerate(machines):
            where = f"{path}: {key}[{i}]"
            nodes = _expert_nodes(machine, where, problem)
            if nodes and f"{prefix}{i}" not in names:
                raise WorkloadFormatError(f"{where}: the workload has no device {prefix}{i} (devices: {sorted(names)})")
            for n in nodes:
                if n in assignment:
                    raise WorkloadFormatError(f"{where}: node {n} is also on {assignment[n]}")
                assignment[n] = f"{prefix}{i}"
    group_device = {
        problem.graph.record(v).colocation: d for v, d in assignment.items() if problem.graph.record(v).colocation
    }
    for v, r in problem.graph.records():
        if v not in assignment and r.colocation in group_device:
            assignment[v] = group_device[r.colocation]
    return assignment
