"""Order the pieces of a placement into stages that can run one after another."""
from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from torchplace.errors import InvalidPlanError
from torchplace.graph import OpGraph
from torchplace.plan import Stage

__all__ = ["order_stages"]


def order_stages(graph: OpGraph, stages: Sequence[Stage]) -> list[Stage]:
    """Stages sorted so every edge goes from the same or an earlier stage (stable: ties keep order).

    Raises:
        InvalidPlanError: if the stages feed each other in a cycle.
    """
    stage_of = {v: i for i, s in enumerate(stages) for v in s.nodes}
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(len(stages)))
    quotient.add_edges_from((stage_of[u], stage_of[v]) for u, v in graph.edges if stage_of[u] != stage_of[v])
    try:
        order = list(nx.lexicographical_topological_sort(quotient))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(quotient)
        raise InvalidPlanError(f"stages feed each other in a cycle {cycle}; no stage order exists") from None
    return [stages[i] for i in order]
