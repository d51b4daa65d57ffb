"""Reader for the Piper workload JSON (msr-fiddle/piper; Tarnawski, Narayanan, Phanishayee 2021).

    {"maxDevices": K, "maxMemoryPerDevice": bytes, "bandwidth": bytes/s, "mbsInBatch": N,
     "nodes": [{"id", "name" (optional),
                "TMPCs": {"t": [{"id", "timePerSample", "parameterSize", "memoryUsageA",
                                 "memoryUsageB", "syncTimeFw": {pred: bytes},
                                 "syncTimeBw": {succ: bytes}}]}}],
     "edges": [{"sourceId", "destId", "communicationCost" (bytes)}]}

``syncTimeFw`` is keyed by the tails of the node's incoming edges and ``syncTimeBw`` by the heads
of its outgoing edges (as the authors' code reads them; their README says it the other way
round). Every key must be an edge and every edge must have its key. A TMPC whose id mentions
``recomp`` is taken to recompute activations.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchplace.checks import MOST_SECONDS, brief, byte_count, check_float, seconds
from torchplace.devices import Cluster, Device
from torchplace.errors import WorkloadFormatError
from torchplace.files import read_json
from torchplace.graph import TMPC, NodeRecord, OpGraph
from torchplace.problem import Parallel, Problem

__all__ = ["MAX_DEVICES", "read_piper", "piper_problem"]

MAX_DEVICES = 1 << 16
"""The most devices a Piper workload may ask for (the paper goes to 2048)."""

_TOP = ("maxDevices", "maxMemoryPerDevice", "bandwidth", "mbsInBatch", "nodes", "edges")
_TMPC_FIELDS = ("id", "timePerSample", "parameterSize", "memoryUsageA", "memoryUsageB", "syncTimeFw", "syncTimeBw")


def _get(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise WorkloadFormatError(f"{where}: missing field {key!r}")
    return obj[key]


def _bytes(value: Any, name: str) -> float:
    """A number of bytes ``>= 0`` (Piper's may be fractional: per sample) below 2**53."""
    return byte_count(value, name, whole=False, error=WorkloadFormatError)


def _nonneg_bytes(obj: Mapping[str, Any], key: str, where: str) -> float:
    return _bytes(_get(obj, key, where), f"{where}.{key}")


def _positive(obj: Mapping[str, Any], key: str, where: str) -> float:
    return check_float(_get(obj, key, where), f"{where}.{key}", low=0, strict=True, error=WorkloadFormatError)


def _whole(obj: Mapping[str, Any], key: str, where: str, high: int) -> int:
    v = _get(obj, key, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or not 1 <= v <= high:
        raise WorkloadFormatError(f"{where}.{key}: expected a whole number between 1 and {high}, got {brief(v)}")
    return int(v)


def _node_id(value: Any, where: str, ids: set[str] | None = None) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise WorkloadFormatError(f"{where}: expected an integer or string node id, got {brief(value)}")
    if ids is not None and str(value) not in ids:
        raise WorkloadFormatError(f"{where}: {brief(value)} is not the id of any node")
    return str(value)


def _syncs(x: Mapping[str, Any], key: str, where: str, expected: set[str], side: str) -> dict[str, float]:
    raw = _get(x, key, where)
    if not isinstance(raw, Mapping):
        raise WorkloadFormatError(f"{where}.{key}: expected an object of bytes by node id, got {brief(raw)}")
    out = {str(k): _bytes(v, f"{where}.{key}[{k!r}]") for k, v in raw.items()}
    extra, missing = sorted(set(out) - expected), sorted(expected - set(out))
    if extra:
        raise WorkloadFormatError(f"{where}.{key}: {extra[0]!r} is not an {side} neighbour of the node (no such edge)")
    if missing:
        raise WorkloadFormatError(f"{where}.{key}: missing the {side} edge with node {missing[0]!r}")
    return out


def _tmpc(x: Any, where: str, preds: set[str], succs: set[str]) -> TMPC:
    if not isinstance(x, Mapping):
        raise WorkloadFormatError(f"{where}: expected a TMPC object, got {brief(x)}")
    tid = _get(x, "id", where)
    if not isinstance(tid, str) or not tid:
        raise WorkloadFormatError(f"{where}.id: expected a non-empty string, got {brief(tid)}")
    return TMPC(
        id=tid,
        time=seconds(_get(x, "timePerSample", where), f"{where}.timePerSample", error=WorkloadFormatError),
        param_bytes=_nonneg_bytes(x, "parameterSize", where),
        mem_a=_nonneg_bytes(x, "memoryUsageA", where),
        mem_b=_nonneg_bytes(x, "memoryUsageB", where),
        sync_in=_syncs(x, "syncTimeFw", where, preds, "incoming"),
        sync_out=_syncs(x, "syncTimeBw", where, succs, "outgoing"),
        recompute="recomp" in tid.lower(),
    )


def _tmpcs(nd: Mapping[str, Any], where: str, preds: set[str], succs: set[str]) -> dict[int, tuple[TMPC, ...]]:
    raw = _get(nd, "TMPCs", where)
    if not isinstance(raw, Mapping):
        raise WorkloadFormatError(f"{where}.TMPCs: expected an object of TMPC lists by degree t, got {brief(raw)}")
    out: dict[int, tuple[TMPC, ...]] = {}
    for t, xs in raw.items():
        at = f"{where}.TMPCs[{t!r}]"
        if not str(t).isdigit() or not 1 <= int(t) <= MAX_DEVICES:
            raise WorkloadFormatError(f"{at}: the key must be a tensor-parallel degree (a positive whole number)")
        if not isinstance(xs, list):
            raise WorkloadFormatError(f"{at}: expected a list of TMPCs, got {brief(xs)}")
        parsed = tuple(_tmpc(x, f"{at}[{i}]", preds, succs) for i, x in enumerate(xs))
        ids = [x.id for x in parsed]
        if len(set(ids)) != len(ids):
            raise WorkloadFormatError(f"{at}: TMPC ids repeat ({ids}); they must be distinct for one node and t")
        if parsed:
            out[int(t)] = parsed
    if 1 not in out:
        raise WorkloadFormatError(f"{where}.TMPCs: no TMPC for t=1; every node needs a way to run on one device")
    return out


def _edges(data: Mapping[str, Any], ids: set[str], path: str) -> list[tuple[str, str, float]]:
    edges: list[tuple[str, str, float]] = []
    seen: set[tuple[str, str]] = set()
    for i, e in enumerate(data["edges"]):
        where = f"{path}: edges[{i}]"
        if not isinstance(e, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object, got {brief(e)}")
        u = _node_id(_get(e, "sourceId", where), f"{where}.sourceId", ids)
        v = _node_id(_get(e, "destId", where), f"{where}.destId", ids)
        if u == v:
            raise WorkloadFormatError(f"{where}: edge {u} -> {v} is a self-loop")
        if (u, v) in seen:
            raise WorkloadFormatError(f"{where}: edge {u} -> {v} is listed twice")
        seen.add((u, v))
        edges.append((u, v, _nonneg_bytes(e, "communicationCost", where)))
    return edges


def piper_problem(graph: OpGraph, parallel: Parallel) -> Problem:
    """The throughput Problem of ``graph`` (nodes with TMPCs, edges with bytes) under ``parallel``;
    its cluster describes one of the ``parallel.devices`` identical devices."""
    device = Device("accel", "meta", "accel", int(parallel.memory_bytes))
    return Problem(graph, Cluster((device,), bandwidth=parallel.bandwidth), parallel=parallel)


def read_piper(path: str | Path, *, devices: int | None = None, memory_bytes: float | None = None,
               microbatches: int | None = None, bandwidth: float | None = None) -> Problem:
    """Read a Piper workload into a Problem with a :class:`~torchplace.problem.Parallel` setting.

    The keyword arguments override the file's ``maxDevices``, ``maxMemoryPerDevice``,
    ``mbsInBatch`` and ``bandwidth`` (the paper sweeps them over one profile).

    Raises:
        WorkloadFormatError: naming the file and the offending field (missing, not a number,
            negative, an edge or sync key naming no node, a sync key with no edge, repeated ids,
            a cycle), also for a file that cannot be read or is not JSON.
    """
    data = read_json(path, "workload")
    if not isinstance(data, Mapping):
        raise WorkloadFormatError(f"{path}: expected a JSON object at the top level, got {brief(data)}")
    top = f"{path}: top level"
    for key in _TOP:
        _get(data, key, top)
    for key in ("nodes", "edges"):
        if not isinstance(data[key], list) or not data[key]:
            raise WorkloadFormatError(f"{path}: field {key!r} must be a non-empty list")
    parallel = Parallel(
        devices=devices if devices is not None else _whole(data, "maxDevices", top, MAX_DEVICES),
        memory_bytes=memory_bytes if memory_bytes is not None else _positive(data, "maxMemoryPerDevice", top),
        bandwidth=bandwidth if bandwidth is not None else _positive(data, "bandwidth", top),
        microbatches=microbatches if microbatches is not None else _whole(data, "mbsInBatch", top, 1 << 30),
    )
    ids: list[str] = []
    for i, nd in enumerate(data["nodes"]):
        where = f"{path}: nodes[{i}]"
        if not isinstance(nd, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object, got {brief(nd)}")
        node = _node_id(_get(nd, "id", where), f"{where}.id")
        if node in ids:
            raise WorkloadFormatError(f"{where}.id: duplicate node id {node!r}")
        ids.append(node)
    edges = _edges(data, set(ids), str(path))
    preds: dict[str, set[str]] = {v: set() for v in ids}
    succs: dict[str, set[str]] = {v: set() for v in ids}
    for u, v, _ in edges:
        preds[v].add(u)
        succs[u].add(v)
    g = OpGraph(meta={"source": str(path), "format": "piper"})
    for i, nd in enumerate(data["nodes"]):
        v, where = ids[i], f"{path}: nodes[{i}] (id {ids[i]})"
        name = nd.get("name", v)
        g.add_node(v, NodeRecord(name=str(name), op=str(name), tmpcs=_tmpcs(nd, where, preds[v], succs[v])))
    for u, v, c in edges:
        g.add_edge(u, v, c)
    try:
        g.check_dag()
    except ValueError as e:
        raise WorkloadFormatError(f"{path}: {e}") from None
    most = max([c for _, _, c in edges] + [b for v in ids for ts in g.record(v).tmpcs.values() for t in ts
                                           for b in (t.param_bytes, *t.sync_in.values(), *t.sync_out.values())])
    if most / parallel.bandwidth > MOST_SECONDS:  # inf times: the DP's sums and differences turn NaN
        raise WorkloadFormatError(f"{path}: a bandwidth of {parallel.bandwidth:g} bytes/s moves {most:g} bytes (the "
                                  f"most an edge, sync or gradient moves) in more than {MOST_SECONDS:g} s, so long that "
                                  "sums of times overflow; give a larger bandwidth")
    return piper_problem(g, parallel)
