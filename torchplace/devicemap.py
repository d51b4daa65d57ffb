"""A placement as accelerate's ``device_map``: module path (or tensor name) -> device.

For a traced model (``graph.meta["state"]``, :mod:`torchplace.profiling.tensors`) every parameter
and buffer is listed under each of its names, so every module that has one appears: a tensor is on
the device of a node of its own module that reads it (``lm_head.weight``, tied to
``transformer.wte.weight``, is where ``lm_head`` runs), else where its owner runs (a tensor read
from outside its module, or read by no node). A module whose tensors are all on one device is
reported once, at the highest such level (``{"": "cpu:0"}`` when everything is on one device); a
module whose tensors are split is described by its children, and its own direct tensors by their
full names, as accelerate's ``device_map`` allows.

Graphs read from workload files have no tensor names; there each node that holds parameters
reports its module.
"""
from __future__ import annotations

from collections.abc import Mapping

from torchplace.problem import Problem

__all__ = ["device_map"]


def _within(module: str, path: str) -> bool:
    return module == path or module.startswith(f"{path}.") or not path


def tensor_devices(problem: Problem, assignment: Mapping[str, str], default: str | None = None) -> dict[str, str]:
    """Every tensor name of ``graph.meta["state"]`` -> the device that holds it under that name
    (``default`` for a tensor no node owns: a model with no operators has them all there)."""
    g = problem.graph
    out: dict[str, str] = {}
    for entry in (g.meta.get("state") or {}).values():
        if entry.get("owner") is None:
            if default is not None:
                out.update(dict.fromkeys(entry["names"], default))
            continue
        home = assignment[entry["owner"]]
        for name in entry["names"]:
            module = name.rpartition(".")[0]
            local = [v for v in entry["readers"] if _within(g.record(v).module, module)]
            out[name] = assignment[local[0]] if local else home
    return out


def _by_node_modules(problem: Problem, assignment: Mapping[str, str]) -> dict[str, str]:
    """Workload graphs: ``module path -> device`` for each node holding parameters."""
    out: dict[str, str] = {}
    for v, dev in assignment.items():
        r = problem.graph.record(v)
        if r.param_bytes > 0:
            out.setdefault(r.module, dev)
    return out


def device_map(problem: Problem, assignment: Mapping[str, str], default: str | None = None) -> dict[str, str]:
    """The plan's ``device_map`` (see the module docstring); ``default``: the device of tensors no
    node owns (the one stage of a model with no operators)."""
    leaves = tensor_devices(problem, assignment, default) or _by_node_modules(problem, assignment)
    out: dict[str, str] = {}

    def under(path: str) -> dict[str, str]:
        return {n: d for n, d in leaves.items() if _within(n, path)}

    def visit(path: str) -> None:
        names = under(path)
        devices = set(names.values())
        if len(devices) == 1:
            out[path] = devices.pop()
            return
        prefix = f"{path}." if path else ""
        children = sorted({n[len(prefix):].partition(".")[0] for n in names if n != path})
        for child in children:
            full = prefix + child
            if full in leaves and not any(n.startswith(f"{full}.") for n in leaves):
                out[full] = leaves[full]
            else:
                visit(full)

    if leaves:
        visit("")
    return out
