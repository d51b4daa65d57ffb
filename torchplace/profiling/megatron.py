"""Megatron-LM's tensor-parallel split of a traced model's attention and MLP blocks
(Shoeybi et al., "Megatron-LM", 2019, Sec. 3, Fig. 3), found on a forward OpGraph.

Megatron splits a transformer's MLP ``Y = GeLU(X A)``, ``Z = Y B`` by giving each of ``t`` devices
the columns ``A_i`` of the first linear (*column-parallel*: no communication, ``GeLU`` applies to
each device's part) and the matching rows ``B_i`` of the second (*row-parallel*): each device
computes a partial ``Y_i B_i`` and one all-reduce sums them (operator ``g``). Attention is split the
same way by heads: the query/key/value projections are column-parallel, each device runs the
attention of its ``heads / t`` heads, and the output projection is row-parallel. The backward pass
mirrors it: one all-reduce of the gradient of the block's input (operator ``f``). Layer norms,
residual additions and dropout after the block are replicated on every device (Sec. 3, end).

A *Megatron pair* here is a row linear ``R`` and its column linears ``C``: the linear operators
(matrix products, :data:`LINEAR_OPS`, reading a trainable 2-D weight) that reach ``R`` through non-linear operators only, all in
one layer (:func:`torchplace.profiling.tmpc.layers`), where the operators in between (the
*region*: descendants of ``C`` that reach ``R``) contain no normalisation or reduction
(``layer_norm``, ``mean``, ``sum``, ...): such an operator needs the whole hidden dimension, so
``X A`` may not be split by columns before it. This finds GPT-2's and BERT's attention
(``c_attn -> c_proj``; ``query, key, value -> attention.output.dense``) and MLP (``c_fc -> c_proj``;
``intermediate.dense -> output.dense``) and refuses ``attn.c_proj -> mlp.c_fc``, which a layer
norm separates. Pairs are taken greedily in topological order of ``R``; a linear belongs to at most
one pair (linears of earlier pairs are not columns: traced graphs can reach them through shape
computations). A pair splits ``t`` ways when ``t`` divides every dimension of its weights and the head
count of every module of its region that has one (``num_heads``, ``num_attention_heads``,
``n_head``).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from torchplace.graph import OpGraph

__all__ = ["BLOCKING_OPS", "LINEAR_OPS", "MegatronPair", "linear_weights", "megatron_pairs"]

BLOCKING_OPS = ("layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm", "native_norm",
                ".mean", ".sum", ".var", ".std", ".norm", "linalg_vector_norm")
"""Operators (substrings of ``NodeRecord.op``) that read the whole hidden dimension: a column split
may not run through them."""


@dataclass(frozen=True)
class MegatronPair:
    """One split block: ``columns`` (column-parallel linears), ``region`` (operators between, split
    by heads or columns), ``row`` (the row-parallel linear whose output is all-reduced), and the
    degrees ``t`` it splits into."""

    columns: tuple[str, ...]
    region: tuple[str, ...]
    row: str
    degrees: tuple[int, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node whose work, weights and activations are divided by ``t``."""
        return (*self.columns, *self.region, self.row)


def linear_weights(graph: OpGraph, shapes: Mapping[str, Sequence[int]]) -> dict[str, list[tuple[int, ...]]]:
    """The 2-D trainable weights each forward node reads (``meta["state"]`` readers), by node."""
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, entry in (graph.meta.get("state") or {}).items():
        shape = tuple(shapes.get(name, ()))
        if not entry.get("trainable") or len(shape) != 2:
            continue
        for v in entry.get("readers") or ():
            if v in graph:
                out.setdefault(v, []).append(shape)
    return out


LINEAR_OPS = ("addmm", "linear", "aten.mm.", "matmul", "conv1d")
"""Operators (substrings of ``NodeRecord.op``, lower case) that are linears when they read a 2-D weight."""


def _linear(graph: OpGraph, v: str, weights: Mapping[str, Sequence[tuple[int, ...]]]) -> bool:
    op = graph.record(v).op.lower()
    return bool(weights.get(v)) and any(k in op for k in LINEAR_OPS)


def _blocking(graph: OpGraph, v: str) -> bool:
    op = graph.record(v).op
    return any(b in op for b in BLOCKING_OPS)


def _descendants(graph: OpGraph, starts: Collection[str], within: Collection[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(starts)
    while stack:
        u = stack.pop()
        for w in graph.successors(u):
            if w in within and w not in seen:
                seen.add(w)
                stack.append(w)
    return seen


def _heads_of(graph: OpGraph, nodes: Collection[str], heads: Mapping[str, int]) -> set[int]:
    """Head counts of the modules (or their ancestors) that own ``nodes``."""
    out: set[int] = set()
    for v in nodes:
        module = graph.record(v).module
        while True:
            if module in heads:
                out.add(heads[module])
                break
            if not module:
                break
            module = module.rpartition(".")[0]
    return out


def megatron_pairs(graph: OpGraph, layer: Sequence[str], weights: Mapping[str, Sequence[tuple[int, ...]]],
                   heads: Mapping[str, int], degrees: Sequence[int] = (2, 4, 8)) -> list[MegatronPair]:
    """The Megatron pairs among the forward nodes ``layer`` (in topological order; module docstring).

    Args:
        graph: the forward OpGraph (edges between forward nodes).
        layer: the nodes of one layer, topologically ordered.
        weights: :func:`linear_weights`.
        heads: head count by module path.
        degrees: the ``t > 1`` to try.
    """
    members = set(layer)
    linears = [v for v in layer if _linear(graph, v, weights)]
    used: set[str] = set()
    pairs: list[MegatronPair] = []
    for row in linears:
        if row in used:
            continue
        columns, visited, stack = set(), set(), [u for u in graph.predecessors(row) if u in members]
        while stack:
            u = stack.pop()
            if u in visited:
                continue
            visited.add(u)
            if _linear(graph, u, weights):
                columns.add(u)
                continue
            stack.extend(w for w in graph.predecessors(u) if w in members)
        columns -= used  # a linear of an earlier pair reached through a size computation or a residual
        region = (visited - columns) & _descendants(graph, columns, members)
        if not columns or any(_blocking(graph, v) for v in region):
            continue
        dims = [d for v in (*columns, row) for shape in weights[v] for d in shape]
        counts = _heads_of(graph, region, heads)
        ok = tuple(t for t in degrees if all(d % t == 0 for d in dims) and all(h % t == 0 for h in counts))
        order = {v: i for i, v in enumerate(layer)}
        pairs.append(MegatronPair(tuple(sorted(columns, key=order.__getitem__)),
                                  tuple(sorted(region, key=order.__getitem__)), row, ok))
        used |= columns | {row}
    return pairs
