"""Device maps in accelerate's form: written from a plan, and any map timed on a problem.

accelerate's ``device_map`` sends module paths (or tensor names) to GPU ids, ``"cpu"`` or
``"disk"``; a key covers everything below it. :func:`to_device_map` writes a torchplace plan over a
model's blocks in that form, :func:`evaluate_device_map` reads any map (accelerate's own too) back
onto the blocks and prices it with the one cost model.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from torchplace.costmodel import device_memory, evaluate_stages
from torchplace.errors import UsageError
from torchplace.hf.budget import OFFLOAD_KINDS, accelerate_name
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem

__all__ = ["MapCost", "collapse", "evaluate_device_map", "to_device_map", "with_reserve"]


@dataclass(frozen=True)
class MapCost:
    """What a device map (anyone's) costs under torchplace's cost model.

    Attributes:
        seconds: predicted time of one forward pass of the stated batch.
        fits: whether every device's memory (weights + KV cache + activation peak) is within budget.
        memory: bytes per device, by accelerate name.
    """

    seconds: float
    fits: bool
    memory: dict[int | str, int]


def with_reserve(problem: Problem, memory: Mapping[str, int]) -> dict[int | str, int]:
    """Bytes per device by accelerate name: the cost model's plus the activation peak on devices
    that compute."""
    peak = problem.graph.meta["hf"]["activations"]
    return {accelerate_name(d): b + (0 if problem.cluster.device(d).kind in OFFLOAD_KINDS else peak)
            for d, b in memory.items()}


def _owners(names: Iterable[str]) -> set[str]:
    return {n.rpartition(".")[0] for n in names}


def _holds(owners: set[str], path: str) -> bool:
    return any(o == path or o.startswith(f"{path}.") or not path for o in owners)


def to_device_map(model: nn.Module, problem: Problem, plan: Plan) -> dict[str, int | str]:
    """The plan as accelerate's device_map: the highest module paths whose blocks share a device.

    Blocks without parameters or buffers (dropout, activations) are left out: they hold nothing to
    place and run where their input is (the problem colocates them with the block before them). A
    block whose only tensors are non-persistent buffers (a rotary embedding's ``inv_freq``) is
    listed, but on the main device rather than ``"disk"``: accelerate offloads a module to disk
    from the state dict, which lacks such buffers."""
    paths = problem.graph.meta["hf"]["modules"]
    holders = _owners(n for n, _ in [*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)])
    persistent = _owners(model.state_dict())
    main = accelerate_name(problem.cluster.devices[0].name)
    leaves: dict[str, int | str] = {}
    for s in plan.stages:
        for v in s.nodes:
            r, path = problem.graph.record(v), paths[v]
            if r.op == "block:<direct>":
                names: tuple[str, ...] = _direct_names(model, path)
            elif _holds(holders, path):
                names = (path,)
            else:
                continue
            device = accelerate_name(s.device)
            if device == "disk" and not _holds(persistent, path) and r.op != "block:<direct>":
                device = main if main != "disk" else "cpu"
            leaves.update(dict.fromkeys(names, device))
    if not leaves:
        return {"": accelerate_name(plan.stages[0].device)}
    return collapse(leaves)


def _direct_names(model: nn.Module, path: str) -> tuple[str, ...]:
    m = model.get_submodule(path)
    prefix = f"{path}." if path else ""
    return tuple(prefix + n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)])


def collapse(leaves: Mapping[str, int | str]) -> dict[str, int | str]:
    """Merge ``leaves`` (module paths or tensor names -> device) into the highest paths whose
    entries all share a device (``{"": d}`` when there is one device), in the leaves' order."""
    def under(path: str) -> list[str]:
        return [n for n in leaves if not path or n == path or n.startswith(f"{path}.")]

    out: dict[str, int | str] = {}

    def visit(path: str) -> None:
        names = under(path)
        if len({leaves[n] for n in names}) == 1:
            out[path] = leaves[names[0]]
            return
        prefix = f"{path}." if path else ""
        for child in dict.fromkeys(n[len(prefix):].partition(".")[0] for n in names):
            visit(prefix + child)

    if leaves:
        visit("")
    order = {n: i for i, n in enumerate(leaves)}
    return dict(sorted(out.items(), key=lambda kv: min(order[n] for n in under(kv[0]))))


def evaluate_device_map(problem: Problem, device_map: Mapping[str, Any]) -> MapCost:
    """What ``device_map`` (e.g. accelerate's) costs on ``problem`` (from :func:`build_problem`).

    Each block goes where the longest key of the map covering its module path sends it; a block no
    key covers (a module without weights) runs where the block before it runs. The plan is
    evaluated by :func:`torchplace.costmodel.evaluate_stages` without the solver's checks, so a map
    that breaks a budget (or splits tied weights) is still timed and reported as not fitting.
    """
    paths = problem.graph.meta["hf"]["modules"]
    names = {str(accelerate_name(d.name)): d.name for d in problem.cluster.devices}
    stages: list[Stage] = []
    prev = problem.cluster.devices[0].name
    for v in problem.graph.topological_order():
        path = paths[v]
        keys = [k for k in device_map if k == "" or path == k or path.startswith(f"{k}.")]
        if keys:
            value = str(device_map[max(keys, key=len)])
            if value.startswith("cuda:"):
                value = value.split(":")[1]
            if value not in names:
                raise UsageError(f"device_map sends {path!r} to {value!r}, which is not in max_memory {sorted(names)}")
            prev = names[value]
        if stages and stages[-1].device == prev:
            stages[-1] = Stage(prev, (*stages[-1].nodes, v))
        else:
            stages.append(Stage(prev, (v,)))
    seconds, _ = evaluate_stages(problem, stages)
    memory = device_memory(problem, stages)
    caps = {d.name: d.memory_bytes for d in problem.cluster.devices}
    fits = all(caps[d] is None or b <= caps[d] for d, b in memory.items())  # type: ignore[operator]
    return MapCost(seconds, fits, with_reserve(problem, memory))
