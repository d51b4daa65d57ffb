"""Carry a placement over to another trace of the same model (its eval-mode graph).

A model placed for training is traced in training mode: dropout and BatchNorm's batch statistics
are part of its graph. Its eval-mode graph is a second trace whose nodes are almost all the same
(fx and torch.export name nodes by operator and count, so most names match) with a few added or
left out (an eval-only ``contiguous``, BatchNorm's counter update). :func:`stage_assignment` gives
each node of the second graph the stage of the same-named node of the first, and a node without one
the stage of its latest input; a node that would read from a later stage moves to that stage, so the
assignment runs in stage order. Nodes that must share a device because of in-place writes must end
up on one device; if they do not, the carried-over placement is refused.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import fx

from torchplace.errors import UnsupportedError
from torchplace.fxutil import is_compute
from torchplace.profiling.effects import Effects

__all__ = ["stage_assignment"]


def stage_assignment(graph: fx.Graph, effects: Effects, known: Mapping[str, int], devices: Sequence[str]) -> dict[str, int]:
    """The stage of every compute node of ``graph``, from the stages ``known`` by node name.

    Args:
        graph: the graph to place.
        effects: its in-place writes (ordering edges; sets that must share a device).
        known: stage index by node name, from the placement being carried over.
        devices: the device of each stage.

    Raises:
        UnsupportedError: if nodes that in-place writes tie to one device land on several.
    """
    stage: dict[str, int] = {}
    for n in graph.nodes:
        if not is_compute(n):
            continue
        inputs = [stage[a.name] for a in n.all_input_nodes if a.name in stage]
        inputs += [stage[u] for u in effects.after.get(n.name, ()) if u in stage]
        lowest = max(inputs, default=0)
        stage[n.name] = max(known.get(n.name, lowest), lowest)
    for members in effects.colocated:
        on = {devices[stage[m]] for m in members if m in stage}
        if len(on) > 1:
            raise UnsupportedError(
                f"the placement cannot be carried over to the model's other mode: in-place writes tie "
                f"{sorted(members)[:3]} to one device, but they land on {sorted(on)}; place the model for that "
                "mode separately (torchplace.place(..., mode='inference'))"
            )
    return stage
