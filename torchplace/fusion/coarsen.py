"""The fusion front door: coarsen an OpGraph, solve on the coarse graph, expand the plan back.

:func:`coarsen` runs MOIRAI's GCOF (fusion rules, then injective fusion) and Baechi's co-placement
(colocation fusion, then single-consumer fusion under a work cap) on one
:class:`~torchplace.fusion.coplace.Quotient`, and returns a :class:`Coarsening` that maps plans on
the coarse graph back to the original one.

Why a cap. Co-placement alone would turn a chain model into a single node that cannot be split,
since every edge of a chain is single-consumer. And while MOIRAI fuses by rules without limit (the
backend runs a fused group as one kernel, so splitting it would cost), torchplace's runtime runs
the original operators one by one: a group's time is the sum of its members', and a coarse graph
only helps the solvers search, at the price of coarser splits. So by default no merge (rule,
injective or single-consumer) may create a group whose work exceeds ``total work / (4 * devices)``
(:func:`~torchplace.fusion.coplace.default_max_group_time`; 8 devices when none are given). On a
chain of total work ``W`` split over ``k`` identical devices (transfers aside), consecutive groups
can then be cut into ``k`` runs of at most ``W / k`` plus one group, so the coarse graph still
admits a split at most 25% above ``W / k`` (plus whatever a single original node already exceeds
the cap by). Colocation fusion is not capped, since colocated nodes share a device anyway.

Example:
    >>> from torchplace.graph import NodeRecord, OpGraph
    >>> g = OpGraph()
    >>> ops = ["conv2d", "batch_norm", "relu", "conv2d", "batch_norm", "relu", "linear", "relu"]
    >>> for i, op in enumerate(ops):
    ...     g.add_node(f"n{i}", NodeRecord(f"n{i}", op=f"call_function:aten.{op}.default", times={"cpu": 1.0}))
    ...     if i: g.add_edge(f"n{i - 1}", f"n{i}")
    >>> c = coarsen(g, devices=1)           # cap 8 / 4 = 2: conv+bn+relu (3) is cut to conv+bn
    >>> print(c.report())
    before: 8 nodes, 7 edges; after: 5 nodes, 4 edges (rule 3; largest group 2 nodes)
    >>> c.expand({"n0": "cuda:0", "n2": "cuda:0", "n3": "cpu", "n5": "cpu", "n6": "cpu"})["n1"]
    'cuda:0'

    With a problem: ``coarse_plan = solvers.solve(c.coarse_problem(problem))``, then
    ``plan = c.expand_plan(coarse_plan, problem, lower_bound=bound)``.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

from torchplace.fusion.coplace import (
    Quotient,
    coplace_colocated,
    coplace_single_consumer,
    default_max_group_time,
    merge_nodes,
)
from torchplace.fusion.gcof import fuse_injective, fuse_rules
from torchplace.fusion.rules import DEFAULT_RULES, Rule
from torchplace.graph import OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Coarsened, Problem

__all__ = ["Coarsening", "CoarseningReport", "coarsen"]


@dataclass(frozen=True)
class CoarseningReport:
    """Sizes before and after coarsening (as in MOIRAI Table IV) and merges per step."""

    nodes_before: int
    edges_before: int
    nodes_after: int
    edges_after: int
    merges: Mapping[str, int]
    largest_group: int

    def __str__(self) -> str:
        steps = ", ".join(f"{k} {n}" for k, n in self.merges.items() if n)
        return (f"before: {self.nodes_before} nodes, {self.edges_before} edges; after: {self.nodes_after} nodes, "
                f"{self.edges_after} edges ({steps or 'no merges'}; largest group {self.largest_group} nodes)")


@dataclass(frozen=True)
class Coarsening:
    """A coarse graph and the way back to the original.

    Attributes:
        original: the graph that was coarsened.
        graph: the coarse DAG; its node ids are original ids (each group's first member).
        mapping: coarse id -> original ids, in topological order; every original id once.
        merges: merges made per step (``"rule"``, ``"injective"``, ``"colocation"``,
            ``"single-consumer"``).
        max_group_time: the work cap that rule, injective and single-consumer merges obeyed.
    """

    original: OpGraph
    graph: OpGraph
    mapping: Mapping[str, tuple[str, ...]]
    merges: Mapping[str, int] = field(default_factory=dict)
    max_group_time: float = math.inf

    @overload
    def expand(self, placement: Mapping[str, str]) -> dict[str, str]: ...

    @overload
    def expand(self, placement: Plan | Sequence[Stage]) -> list[Stage]: ...

    def expand(self, placement: Any) -> Any:
        """A placement of the coarse graph as one of the original graph.

        Args:
            placement: an assignment ``coarse id -> device``, a sequence of :class:`Stage` s, or a
                :class:`Plan` (its stages).

        Returns:
            ``original id -> device`` for an assignment; otherwise the stages in the same order,
            each holding its coarse nodes' originals in the original graph's topological order.

        Raises:
            KeyError: naming a node that is not a coarse node.
        """
        if isinstance(placement, Mapping):
            return {v: dev for c, dev in placement.items() for v in self._members(c)}
        stages = placement.stages if isinstance(placement, Plan) else placement
        pos = {v: i for i, v in enumerate(self.original.topological_order())}
        return [
            Stage(s.device, tuple(sorted((v for c in s.nodes for v in self._members(c)), key=pos.__getitem__)))
            for s in stages
        ]

    def _members(self, coarse_id: str) -> tuple[str, ...]:
        if coarse_id not in self.mapping:
            raise KeyError(f"{coarse_id!r} is not a node of the coarse graph ({len(self.mapping)} nodes)")
        return self.mapping[coarse_id]

    def coarse_problem(self, problem: Problem) -> Problem:
        """``problem`` with the coarse graph in place of ``problem.graph`` (which must be ``original``).

        Its liveness memory stays the original graph's (``Problem.coarsened``): a merged record
        cannot say when each of its members' outputs dies, and charging them all at once
        over-counted GPT-2's devices 2.3x."""
        if problem.graph is not self.original and problem.graph != self.original:
            raise ValueError("the problem's graph is not the graph this coarsening was made from")
        return replace(problem, graph=self.graph, coarsened=Coarsened(self.original, self.graph, self.mapping))

    def _coarse_state(self) -> dict[str, Any]:
        """``meta["state"]`` with owners and readers as coarse nodes (readers merged into one node
        with the owner no longer hold a copy of their own)."""
        group = {v: c for c, members in self.mapping.items() for v in members}
        state = {}
        for name, e in (self.original.meta.get("state") or {}).items():
            owner = group.get(e["owner"], e["owner"]) if e.get("owner") is not None else None
            readers = list(dict.fromkeys(group[v] for v in e.get("readers", ()) if v in group))
            state[name] = {**e, "owner": owner, "readers": readers}
        return state

    def expand_plan(self, plan: Plan, problem: Problem, *, lower_bound: float = 0.0) -> Plan:
        """``plan`` (solved on :meth:`coarse_problem`) as a validated plan of ``problem``.

        The objective is re-evaluated on the original graph. The coarse plan's bound and proof of
        optimality hold only for plans that keep every group together, so the result is marked
        ``"feasible"`` and carries ``lower_bound``: pass a bound for the original problem (e.g.
        ``torchplace.solvers.bounds.simple_lower_bound(problem)``); the default 0 is always valid.

        Raises:
            InvalidPlanError: if the expanded plan breaks a constraint of ``problem``.
        """
        meta = {**plan.meta, "coarse_objective": plan.objective, "coarse_status": plan.status,
                "coarse_lower_bound": plan.lower_bound, "coarsening": str(self.report())}
        return Plan.build(problem, self.expand(plan), solver=f"{plan.solver}+coarsen", seconds=plan.seconds,
                          lower_bound=lower_bound, status="feasible", meta=meta)

    def report(self) -> CoarseningReport:
        return CoarseningReport(
            nodes_before=len(self.original), edges_before=self.original.nx.number_of_edges(),
            nodes_after=len(self.graph), edges_after=self.graph.nx.number_of_edges(),
            merges=dict(self.merges), largest_group=max((len(m) for m in self.mapping.values()), default=0),
        )


def coarsen(
    graph: OpGraph,
    *,
    rules: bool | Iterable[Rule] = True,
    injective: bool = True,
    coplace: bool = True,
    max_group_time: float | None = None,
    devices: int | None = None,
) -> Coarsening:
    """Coarsen ``graph``: MOIRAI GCOF, then Baechi co-placement.

    Args:
        graph: the operator graph (profiled or not; without times, work is counted in nodes).
        rules: ``True`` for :data:`~torchplace.fusion.rules.DEFAULT_RULES`, ``False`` for none,
            or the rules to use.
        injective: fuse element-wise and layout operators into neighbours (GCOF step 2).
        coplace: fuse colocated neighbours and single-consumer edges (Baechi Sec. 3.2-3.3).
        max_group_time: largest work (slowest-kind seconds; nodes, for a graph without times) a
            rule, injective or single-consumer merge may create; ``None``:
            ``total work / (4 * devices)``; ``math.inf``: no cap (MOIRAI's and Baechi's rules as
            published).
        devices: number of devices the plan will use, for the default cap (8 if ``None``).

    Returns:
        A :class:`Coarsening`; its graph is a DAG and covers every original node exactly once.
    """
    q = Quotient(graph)
    cap = default_max_group_time(q.total_work(), devices) if max_group_time is None else max_group_time
    if rules is not False:
        fuse_rules(q, DEFAULT_RULES if rules is True else tuple(rules), cap)
    if injective:
        fuse_injective(q, cap)
    if coplace:
        coplace_colocated(q)
        coplace_single_consumer(q, cap)
    coarse, mapping = merge_nodes(graph, q.groups())
    result = Coarsening(graph, coarse, mapping, dict(q.merges), cap)
    if "state" in graph.meta:
        coarse.meta["state"] = result._coarse_state()
    return result
