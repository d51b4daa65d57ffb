"""Fusion: coarsen an OpGraph before solving, and map plans back.

MOIRAI's graph coarsening with operator fusion (:mod:`.gcof`, rules in :mod:`.rules`) and Baechi's
co-placement with cycle-safe merging (:mod:`.coplace`), behind one front door, :func:`coarsen`
(:mod:`.coarsen`). Nothing here imports torch.
"""
from torchplace.fusion.coarsen import Coarsening, CoarseningReport, coarsen
from torchplace.fusion.coplace import (
    Quotient,
    coplace,
    default_max_group_time,
    merge_nodes,
    merge_records,
)
from torchplace.fusion.gcof import gcof
from torchplace.fusion.rules import DEFAULT_RULES, Rule, op_kind

__all__ = [
    "DEFAULT_RULES",
    "Coarsening",
    "CoarseningReport",
    "Quotient",
    "Rule",
    "coarsen",
    "coplace",
    "default_max_group_time",
    "gcof",
    "merge_nodes",
    "merge_records",
    "op_kind",
]
