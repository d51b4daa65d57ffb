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
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from torchplace.errors import InvalidPlanError, WorkloadFormatError
from torchplace.graph import OpGraph
from torchplace.profiling.trace import Traced

__all__ = ["KEY", "cached_graph", "fingerprint", "profile_meta"]

KEY = "profile"
"""The key of a plan's ``meta`` that holds ``{"fingerprint": ..., "graph": ...}``."""

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
    return {"fingerprint": fingerprint(traced, mode), "settings": json.loads(json.dumps(settings)), "graph": graph.to_json()}


def cached_graph(meta: Mapping[str, Any], traced: Traced, mode: str, kinds: Iterable[str],
                 settings: Mapping[str, Any], source: str = "plan") -> OpGraph | None:
    """The profiled graph a plan's ``meta`` holds for ``traced``, or ``None`` when the plan has
    none, was profiled with other ``settings`` (threads, optimizer: the costs would differ), or
    lacks a time for one of ``kinds`` (then profile as usual).

    Raises:
        InvalidPlanError: the plan was made for another graph (fingerprints differ).
        WorkloadFormatError: the stored graph is malformed (naming the field).
    """
    saved = meta.get(KEY)
    if not isinstance(saved, Mapping) or "fingerprint" not in saved:
        return None
    here = fingerprint(traced, mode)
    if saved["fingerprint"] != here:
        raise InvalidPlanError(
            f"{source} was made for another graph (fingerprint {str(saved['fingerprint'])[:12]}..., this model traces "
            f"to {here[:12]}...): another model, other example input shapes, mode, granularity or leaf_modules. "
            "Place with the same model and arguments as when the plan was saved, or leave out plan= to solve anew"
        )
    if "graph" not in saved or saved.get("settings") != json.loads(json.dumps(settings)):
        return None
    graph = OpGraph.from_json(saved["graph"], f"{source}: meta.{KEY}.graph")
    if not set(traced.graph) <= set(graph):  # a training graph adds backward nodes
        raise WorkloadFormatError(f"{source}: meta.{KEY}.graph does not hold the nodes its fingerprint names; "
                                  "the file was edited: save the plan again")
    if not set(kinds) <= graph.device_kinds():
        return None
    return graph
