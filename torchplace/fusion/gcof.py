"""MOIRAI's graph coarsening with operator fusion, GCOF (Zhang et al. 2023, Sec. III-B, Algorithm 1).

Algorithm 1 walks the graph depth first; along an edge ``v_pred -> v_succ`` it *binds* the pair if
their types start a fusion rule (``is_sub_rule``), *fuses* it once the bound types form a whole
rule (``is_rule``), and finally *unbinds* pairs that never completed one. Both need the edge to be a
valid connection (``is_valid_conn``): a *direct* or *multi-input* connection, never a
*multi-output* one, i.e. ``v_succ`` is the only reader of ``v_pred``'s output.

Here the same is done in two explicit steps, so that the result does not depend on where a
traversal starts:

1. :func:`rule_matches` follows valid connections from every node while the kinds seen so far
   start some rule (bind), keeps the longest whole rule among them (fuse; the rest is unbound), and
   picks disjoint matches longest first, ties by topological position.
2. :func:`fuse_injective` (TVM's rule for injective operators, an extension of MOIRAI's table):
   along a valid connection, an element-wise or layout consumer joins its producer, and a layout
   producer joins its consumer, until nothing changes.

A valid connection is the only way out of its producer, so no merge here can close a cycle
(Baechi Sec. 3.3); :class:`~torchplace.fusion.coplace.Quotient` checks it anyway.

Example:
    >>> from torchplace.graph import NodeRecord, OpGraph
    >>> g = OpGraph()
    >>> for v, op in [("c", "aten.conv2d.default"), ("b", "aten.batch_norm.default"), ("r", "aten.relu.default")]:
    ...     g.add_node(v, NodeRecord(v, op=f"call_function:{op}"))
    >>> g.add_edge("c", "b"); g.add_edge("b", "r")
    >>> coarse, mapping = gcof(g)
    >>> mapping
    {'c': ('c', 'b', 'r')}
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from torchplace.fusion.coplace import Quotient, merge_nodes, merge_single_successors
from torchplace.fusion.rules import DEFAULT_RULES, INJECTIVE, LAYOUT, Rule, op_kind
from torchplace.graph import OpGraph

__all__ = ["fuse_injective", "fuse_rules", "gcof", "rule_matches"]


def _kinds(q: Quotient) -> dict[str, str]:
    return {v: op_kind(r.op) for v, r in q.graph.records()}


@dataclass(frozen=True)
class _RuleIndex:
    """Every rule's kinds (``whole``) and every prefix of them (``prefixes``), for O(1) lookups."""

    whole: frozenset[tuple[str, ...]]
    prefixes: frozenset[tuple[str, ...]]

    @classmethod
    def of(cls, rules: Sequence[Rule]) -> _RuleIndex:
        return cls(frozenset(r.steps for r in rules),
                   frozenset(r.steps[:n] for r in rules for n in range(1, len(r) + 1)))


def _walk(q: Quotient, kinds: dict[str, str], start: str, index: _RuleIndex, cap: float) -> tuple[str, ...]:
    """The longest whole rule of work at most ``cap`` matched by a chain of valid connections from
    ``start`` (or ``()``)."""
    chain, seq = [start], [kinds[start]]
    while True:
        a = chain[-1]
        successors = q.successors(a)
        if len(successors) != 1:
            break
        b = next(iter(successors))
        if len(q.members(b)) > 1 or not q.valid_connection(a, b):
            break
        if not q.compatible(a, b):  # one colocation label, direction and set of kinds for all
            break
        if (*seq, kinds[b]) not in index.prefixes:  # is_sub_rule
            break
        chain.append(b)  # bind
        seq.append(kinds[b])
    work = list(itertools.accumulate(q.work(v) for v in chain))
    whole = max((n for n in range(2, len(seq) + 1) if tuple(seq[:n]) in index.whole and work[n - 1] <= cap), default=0)
    return tuple(chain[:whole])  # is_rule; the bound tail beyond the longest whole rule is unbound


def rule_matches(
    q: Quotient, rules: Sequence[Rule] = DEFAULT_RULES, max_group_time: float = math.inf
) -> list[tuple[str, ...]]:
    """Disjoint rule matches among ``q``'s single-node groups (step 1), in topological order; a
    match's work is at most ``max_group_time``."""
    kinds, index = _kinds(q), _RuleIndex.of(rules)
    singles = [v for v in q.roots() if len(q.members(v)) == 1]
    found = [m for v in singles if len(m := _walk(q, kinds, v, index, max_group_time)) > 1]
    found.sort(key=lambda m: (-len(m), q.pos[m[0]]))
    used: set[str] = set()
    chosen = []
    for m in found:
        if used.isdisjoint(m):
            used.update(m)
            chosen.append(m)
    return sorted(chosen, key=lambda m: q.pos[m[0]])


def fuse_rules(q: Quotient, rules: Sequence[Rule] = DEFAULT_RULES, max_group_time: float = math.inf) -> None:
    """Step 1: merge every match of :func:`rule_matches` (merge step ``"rule"``)."""
    for match in rule_matches(q, rules, max_group_time):
        root = match[0]
        for v in match[1:]:
            root = q.merge(root, v, "rule")


def fuse_injective(q: Quotient, max_group_time: float = math.inf) -> None:
    """Step 2: along valid connections, fold injective consumers into their producer and layout
    producers into their consumer (merge step ``"injective"``) while the merged work is at most
    ``max_group_time``, until nothing changes."""
    kinds = _kinds(q)

    def accept(a: str, b: str) -> bool:
        return q.compatible(a, b) and (
            all(kinds[m] in LAYOUT for m in q.members(a)) or all(kinds[m] in INJECTIVE for m in q.members(b)))

    merge_single_successors(q, "injective", max_group_time, accept)


def gcof(
    graph: OpGraph,
    rules: Sequence[Rule] = DEFAULT_RULES,
    *,
    injective: bool = True,
    max_group_time: float = math.inf,
) -> tuple[OpGraph, dict[str, tuple[str, ...]]]:
    """Coarsen ``graph`` by operator fusion (MOIRAI Algorithm 1, see the module docstring).

    Args:
        graph: the operator graph.
        rules: fusion rules (:data:`~torchplace.fusion.rules.DEFAULT_RULES`).
        injective: also run step 2, TVM's fusion of element-wise and layout operators.
        max_group_time: no group made here exceeds this work (MOIRAI has no such cap; see
            :func:`torchplace.fusion.coarsen.coarsen` for why torchplace wants one).

    Returns:
        ``(coarse, mapping)`` as :func:`~torchplace.fusion.coplace.merge_nodes`: the coarse DAG
        and ``coarse id -> original ids``.
    """
    q = Quotient(graph)
    fuse_rules(q, rules, max_group_time)
    if injective:
        fuse_injective(q, max_group_time)
    return merge_nodes(graph, q.groups())
