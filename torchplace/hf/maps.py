"""Device maps in accelerate's form: written from a plan, and any map timed on a problem.

accelerate's ``device_map`` sends module paths (or tensor names) to GPU ids, ``"cpu"`` or
``"disk"``; a key covers everything below it. :func:`to_device_map` writes a torchplace plan over a
model's blocks in that form, :func:`evaluate_device_map` reads any map (accelerate's own too) back
onto the blocks and prices it with the one cost model.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from torchplace.costmodel import device_memory, evaluate_stages
from torchplace.devices import Cluster
from torchplace.errors import InfeasibleError, UsageError
from torchplace.graph import OpGraph
from torchplace.hf.budget import DISK_BANDWIDTH, OFFLOAD_KINDS, accelerate_name, hf_cluster, offload_times
from torchplace.hf.budget import main_device as budget_main
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem

__all__ = ["MapCost", "accelerate_main", "budgets", "buffers_only", "collapse", "computing_on_the_cpu", "dispatched_memory",
           "evaluate_device_map", "host_memory", "main_device", "offload_charge", "solver_cluster", "to_device_map",
           "with_reserve", "within_budgets"]


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


def solver_cluster(cluster: Cluster, graph: OpGraph) -> Cluster:
    """``cluster`` as the solver sees it: the activation peak taken off the budget of every device
    that computes, and the whole KV cache added to the budget of every offload device (which stores
    weights only: the cost model charges an offloaded block's cache where the block is mapped, but
    it is made on the main device, :func:`dispatched_memory`; so every map that fits passes, and
    :func:`torchplace.hf.infer._solve_dispatched` checks the solver's maps against the true
    :func:`budgets`). The original budgets are kept in ``graph.meta["hf"]["budgets"]``."""
    peak = graph.meta["hf"]["activations"]
    cache = sum(graph.meta["hf"].get("kv_cache", {}).values())
    graph.meta["hf"]["budgets"] = {d.name: d.memory_bytes for d in cluster.devices}
    devices = tuple(d if d.memory_bytes is None
                    else replace(d, memory_bytes=d.memory_bytes + cache) if d.kind in OFFLOAD_KINDS
                    else replace(d, memory_bytes=max(0, d.memory_bytes - peak)) for d in cluster.devices)
    return replace(cluster, devices=devices)


def computing_on_the_cpu(problem: Problem) -> Problem | None:
    """``problem`` without its GPUs, so that the CPU computes (``"disk"`` offloading to it), or
    ``None`` when it has no GPU or no ``"cpu"`` budget.

    With a GPU in ``max_memory`` the CPU only stores offloaded weights (:mod:`torchplace.hf.budget`);
    but a map naming no GPU (``{"": "cpu"}``, as accelerate's ``infer_auto_device_map`` gives for
    ``{0: "1KiB", "cpu": "30GiB"}``) is dispatched on the CPU, which then computes every block:
    the last resort when no map fits the GPUs (a GPU too small for even the offloaded blocks' KV
    cache was refused, found by fuzzing), and how :func:`evaluate_device_map` prices such a map.
    The blocks' costs are the ones measured or estimated for ``problem``, ``"disk"`` read at its
    ``meta["hf"]["disk_bandwidth"]``; ``meta["hf"]["left_out"]`` names the GPUs left out."""
    given = problem.graph.meta["hf"]["budgets"]
    if "cpu" not in given or not any(name.startswith("cuda:") for name in given):
        return None
    hw = hf_cluster({name: given[name] for name in ("cpu", "disk") if name in given})
    gpus = [accelerate_name(name) for name in given if name.startswith("cuda:")]
    graph = problem.graph.with_records(lambda v, r: r, meta={**problem.graph.meta,
                                                             "hf": {**problem.graph.meta["hf"], "left_out": gpus}})
    hw = solver_cluster(hw, graph)
    disk = graph.meta["hf"].get("disk_bandwidth", DISK_BANDWIDTH)
    return replace(problem, graph=offload_times(graph, hw, disk), cluster=hw)


def main_device(problem: Problem) -> str | None:
    """The device the blocks torchplace maps to ``"cpu"`` / ``"disk"`` compute on:
    :func:`torchplace.hf.budget.main_device` of the problem's cluster (the lowest GPU id of
    ``max_memory``, which :func:`to_device_map` names in every map that offloads, so that accelerate
    picks it too; the CPU without a GPU; ``None`` with ``"disk"`` alone)."""
    return budget_main(problem.cluster)


def accelerate_main(problem: Problem, device_map: Mapping[str, Any]) -> str | None:
    """The device (torchplace name) accelerate's ``dispatch_model`` computes ``device_map``'s
    offloaded blocks on: the lowest GPU id among its values (``list(set(values) - {"cpu", "disk"})[0]``
    for small ids, :func:`torchplace.hf.budget.main_device`), else the CPU."""
    ids = (str(v).removeprefix("cuda:") for v in device_map.values())
    gpus = sorted({int(i) for i in ids if i.isdigit()})
    name = f"cuda:{gpus[0]}" if gpus else "cpu"
    return name if any(d.name == name for d in problem.cluster.devices) else None


def offload_charge(problem: Problem, stages: Sequence[Stage], main: str | None = None) -> tuple[str | None, int]:
    """The main device (``main``, default :func:`main_device`) and the bytes the blocks offloaded to
    ``"cpu"`` / ``"disk"`` put on it.

    Measured on an H100 (GPT-2 small, half its weights on cuda:0, the rest offloaded): an offloaded
    block computes on the main device, so its KV cache is made and kept there, and its weights are
    copied there while it runs (one block at a time). So the main device holds, beyond its own
    blocks, the KV cache of every offloaded block and the largest offloaded block's weights; the
    offload devices hold only the weights (:func:`dispatched_memory`)."""
    main = main_device(problem) if main is None else main
    g, kv = problem.graph, problem.graph.meta["hf"].get("kv_cache", {})
    away = [v for s in stages if problem.cluster.device(s.device).kind in OFFLOAD_KINDS and s.device != main
            for v in s.nodes]
    if main is None or not away:
        return main, 0
    return main, sum(kv.get(v, 0) for v in away) + max(g.record(v).param_bytes for v in away)


def dispatched_memory(problem: Problem, stages: Sequence[Stage], main: str | None = None) -> dict[str, int]:
    """Bytes per device (torchplace names) of the map of ``stages`` run by ``dispatch_model``:
    :func:`~torchplace.costmodel.device_memory`, less the KV cache of the blocks on offload devices
    (the cost model charges a block's cache where the block is mapped, but an offloaded block's is
    made where it computes), plus :func:`offload_charge` on the main device (``main``, default
    :func:`main_device`)."""
    memory = dict(device_memory(problem, stages))
    main = main_device(problem) if main is None else main
    kv = problem.graph.meta["hf"].get("kv_cache", {})
    for s in stages:
        if problem.cluster.device(s.device).kind in OFFLOAD_KINDS and s.device != main:
            memory[s.device] -= sum(kv.get(v, 0) for v in s.nodes)
    main, extra = offload_charge(problem, stages, main)
    if main is not None and extra:
        memory[main] = memory.get(main, 0) + extra
    return memory


def host_memory(problem: Problem, stages: Sequence[Stage], main: str | None = None) -> dict[int | str, int]:
    """``{"cpu": bytes}`` when no device of ``max_memory`` computes (``"disk"`` alone, ``main``
    ``None``): accelerate then computes on the CPU, whose RAM holds what a main device would
    (:func:`offload_charge`: every block's KV cache, the largest block's weights while it runs)
    and the activation peak; else empty. (No budget is given for that RAM, so it is reported only.)"""
    g, meta = problem.graph, problem.graph.meta["hf"]
    nodes = [v for s in stages for v in s.nodes]
    if main is not None or not nodes:
        return {}
    kv = meta.get("kv_cache", {})
    weights = max(g.record(v).param_bytes for v in nodes)
    return {"cpu": sum(kv.get(v, 0) for v in nodes) + weights + meta["activations"]}


def _owners(names: Iterable[str]) -> set[str]:
    return {n.rpartition(".")[0] for n in names}


def _holds(owners: set[str], path: str) -> bool:
    return any(o == path or o.startswith(f"{path}.") or not path for o in owners)


def buffers_only(model: nn.Module, graph: OpGraph) -> list[str]:
    """The blocks of ``graph`` (whole modules) that hold tensors none of which is in the state dict
    (a rotary embedding's non-persistent ``inv_freq``): :func:`to_device_map` maps them to the main
    device whatever the plan says, so the problem keeps them off the offload devices
    (``graph.meta["hf"]["buffers_only"]``, :func:`~torchplace.hf.budget.offload_times`)."""
    paths = graph.meta["hf"]["modules"]
    holders = _owners(n for n, _ in [*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)])
    persistent = _owners(model.state_dict())
    return [v for v, r in graph.records()
            if r.op != "block:<direct>" and _holds(holders, paths[v]) and not _holds(persistent, paths[v])]


def to_device_map(model: nn.Module, problem: Problem, plan: Plan) -> dict[str, int | str]:
    """The plan as accelerate's device_map: the highest module paths whose blocks share a device.

    Blocks without parameters or buffers (dropout, activations) are left out: they hold nothing to
    place and run where their input is (the problem colocates them with the block before them). A
    block whose only tensors are non-persistent buffers (a rotary embedding's ``inv_freq``) is
    listed, but on the main device rather than an offload device: accelerate offloads a module to
    disk from the state dict, which lacks such buffers, and moves the buffers of a ``"cpu"`` one to
    the main device anyway (:func:`buffers_only`: the problem puts them there too, but with
    ``"disk"`` alone, where they are mapped to the ``"cpu"`` that computes). A map that offloads names the main device (:func:`main_device`), through
    a module without weights when no block is there, so that accelerate computes the offloaded
    blocks where they were priced. A map that sends everything to ``"disk"`` lists the model's
    top-level modules: accelerate's ``dispatch_model`` cannot offload ``{"": "disk"}``."""
    paths = problem.graph.meta["hf"]["modules"]
    holders = _owners(n for n, _ in [*model.named_parameters(remove_duplicate=False),
                                     *model.named_buffers(remove_duplicate=False)])
    unsaved = set(buffers_only(model, problem.graph))
    computing = main_device(problem)
    main = "cpu" if computing is None else accelerate_name(computing)
    leaves: dict[str, int | str] = {}
    for s in plan.stages:
        offloaded = problem.cluster.device(s.device).kind in OFFLOAD_KINDS
        for v in s.nodes:
            r, path = problem.graph.record(v), paths[v]
            if r.op == "block:<direct>":
                names: tuple[str, ...] = _direct_names(model, path)
            elif _holds(holders, path):
                names = (path,)
            else:
                continue
            leaves.update(dict.fromkeys(names, main if offloaded and v in unsaved else accelerate_name(s.device)))
    if not leaves:
        return {"": accelerate_name(plan.stages[0].device)}
    if computing is not None and isinstance(main, int) and main not in leaves.values() \
            and {"cpu", "disk"} & set(leaves.values()):
        leaves = {_weightless(model, leaves, computing): main, **leaves}
    out = collapse(leaves)
    return _top_level(model, leaves) if out == {"": "disk"} else out


def _top_level(model: nn.Module, leaves: Mapping[str, int | str]) -> dict[str, int | str]:
    """``leaves`` (all on one device) as the model's top-level modules and direct tensors."""
    names = [n for k in leaves for n in (_direct_names(model, "") if not k else (k.partition(".")[0],))]
    return {n: leaves[next(iter(leaves))] for n in dict.fromkeys(names)}


def _weightless(model: nn.Module, leaves: Mapping[str, Any], device: str) -> str:
    """A module without weights outside every entry of ``leaves``, to name ``device`` in the map.

    accelerate computes offloaded blocks on the lowest GPU id its map names, and on the CPU when it
    names none; a plan that offloads was priced computing them on ``device``, so the map must name
    it: a weightless module (a dropout) mapped there does, and holds nothing.

    Raises:
        InfeasibleError: if the model has no such module.
    """
    for path, m in model.named_modules():
        if path and not any(True for _ in m.parameters()) and not any(True for _ in m.buffers()) and not any(
                path == k or path.startswith(f"{k}.") or not k for k in leaves):
            return path
    raise InfeasibleError(f"the plan offloads blocks that compute on {device} but puts no block there, and the model "
                          f"has no module without weights to name {device} in the map (accelerate would compute them "
                          f"elsewhere): raise the max_memory of {device} so that a block fits there, or lower "
                          "batch_size or sequence_length")


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

    Each block goes where the longest key of the map covering it sends it: its module path or a
    module above it, or one of its tensors' names (accelerate's keys for a module's own tensors,
    e.g. BART's ``"final_logits_bias"``); a block holding no state-dict tensor (a module without
    weights) that no key covers runs where the block before it runs. The plan is evaluated by
    :func:`torchplace.costmodel.evaluate_stages` without the solver's checks, so a map that breaks
    a budget, or splits tied weights (charged a copy of them on each device whose blocks read
    them, as accelerate keeps one there), is still timed and reported as not fitting.
    Offloaded blocks are charged to the GPU accelerate computes them on (:func:`accelerate_main`);
    their time is that of :func:`main_device`'s kind, the same GPU for any map that names it. With
    ``"disk"`` alone the CPU computes them: ``memory`` has a ``"cpu"`` row (:func:`host_memory`),
    and a block holding no state-dict tensor that the map sends to ``"cpu"`` (as :func:`to_device_map`
    sends a module holding only non-persistent buffers, which cannot be offloaded) is priced as one on
    ``"disk"``, as its plan has it; a block with weights on ``"cpu"`` is refused as any device not
    in ``max_memory``.

    A map naming no GPU on a problem with GPUs (accelerate's ``{"": "cpu"}`` for a GPU too small
    for anything) is dispatched on the CPU, which computes every block: it is priced on
    :func:`computing_on_the_cpu` of ``problem``, as :func:`~torchplace.hf.infer.plan_device_map`
    prices its own such map.

    Raises:
        UsageError: the map sends a block to a device not in ``max_memory`` (or to a GPU ``problem``
            left out, the CPU computing every block: evaluate it on the plan's ``requested``), or
            gives no device to some of the model's tensors (accelerate's ``check_device_map``
            refuses such a map).
    """
    if accelerate_main(problem, device_map) == "cpu" and main_device(problem) != "cpu":
        on_cpu = computing_on_the_cpu(problem)
        if on_cpu is not None:
            return evaluate_device_map(on_cpu, device_map)
    meta = problem.graph.meta["hf"]
    paths, held = meta["modules"], meta.get("tensors", {})
    names = {str(accelerate_name(d.name)): d.name for d in problem.cluster.devices}
    # "disk" alone: a block holding no state-dict tensor (non-persistent buffers only), which
    # to_device_map sends to "cpu" where accelerate computes, is priced on "disk" as the plan has it;
    # a block with weights on "cpu" would sit in a RAM that max_memory does not give
    buffers_on_cpu = "cpu" not in names and "disk" in names and main_device(problem) is None
    stages: list[Stage] = []
    where: dict[str, str] = {}
    uncovered: list[str] = []
    prev = problem.cluster.devices[0].name
    for v in problem.graph.topological_order():
        path, tensors = paths[v], held.get(v, ())
        keys = [k for k in device_map if k == "" or path == k or path.startswith(f"{k}.")
                or any(t == k or t.startswith(f"{k}.") for t in tensors)]
        if keys:
            value = str(device_map[max(keys, key=len)])
            if value.startswith("cuda:"):
                value = value.split(":")[1]
            if value == "cpu" and buffers_on_cpu and not tensors:
                value = "disk"
            if value not in names:
                raise UsageError(f"device_map sends {path!r} to {value!r}, which is not in max_memory {sorted(names)}"
                                 + _left_out(meta, value))
            prev = names[value]
        elif tensors:
            uncovered.extend(tensors)
        where[v] = prev
        if stages and stages[-1].device == prev:
            stages[-1] = Stage(prev, (*stages[-1].nodes, v))
        else:
            stages.append(Stage(prev, (v,)))
    if uncovered:
        more = f" and {len(uncovered) - 5} more" if len(uncovered) > 5 else ""
        raise UsageError(f"device_map gives no device for {', '.join(uncovered[:5])}{more} (accelerate's "
                         "check_device_map refuses it): add a key for each module or tensor, or \"\" for the rest")
    seconds, _ = evaluate_stages(problem, stages)
    main = accelerate_main(problem, device_map)
    memory = dispatched_memory(problem, stages, main)
    split, copies = _tied_copies(problem, where)
    for device, nbytes in copies.items():
        memory[device] = memory.get(device, 0) + nbytes
    return MapCost(seconds, not split and within_budgets(problem, memory),
                   {**with_reserve(problem, memory), **host_memory(problem, stages, main)})


def _left_out(meta: Mapping[str, Any], value: str) -> str:
    """A hint when ``value`` is a GPU that a CPU-only problem (:func:`computing_on_the_cpu`) left out."""
    if value not in map(str, meta.get("left_out", ())):
        return ""
    return (f" (this problem is the one where the CPU computes every block, no map having fitted GPU(s) "
            f"{', '.join(map(str, meta['left_out']))}): evaluate maps naming them on the problem of max_memory, "
            "DeviceMapPlan.requested or build_problem(...)")


def _tied_copies(problem: Problem, where: Mapping[str, str]) -> tuple[bool, dict[str, int]]:
    """Whether ``where`` (block -> device) splits a group of blocks sharing tensors (tied
    weights), and the bytes of those tensors each device must then hold a copy of. A block's
    ``meta["hf"]["shared"]`` are the bytes of tensors an earlier block counted: its device needs a
    copy unless a block of its group that counted its own tensors is there."""
    g, meta = problem.graph, problem.graph.meta["hf"]
    shared, held = meta.get("shared", {}), meta.get("tensors", {})
    groups: dict[str, list[str]] = {}
    for v, r in g.records():
        if r.colocation and r.colocation.startswith("tied:") and held.get(v):
            groups.setdefault(r.colocation, []).append(v)
    split, copies = False, {}
    for members in groups.values():
        if len({where[v] for v in members}) < 2:
            continue
        split = True
        home = {where[v] for v in members if not shared.get(v)}
        for v in members:
            if shared.get(v) and where[v] not in home:
                copies[where[v]] = max(copies.get(where[v], 0), shared[v])
    return split, copies


def budgets(problem: Problem) -> dict[str, int | None]:
    """Bytes each device may hold (torchplace names; ``None``: unlimited): its ``max_memory``, less
    the activation peak on devices that compute. (The problem's own cluster gives the offload
    devices more, for the KV cache its cost model charges there: :func:`solver_cluster`.)"""
    peak = problem.graph.meta["hf"]["activations"]
    given = problem.graph.meta["hf"]["budgets"]
    return {d.name: None if given[d.name] is None
            else given[d.name] if d.kind in OFFLOAD_KINDS else max(0, given[d.name] - peak)
            for d in problem.cluster.devices}


def within_budgets(problem: Problem, memory: Mapping[str, int]) -> bool:
    """Whether ``memory`` (bytes per device, torchplace names; :func:`dispatched_memory`) is within
    every device's :func:`budgets`."""
    caps = budgets(problem)
    return all(caps[d] is None or b <= caps[d] for d, b in memory.items())  # type: ignore[operator]
