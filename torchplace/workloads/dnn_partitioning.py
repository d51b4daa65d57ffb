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

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torchplace.devices import Cluster, Device
from torchplace.errors import WorkloadFormatError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem

__all__ = ["read_dnn_partitioning", "read_expert_split"]


def _number(obj: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is not None:
            return default
        raise WorkloadFormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
        raise WorkloadFormatError(f"{where}.{key}: expected a non-negative number, got {v!r}")
    return float(v)


def _flag(obj: Mapping[str, Any], key: str, where: str) -> bool:
    if key not in obj:
        raise WorkloadFormatError(f"{where}: missing field {key!r}")
    v = obj[key]
    if v in (0, 1) or isinstance(v, bool):  # 0/1 or true/false
        return bool(v)
    raise WorkloadFormatError(f"{where}.{key}: expected 0/1 or true/false, got {v!r}")


def _node_record(nd: Mapping[str, Any], where: str) -> tuple[str, NodeRecord]:
    if "id" not in nd or isinstance(nd["id"], bool) or not isinstance(nd["id"], (int, str)):
        raise WorkloadFormatError(f"{where}.id: expected an integer or string id, got {nd.get('id')!r}")
    times = {"cpu": _number(nd, "cpuLatency", where)}
    accel = _number(nd, "fpgaLatency", where)  # checked even where unused: a bad field is a bad file
    if _flag(nd, "supportedOnFpga", where):
        times["accel"] = accel
    color = nd.get("colorClass")
    node_id = str(nd["id"])
    return node_id, NodeRecord(
        name=str(nd.get("name", node_id)),
        op="workload",
        param_bytes=int(_number(nd, "size", where, default=0.0)),
        times=times,
        colocation=None if color is None else str(color),
        backward=_flag(nd, "isBackwardNode", where),
    )


def _edge_costs(edges: list[Any], ids: set[str]) -> tuple[list[tuple[str, str]], dict[str, float]]:
    pairs: list[tuple[str, str]] = []
    cost: dict[str, float] = {}
    for i, e in enumerate(edges):
        where = f"edges[{i}]"
        if not isinstance(e, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object, got {e!r}")
        u, v = (str(e.get(k)) for k in ("sourceId", "destId"))
        for key, n in (("sourceId", u), ("destId", v)):
            if n not in ids:
                raise WorkloadFormatError(f"{where}.{key}: {e.get(key)!r} is not the id of any node")
        c = _number(e, "cost", where)
        if u in cost and abs(cost[u] - c) > 1e-6 * max(1.0, abs(c)):
            raise WorkloadFormatError(
                f"{where}.cost: node {u} has out-edges with different costs ({cost[u]} and {c}); "
                "the model charges one transfer per produced tensor, so all edges out of a node need one cost"
            )
        cost.setdefault(u, c)
        pairs.append((u, v))
    return pairs, cost


def read_dnn_partitioning(path: str | Path) -> Problem:
    """Read a dnn-partitioning workload JSON into a Problem (throughput objective, contiguous).

    Raises:
        WorkloadFormatError: naming the offending field for a malformed file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise WorkloadFormatError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, Mapping):
        raise WorkloadFormatError(f"{path}: expected a JSON object at the top level")
    for key in ("nodes", "edges"):
        if not isinstance(data.get(key), list):
            raise WorkloadFormatError(f"{path}: field {key!r} must be a list")
    k = int(_number(data, "maxFPGAs", "top level"))
    l_ = int(_number(data, "maxCPUs", "top level"))
    mem = int(_number(data, "maxSizePerFPGA", "top level"))
    g = OpGraph(meta={"source": str(path), "format": "dnn-partitioning"})
    for i, nd in enumerate(data["nodes"]):
        if not isinstance(nd, Mapping):
            raise WorkloadFormatError(f"nodes[{i}]: expected an object, got {nd!r}")
        node_id, rec = _node_record(nd, f"nodes[{i}]")
        if node_id in g:
            raise WorkloadFormatError(f"nodes[{i}].id: duplicate id {nd['id']!r}")
        g.add_node(node_id, rec)
    pairs, cost = _edge_costs(data["edges"], set(g))
    for v, r in list(g.records()):
        g.replace_record(v, replace(r, transfer_time=cost.get(v, 0.0)))
    for u, v in pairs:
        if u == v:
            raise WorkloadFormatError(f"edge {u} -> {v} is a self-loop")
        g.add_edge(u, v)
    try:
        g.check_dag()
    except ValueError as e:
        raise WorkloadFormatError(f"{path}: {e}") from None
    devices = [Device(f"acc{i}", "meta", "accel", mem) for i in range(k)]
    devices += [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(l_)]
    training = any(r.backward for _, r in g.records())
    return Problem(g, Cluster(tuple(devices)), objective="throughput", mode="training" if training else "inference")


def read_expert_split(path: str | Path, problem: Problem) -> dict[str, str]:
    """Read a human-expert split (``{"cpus": [{"nodes": [...]}], "fpgas": [...]}``) as node -> device.

    Nodes the file leaves out (backward nodes of training graphs) follow their colocation group.
    """
    data = json.loads(Path(path).read_text())
    assignment: dict[str, str] = {}
    for key, prefix in (("fpgas", "acc"), ("cpus", "cpu")):
        for i, machine in enumerate(data.get(key, [])):
            for n in machine["nodes"]:
                assignment[str(n)] = f"{prefix}{i}"
    group_device = {
        problem.graph.record(v).colocation: d for v, d in assignment.items() if problem.graph.record(v).colocation
    }
    for v, r in problem.graph.records():
        if v not in assignment and r.colocation in group_device:
            assignment[v] = group_device[r.colocation]
    return assignment
