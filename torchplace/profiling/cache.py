"""Profiles a plan carries: a job that restarts from a saved plan skips profiling.

``place()`` stores in each plan it makes (``plan.meta["profile"]``) the fingerprint of the traced
graph and the profiled :class:`~torchplace.graph.OpGraph` (times per device kind, bytes, tensor
names). ``place(model, devices, x, plan="plan.json")`` traces the model again (cheap next to
timing every operator), compares fingerprints, and reuses the saved costs when they cover the
device kinds asked for; a different fingerprint is refused (:class:`~torchplace.errors.InvalidPlanError`).

The fingerprint is a SHA-256 over what decides the graph the runtime splits and the costs that
do not depend on the machine: the traced module's code (operators, their order and arguments),
and the OpGraph without its times (node ids, edges and their bytes, parameter, output and
temporary bytes, colocation and support, the tensors' names and shapes). So another model,
another granularity or leaf set, other example input shapes, or training instead of inference
all give another fingerprint (``mode`` is hashed with it); new weights of the same architecture do not (they change no cost).

``place(..., profile_cache="DIR")`` keeps profiles on disk too (:func:`load_profile`,
:func:`store_profile`): one JSON file per profiled graph, named by a key over the fingerprint, the
example call's shapes (the whole batch, or one micro-batch for the call prediction), the device
kinds and profiling settings, and the machine the times were measured on (processor, core count,
this process's intra-op threads, GPU names, torch version). A second ``place()`` of the same model
on the same machine then times nothing. A file that cannot be read is reported
(:class:`~torchplace.errors.PlacementWarning`) and profiled again; one that cannot be written is
reported and not kept; files are written whole or not at all.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchplace import machine
from torchplace.errors import InvalidPlanError, WorkloadFormatError, warn_caller
from torchplace.graph import OpGraph
from torchplace.profiling.trace import Traced

__all__ = ["FINGERPRINT", "KEY", "cached_graph", "disk_key", "fingerprint", "load_profile", "profile_meta", "store_profile"]

FORMAT = "torchplace.profile/2"
"""The ``format`` of a profile file in a ``profile_cache`` directory."""

KEY = "profile"
"""The key of a plan's ``meta`` that holds ``{"fingerprint": ..., "graph": ...}``."""

FINGERPRINT = "torchplace.fingerprint/3"
"""How :func:`fingerprint` hashes a graph, stored beside each fingerprint. Change it whenever what a
traced graph records changes (a new :class:`~torchplace.graph.NodeRecord` field): a plan saved by
a torchplace that fingerprinted otherwise is then refused as made by another version, not as made
for another model. ``/2``: nodes record their memories and what they read
(``resident_parts``, ``reads``), graphs the views some of a node's outputs are
(``meta["part_aliases"]``); plans without a format are from before it."""

_MACHINE_COSTS = ("times", "link_times")  # measured here; everything else is structure


def _structure(graph: OpGraph) -> dict[str, Any]:
    data = graph.to_json()
    data["nodes"] = [{k: v for k, v in node.items() if k not in _MACHINE_COSTS} for node in data["nodes"]]
    return data


def fingerprint(traced: Traced, mode: str = "inference") -> str:
    """The SHA-256 (hex) of ``mode`` and ``traced``'s code and untimed graph (see the module
    docstring). ``mode`` counts: a training plan has backward nodes an inference run lacks."""
    h = hashlib.sha256(mode.encode())
    h.update(traced.gm.code.encode())
    h.update(json.dumps(_structure(traced.graph), sort_keys=True, default=str).encode())
    return h.hexdigest()


def profile_meta(traced: Traced, graph: OpGraph, mode: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """What a plan stores so that :func:`cached_graph` can give ``graph`` (profiled from
    ``traced`` with ``settings``, e.g. threads per kind and the optimizer) back."""
    return {"format": FINGERPRINT, "fingerprint": fingerprint(traced, mode), "settings": json.loads(json.dumps(settings)),
            "graph": graph.to_json()}


def cached_graph(meta: Mapping[str, Any], traced: Traced, mode: str, kinds: Iterable[str],
                 settings: Mapping[str, Any], source: str = "plan") -> OpGraph | None:
    """The profiled graph a plan's ``meta`` holds for ``traced``, or ``None`` when the plan has
    none, was profiled with other ``settings`` (threads, optimizer: the costs would differ), or
    lacks a time for one of ``kinds`` (then profile as usual).

    Raises:
        InvalidPlanError: the plan was made for another graph (fingerprints differ), or by a
            torchplace that fingerprinted graphs otherwise (:data:`FINGERPRINT`).
        WorkloadFormatError: the stored graph is malformed (naming the field).
    """
    saved = meta.get(KEY)
    if not isinstance(saved, Mapping) or "fingerprint" not in saved:
        return None
    if saved.get("format") != FINGERPRINT:
        made = f"fingerprints {saved['format']!r}" if "format" in saved else "no fingerprint format"
        raise InvalidPlanError(
            f"{source} was saved by another version of torchplace ({made}; this one: {FINGERPRINT!r}), whose "
            "graphs record other costs. Leave out plan= to profile and solve anew, then save the new plan")
    here = fingerprint(traced, mode)
    if saved["fingerprint"] != here:
        raise InvalidPlanError(
            f"{source} was made for another graph (fingerprint {str(saved['fingerprint'])[:12]}..., this model traces "
            f"to {here[:12]}...): another model, other example input shapes or dtypes, another model dtype, mode, "
            "granularity, leaf_modules, "
            "dynamic_dims or trace_method. "
            "Place with the same model and arguments as when the plan was saved, or leave out plan= to solve anew"
        )
    if "graph" not in saved or saved.get("settings") != json.loads(json.dumps(settings)):
        return None
    graph = OpGraph.from_json(saved["graph"], f"{source}: meta.{KEY}.graph")
    if not set(traced.graph) <= set(graph):  # a training graph adds backward nodes
        raise WorkloadFormatError(f"{source}: meta.{KEY}.graph does not hold the nodes its fingerprint names; "
                                  "the file was edited: save the plan again")
    _check_structure(traced.graph, graph, f"{source}: meta.{KEY}.graph")
    _check_graph_meta(traced.graph, graph, f"{source}: meta.{KEY}.graph.meta")
    if not set(kinds) <= graph.device_kinds():
        return None
    return graph


def _check_structure(traced: OpGraph, stored: OpGraph, where: str) -> None:
    """Refuse a stored graph that lost a constraint of the traced one: the operators a node runs
    (``fx_nodes``, which the split follows), an edge (an order the
    values or the in-place writes need), or a colocation (writers of one memory share a device;
    the runtime relies on it). Its costs are the cache; its structure must be the model's.

    Raises:
        WorkloadFormatError: naming the lost edge or colocation.
    """
    for v, record in traced.records():  # which traced operators each node runs: the split follows it
        if tuple(stored.record(v).fx_nodes) != tuple(record.fx_nodes):
            raise WorkloadFormatError(f"{where}: node {v!r} runs other operators than in this model's graph "
                                      f"({list(stored.record(v).fx_nodes)} for {list(record.fx_nodes)}); the file was "
                                      "edited: save the plan again")
    edges = set(stored.edges())
    for u, v in traced.edges():
        if (u, v) not in edges:
            raise WorkloadFormatError(f"{where} lacks the edge {u!r} -> {v!r} of this model's graph; the file was "
                                      "edited: save the plan again")
    together: dict[str, list[str]] = {}
    for v, record in traced.records():
        if record.colocation is not None:
            together.setdefault(record.colocation, []).append(v)
    for label, members in together.items():
        if len({stored.record(v).colocation for v in members}) != 1 or stored.record(members[0]).colocation is None:
            raise WorkloadFormatError(f"{where} no longer keeps {', '.join(map(repr, members))} on one device "
                                      f"(colocation {label!r}: they write one memory); the file was edited: save the "
                                      "plan again")


def _check_graph_meta(traced: OpGraph, stored: OpGraph, where: str) -> None:
    """Refuse a stored graph whose record of the model's inputs, outputs, state and memory views
    (``graph.meta``, structure the fingerprint covers) is not the traced graph's: the cost model
    reads them as they are, and an edited one failed deep inside it (a ``TypeError``) or priced
    memory for another model. A training graph's own additions (``loss_bytes``) are not compared.

    Raises:
        WorkloadFormatError: naming the field.
    """
    mine, theirs = traced.to_json().get("meta") or {}, stored.to_json().get("meta") or {}
    for key, value in json.loads(json.dumps(mine, default=str)).items():
        if json.loads(json.dumps(theirs.get(key), default=str)) != value:
            raise WorkloadFormatError(f"{where}.{key} is not this model's (the fingerprint matches, so the file was "
                                      "edited): save the plan again")


def disk_key(traced: Traced, mode: str, call: Any, kinds: Iterable[str], settings: Mapping[str, Any],
             exhaustive: bool) -> dict[str, Any]:
    """What a profile on disk is for (see the module docstring); :func:`load_profile` finds the
    file by its hash and checks it whole."""
    shapes = [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t)
              for t in pytree.tree_leaves(call)]
    kinds = sorted(kinds)
    gpus = [torch.cuda.get_device_name(i) for i in range(machine.cuda_count())] if "cuda" in kinds else []
    return {"fingerprint": fingerprint(traced, mode), "call": shapes, "kinds": kinds,
            "settings": json.loads(json.dumps(settings)), "exhaustive": exhaustive,
            "machine": {"processor": machine.cpu_model(), "arch": platform.machine(), "cores": machine.cpu_cores(),
                        # a CPU without threads of its own in settings is timed with the process's (OMP_NUM_THREADS)
                        "threads": torch.get_num_threads(), "gpus": gpus, "torch": torch.__version__}}


def _path(directory: Path, key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return directory / f"{digest[:32]}.json"


def load_profile(directory: Path, key: Mapping[str, Any], traced: OpGraph | None = None) -> OpGraph | None:
    """The graph stored for ``key`` in ``directory``, or ``None`` (none stored, or unreadable:
    then a :class:`~torchplace.errors.PlacementWarning` names the file, and it is profiled anew).
    With ``traced`` (the traced model's graph), a stored graph that lost a node, edge or colocation
    of it, or records other inputs, outputs or views, is unreadable too: its costs are a cache, but
    the problem is built from it, and a lost colocation let the solver split in-place writers from
    their readers (wrong outputs)."""
    path = _path(directory, key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != json.loads(json.dumps(key)):
            raise WorkloadFormatError("not a profile of this key")
        graph = OpGraph.from_json(data["graph"], str(path))
        if traced is not None:
            if not set(traced) <= set(graph):
                raise WorkloadFormatError("it lacks nodes of this model's graph")
            _check_structure(traced, graph, "graph")
            _check_graph_meta(traced, graph, "graph.meta")
        return graph
    except (OSError, ValueError, KeyError, TypeError, AttributeError, WorkloadFormatError) as e:
        warn_caller(f"profile cache: {path} cannot be read ({type(e).__name__}: {e}); profiling again and writing "
                    "it anew")
        return None


def store_profile(directory: Path, key: Mapping[str, Any], graph: OpGraph) -> Path | None:
    """Write ``graph`` for ``key`` into ``directory`` (made if missing), atomically; its path, or
    ``None`` where it cannot be written (a read-only directory, a full disk): the cache only saves
    time, so a :class:`~torchplace.errors.PlacementWarning` says so and the placement goes on."""
    path = _path(directory, key)
    data = {"format": FORMAT, "key": json.loads(json.dumps(key)), "graph": graph.to_json()}
    tmp = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".profile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        warn_caller(f"profile cache: {path} cannot be written ({type(e).__name__}: {e}); placing without keeping "
                    "this profile")
        return None
    finally:
        if tmp is not None:  # gone once replaced; a half-written file otherwise
            Path(tmp).unlink(missing_ok=True)
    return path
