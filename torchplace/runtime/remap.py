"""Carry a placement over to another trace of the same model (its eval-mode graph).

A model placed for training is traced in training mode: dropout and BatchNorm's batch statistics
are part of its graph. Its eval-mode graph is a second trace whose nodes are almost all the same,
with a few added or left out (an eval-only ``contiguous``, BatchNorm's counter update).

Names do not say which nodes are the same: fx and torch.export name nodes by operator and count,
so one node left out renames every later node of its operator (without BatchNorm's counter update,
a model's own ``self.count.add_(1)`` takes that update's name). :func:`matched_nodes` pairs nodes
by what they compute instead: the same operator on the same constants and on inputs that are
themselves paired (model inputs, parameters and buffers by name). :func:`stage_assignment` gives
each node the stage of its pair, and a node without one the stage of its latest input; a node that
would read from a later stage moves to that stage, so the assignment runs in stage order. The
nodes that access one written parameter or buffer run on one stage (so micro-batches see the state
in order, as the model run on the same micro-batches does; :mod:`torchplace.profiling.effects`),
and nodes that in-place writes tie to one device must end up on one device; if they do not, the
carried-over placement is refused.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

from torch import fx
from torch.utils import _pytree as pytree

from torchplace.errors import UnsupportedError
from torchplace.fxutil import is_compute
from torchplace.profiling.effects import Effects

__all__ = ["matched_nodes", "stage_assignment"]


def matched_nodes(graph: fx.Graph, reference: fx.Graph) -> dict[str, str]:
    """Each compute node of ``graph`` that has a counterpart in ``reference`` -> its name.

    Nodes are paired in graph order, each reference node once, by the first of these that finds an
    unpaired one (among several, the one of the same name, else the first in graph order):

    1. the same operator on the same constants and on paired inputs (a placeholder or attribute
       pairs with the one of its name): the node computes the same thing;
    2. the same, constants aside (dropout's ``training`` flag, batch norm's);
    3. the same operator in the same module, as often called there before (a node whose input
       has no counterpart: what follows a batch norm that eval mode computes by another operator);
    4. the same operator under the same name.
    """
    tiers = (_computes, _shape_of, _in_module, _named)
    pools: list[dict[Hashable, list[str]]] = [{} for _ in tiers]
    reference_places = _places(reference)
    for n in reference.nodes:
        if is_compute(n):
            for pool, key in zip(pools, tiers):
                pool.setdefault(key(n, lambda a: a.name, reference_places), []).append(n.name)
    matched: dict[str, str] = {}
    taken: set[str] = set()

    def name_of(a: fx.Node) -> str:
        return matched.get(a.name, f"<unmatched {a.name}>") if is_compute(a) else a.name

    places = _places(graph)
    for n in graph.nodes:
        if not is_compute(n):
            continue
        for pool, key in zip(pools, tiers):
            free = [name for name in pool.get(key(n, name_of, places), ()) if name not in taken]
            if free:
                matched[n.name] = n.name if n.name in free else free[0]
                taken.add(matched[n.name])
                break
    return matched


_Names = Callable[[fx.Node], str]


def _operator(node: fx.Node) -> tuple[str, Hashable]:
    try:
        hash(node.target)
        return node.op, node.target
    except TypeError:
        return node.op, repr(node.target)


def _places(graph: fx.Graph) -> dict[fx.Node, Hashable]:
    """Each compute node's module (the innermost of its ``nn_module_stack``), operator, and how
    many nodes of that operator the module ran before it."""
    seen: dict[Hashable, int] = {}
    out: dict[fx.Node, Hashable] = {}
    for n in graph.nodes:
        if is_compute(n):
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            key = (stack[-1][0] if stack and isinstance(stack[-1], tuple) else "", _operator(n))
            seen[key] = seen.get(key, -1) + 1
            out[n] = (key, seen[key])
    return out


def _computes(node: fx.Node, name_of: _Names, places: Mapping[fx.Node, Hashable]) -> Hashable:
    return _operator(node), repr(pytree.tree_map_only(fx.Node, name_of, (node.args, node.kwargs)))


def _shape_of(node: fx.Node, name_of: _Names, places: Mapping[fx.Node, Hashable]) -> Hashable:
    inputs = pytree.tree_map(lambda a: name_of(a) if isinstance(a, fx.Node) else "", (node.args, node.kwargs))
    return _operator(node), repr(inputs)


def _in_module(node: fx.Node, name_of: _Names, places: Mapping[fx.Node, Hashable]) -> Hashable:
    return places[node]


def _named(node: fx.Node, name_of: _Names, places: Mapping[fx.Node, Hashable]) -> Hashable:
    return node.name, _operator(node)


def stage_assignment(graph: fx.Graph, effects: Effects, reference: fx.Graph, known: Mapping[str, int],
                     devices: Sequence[str]) -> dict[str, int]:
    """The stage of every compute node of ``graph``, carried over from ``reference``'s placement.

    Args:
        graph: the graph to place.
        effects: its in-place writes (ordering edges; nodes that must share a stage or a device).
        reference: the graph that was placed (:func:`matched_nodes` pairs their nodes).
        known: stage index of ``reference``'s nodes, by name.
        devices: the device of each stage.

    Raises:
        UnsupportedError: if nodes that in-place writes tie to one device land on several.
    """
    carried = {name: known[ref] for name, ref in matched_nodes(graph, reference).items() if ref in known}
    floor: dict[str, int] = {}
    while True:
        stage: dict[str, int] = {}
        for n in graph.nodes:
            if not is_compute(n):
                continue
            inputs = [stage[a.name] for a in n.all_input_nodes if a.name in stage]
            inputs += [stage[u] for u in effects.after.get(n.name, ()) if u in stage]
            lowest = max([*inputs, floor.get(n.name, 0)])
            stage[n.name] = max(carried.get(n.name, lowest), lowest)
        raised = False
        for members in effects.merged:  # a written parameter's or buffer's accessors: one stage, the latest
            top = max((stage[m] for m in members if m in stage), default=0)
            for m in members:
                if m in stage and stage[m] < top:
                    floor[m], raised = top, True
        if not raised:  # floors only rise, at most to the last stage: this ends
            break
    for members in effects.colocated:
        on = {devices[stage[m]] for m in members if m in stage}
        if len(on) > 1:
            raise UnsupportedError(
                f"the placement cannot be carried over to the model's other mode: in-place writes tie "
                f"{sorted(members)[:3]} to one device, but they land on {sorted(on)}; place the model for that "
                "mode separately (torchplace.place(..., mode='inference'))"
            )
    return stage
