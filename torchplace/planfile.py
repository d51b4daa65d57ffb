"""Plan files: the JSON :meth:`Plan.to_json <torchplace.plan.Plan.to_json>` writes, read back and checked.

A plan file is read by people's tools and edited by hand, and ``torchplace show`` prints what it
holds, so nothing in it is trusted: :func:`plan_from_json` checks every field and raises a
:class:`~torchplace.errors.WorkloadFormatError` naming the file and the field. A plan must have
at least one stage, every stage a device and at least one node (but for the one empty stage of a
model with no operators), no node in two stages; objective,
lower bound and solve time are finite and non-negative, the bound no larger than the objective
(a bound above its own plan's value is no bound), the gap (if given) the one they imply, the
status one of ``optimal`` / ``feasible`` / ``time_limit``, and an ``assignment`` (if given) the one
the stages imply. So a plan with a NaN objective or no stages never prints as "proven optimal".

Checking a plan against a problem (coverage, memory, colocation) is :meth:`Plan.validate
<torchplace.plan.Plan.validate>`; this module checks the file on its own.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, get_args

from torchplace.checks import brief, check_float, non_negative_float, non_negative_int, positive_int
from torchplace.costmodel import StageCost
from torchplace.errors import WorkloadFormatError
from torchplace.files import json_kind
from torchplace.plan import _FORMAT, Plan, Stage
from torchplace.problem import Mode, Objective, Schedule

__all__ = ["STATUSES", "plan_from_json"]

STATUSES = ("optimal", "feasible", "time_limit")
"""The statuses a plan may have (see :class:`~torchplace.plan.Plan`)."""

_BOUND_SLACK = 1e-9  # relative slack of "bound <= objective", as Plan.build allows


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise WorkloadFormatError(f"{where}: expected a non-empty string, got {brief(value)}")
    return value


def _seconds(value: Any, where: str) -> float:
    return non_negative_float(value, where, error=WorkloadFormatError)


def _count(value: Any, where: str) -> int:
    return non_negative_int(value, where, error=WorkloadFormatError)


_COST_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "device": _text, "ops": _count, "compute": _seconds, "transfer_in": _seconds, "transfer_out": _seconds,
    "memory": _count, "allreduce": _seconds,
}  # the check of each StageCost field (fields not listed are taken as they are)


def _required(data: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in data:
        raise WorkloadFormatError(f"{source}: missing field {key!r}")
    return data[key]


def _stages(items: Any, source: str) -> list[Stage]:
    """The stages, each with a device and nodes, no node twice."""
    if not isinstance(items, list) or not items:
        raise WorkloadFormatError(f"{source}: stages: expected a non-empty list of stages, got {brief(items)}")
    stages: list[Stage] = []
    stage_of: dict[str, int] = {}
    for i, s in enumerate(items):
        where = f"{source}: stages[{i}]"
        if not isinstance(s, Mapping) or "device" not in s or "nodes" not in s:
            raise WorkloadFormatError(f"{where}: expected an object with 'device' and 'nodes', got {brief(s)}")
        device = _text(s["device"], f"{where}.device")
        empty_graph = len(items) == 1 and s["nodes"] == []  # the one-stage plan of a model with no operators
        if not isinstance(s["nodes"], list) or not (s["nodes"] or empty_graph):
            raise WorkloadFormatError(f"{where}.nodes: expected a non-empty list of node ids, got {brief(s['nodes'])}")
        for j, v in enumerate(s["nodes"]):
            _text(v, f"{where}.nodes[{j}]")
            if v in stage_of:
                raise WorkloadFormatError(f"{where}.nodes[{j}]: node {v!r} is also in stages[{stage_of[v]}]")
            stage_of[v] = i
        recompute = s.get("recompute", False)
        if not isinstance(recompute, bool):
            raise WorkloadFormatError(f"{where}.recompute: expected true or false, got {brief(recompute)}")
        parallel = {}
        for key in ("data_parallel", "tensor_parallel"):
            if key in s:  # a degree of 0 would ask torchrun for 0 processes
                parallel[key] = positive_int(s[key], f"{where}.{key}", error=WorkloadFormatError)
        if "tmpcs" in s:
            tmpcs = s["tmpcs"]
            if not isinstance(tmpcs, Mapping) or not all(isinstance(v, str) for v in tmpcs.values()):
                raise WorkloadFormatError(f"{where}.tmpcs: expected an object of TMPC ids by node, got {brief(tmpcs)}")
            parallel["tmpcs"] = dict(tmpcs)
        stages.append(Stage(device, tuple(s["nodes"]), recompute, **parallel))
    return stages


def _costs(items: Any, devices: set[str], source: str) -> list[StageCost]:
    """The per-device cost rows: one per device of the stages at most, every number checked."""
    if not isinstance(items, list):
        raise WorkloadFormatError(f"{source}: costs: expected a list, got {brief(items)}")
    known = {f.name for f in fields(StageCost)}
    out: list[StageCost] = []
    for i, c in enumerate(items):
        where = f"{source}: costs[{i}]"
        if not isinstance(c, Mapping) or set(c) not in (known, known - {"allreduce"}):  # plans before Piper
            raise WorkloadFormatError(f"{where}: expected an object with fields {sorted(known)}, got {brief(c)}")
        cost = StageCost(**{k: _COST_FIELDS[k](v, f"{where}.{k}") if k in _COST_FIELDS else v for k, v in c.items()})
        if cost.device not in devices or any(o.device == cost.device for o in out):
            raise WorkloadFormatError(f"{where}.device: {cost.device!r} is not a device of the stages, or repeated")
        out.append(cost)
    if out and {c.device for c in out} != devices:  # the table pairs every stage with its device's row
        missing = sorted(devices - {c.device for c in out})
        raise WorkloadFormatError(f"{source}: costs: no row for device(s) {missing}; give one per device of the "
                                  "stages, or none")
    return out


_CALL_NUMBERS = ("seconds", "makespan", "overhead", "fill", "steady", "drain", "per_sample", "microbatches", "batch")


_KINDS = {"objective": get_args(Objective), "mode": get_args(Mode), "schedule": get_args(Schedule)}
"""What a plan was solved for (:meth:`Plan.build` records them): ``place(plan=)`` compares them
with its own arguments and runs the schedule, and the report draws it."""


def _meta(meta: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``meta`` with the parts a plan prints checked (``call``, ``single_device``: callmodel.describe)
    and the objective, mode and schedule it was solved for (:data:`_KINDS`)."""
    for key, allowed in _KINDS.items():
        if key in meta and meta[key] not in allowed:
            raise WorkloadFormatError(f"{source}: meta.{key}: expected one of {list(allowed)}, got {brief(meta[key])}")
    call = meta.get("call")
    if call is not None:
        if not isinstance(call, Mapping):
            raise WorkloadFormatError(f"{source}: meta.call: expected an object, got {brief(call)}")
        need = ("seconds", "microbatches", "fill", "steady", "drain", "overhead") if "fill" in call else \
            ("seconds", "makespan", "overhead") if call else ()
        for key in need:
            if key not in call:
                raise WorkloadFormatError(f"{source}: meta.call: missing field {key!r}")
        for key in _CALL_NUMBERS:
            if key in call:
                _seconds(call[key], f"{source}: meta.call.{key}")
        if not isinstance(call.get("notes", []), list):
            raise WorkloadFormatError(f"{source}: meta.call.notes: expected a list, got {brief(call['notes'])}")
    single = meta.get("single_device")
    if single is not None:
        if not isinstance(single, Mapping):
            raise WorkloadFormatError(f"{source}: meta.single_device: expected an object, got {brief(single)}")
        if single.get("device"):
            for key in ("seconds", "plan_seconds"):
                _seconds(_required(single, key, f"{source}: meta.single_device"), f"{source}: meta.single_device.{key}")
            if "margin" in single:  # absent in plans saved before the margin: printed as none
                margin = check_float(single["margin"], f"{source}: meta.single_device.margin", low=0.0,
                                     error=WorkloadFormatError)
                if margin >= 1:
                    raise WorkloadFormatError(f"{source}: meta.single_device.margin: expected a fraction below 1 "
                                              f"(0.1 is 10%), got {brief(single['margin'])}")
    return dict(meta)


def _check_bound(objective: float, bound: float, data: Mapping[str, Any], source: str) -> None:
    """The bound is at most the objective, and a given gap is the one they imply."""
    if bound > objective * (1 + _BOUND_SLACK) + 1e-12:
        raise WorkloadFormatError(
            f"{source}: lower_bound {bound} exceeds the objective {objective}: a bound above its own plan is no bound"
        )
    if "gap" in data:
        gap = _seconds(data["gap"], f"{source}: gap")
        implied = 0.0 if objective == 0 else max(0.0, (objective - bound) / objective)
        if not math.isclose(gap, implied, rel_tol=1e-9, abs_tol=1e-12):
            raise WorkloadFormatError(
                f"{source}: gap {gap} is not (objective - lower_bound) / objective = {implied}"
            )


def plan_from_json(data: Any, source: str = "plan") -> Plan:
    """The :class:`~torchplace.plan.Plan` a plan-file dict describes, every field checked.

    Args:
        data: the parsed JSON.
        source: the file name (or another label), named in every message.

    Returns:
        The plan. It is not checked against a problem (see :meth:`Plan.validate`).

    Raises:
        WorkloadFormatError: naming ``source`` and the first missing or malformed field (see the
            module docstring for what is checked).
    """
    if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
        got = brief(data.get("format")) if isinstance(data, Mapping) else f"a JSON {type(data).__name__}"
        kind = json_kind(data)
        raise WorkloadFormatError(f"{source}: not a plan file: expected 'format': {_FORMAT!r}, got {got}"
                                  + (f" (the file is {kind})" if kind else ""))
    stages = _stages(_required(data, "stages", source), source)
    objective = _seconds(_required(data, "objective", source), f"{source}: objective")
    bound = _seconds(_required(data, "lower_bound", source), f"{source}: lower_bound")
    _check_bound(objective, bound, data, source)
    status = _required(data, "status", source)
    if status not in STATUSES:
        raise WorkloadFormatError(f"{source}: status: expected one of {list(STATUSES)}, got {brief(status)}")
    meta = data.get("meta", {})
    if not isinstance(meta, Mapping):
        raise WorkloadFormatError(f"{source}: meta: expected an object, got {brief(meta)}")
    plan = Plan(
        stages=stages,
        objective=objective,
        lower_bound=bound,
        solver=_text(_required(data, "solver", source), f"{source}: solver"),
        seconds=_seconds(_required(data, "seconds", source), f"{source}: seconds"),
        status=status,
        costs=_costs(data.get("costs", []), {s.device for s in stages}, source),
        meta=_meta(meta, source),
    )
    if "assignment" in data and data["assignment"] != plan.assignment:
        raise WorkloadFormatError(f"{source}: assignment: does not match the stages (node -> device of each stage)")
    return plan
