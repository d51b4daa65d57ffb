"""Piper's input from a real model: layers and TMPCs of a profiled training graph (Tarnawski,
Narayanan, Phanishayee 2021, Sec. 3.3-3.6 and App. A-B).

:func:`piper_problem` turns the training OpGraph of :func:`torchplace.profiling.training.training_graph`
(forward nodes with forward time, saved activations and weights; ``v:backward`` nodes with backward
time, gradients and optimizer state) into a Problem with a
:class:`~torchplace.problem.Parallel` setting, which :func:`torchplace.solvers.piper.solve` plans.

**Layers** (Piper works on a layer graph, Sec. 3.6): a forward operator belongs to the block whose
module path it lies under up to the first numeric component (``transformer.h.3``,
``bert.encoder.layer.3``, ``3`` in an ``nn.Sequential``); operators outside every block go to
``input`` when no block operator reaches them (embeddings) and to ``output`` when they reach no
block operator (final norm, head, loss), else to the block of their latest predecessor. Layers that
would form a cycle are merged (strongly connected components), so the layer graph is a DAG. The
edge ``c(U, W)`` is the bytes of the outputs of ``U``'s operators that ``W`` reads (each tensor once),
counted per fx node when the traced model's tensor sizes are given (:func:`fx_outputs`: a graph
node that groups several fx nodes, e.g. a mask computed beside layer 0's attention, then counts only
the tensors another layer reads), else per graph node.

**TMPCs** for ``t`` in ``degrees`` (at most the device count), the example call being one
micro-batch (Piper's unit of work; ``microbatches`` is ``N``, the most micro-batches of a batch):

- ``t = 1``, ``"vanilla"``: ``p`` = measured forward + backward seconds of the layer's operators;
  ``w`` = bytes of its trainable weights (what data parallelism all-reduces: the gradients);
  ``a`` = saved activations; ``b`` = weights, buffers, gradients and optimizer state.
- ``t > 1`` (Megatron, :mod:`torchplace.profiling.megatron`): the operators of a Megatron pair take
  ``1/t`` of their time, weights, gradients, optimizer state and saved activations; every other
  operator is replicated (full cost on each of the ``t`` devices; so a layer without a pair can
  join a tensor-parallel stage at no gain). Each pair adds two ring all-reduces of the row linear's
  output per micro-batch (``g`` forward, ``f`` backward), ``2 (t - 1)/t`` bytes each per device at
  ``tensor_bandwidth``. A layer is offered at ``t`` only if each of its pairs splits ``t`` ways,
  and ``t`` only if some layer splits ``t`` ways (GPT-2 small's 12 heads: ``t`` in 1, 2, 4). As in
  the authors' workloads (App. B), ``c^fw(u, v) = c(u, v)`` and ``c^bw(v, w) = c(v, w)`` for
  ``t > 1`` (the tensor reaches one device and is spread to all ``t``), 0 for ``t = 1``.
- ``"activation recomp"`` for each ``t`` (App. A): the forward runs again before the backward
  (``p`` adds the forward seconds and one more forward all-reduce per pair); ``a`` is the layer's
  input bytes (its stash per micro-batch in flight), and ``b`` adds the recomputed activations of
  one micro-batch beyond that stash.

Weights read by a layer that does not own them (tied embeddings: GPT-2's ``lm_head``) count as a
copy in that layer (memory, and gradients all-reduced under data parallelism), as Megatron keeps
them on the first and last stage; the all-reduce that keeps the copies equal, once per batch, adds
``w / (N B)`` to its ``p`` (an overestimate when both land on one stage).
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from torchplace.devices import Cluster, Device
from torchplace.errors import UsageError
from torchplace.graph import TMPC, NodeRecord, OpGraph
from torchplace.problem import Parallel, Problem
from torchplace.profiling.megatron import MegatronPair, linear_weights, megatron_pairs

__all__ = ["DEGREES", "LayerCost", "fx_outputs", "heads_by_module", "layers", "parameter_shapes", "piper_problem"]

DEGREES = (1, 2, 4, 8)
"""Tensor-parallel degrees offered by default (Piper's evaluation, Sec. 5)."""


def _block(module: str) -> str | None:
    """The module path up to its first numeric component, or ``None``."""
    parts = module.split(".") if module else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _forward(graph: OpGraph) -> OpGraph:
    out = OpGraph(meta=graph.meta)
    fwd = [v for v, r in graph.records() if not r.backward]
    for v in fwd:
        out.add_node(v, graph.record(v))
    keep = set(fwd)
    for u, v in graph.edges:
        if u in keep and v in keep:
            out.add_edge(u, v)
    return out


def layers(forward: OpGraph) -> dict[str, list[str]]:
    """The layers of a forward OpGraph (module docstring): ``{layer id: nodes in topological order}``,
    layers in topological order of the layer graph."""
    order = forward.topological_order()
    labels = {v: _block(forward.record(v).module) for v in order}
    blocks = [v for v in order if labels[v] is not None]
    g = forward.nx
    below: set[str] = set().union(*(nx.descendants(g, v) for v in blocks)) if blocks else set()
    above: set[str] = set().union(*(nx.ancestors(g, v) for v in blocks)) if blocks else set()
    first: dict[str, int] = {}
    group: dict[str, str] = {}
    for i, v in enumerate(order):
        label = labels[v]
        if label is None:
            if v not in below:
                label = "input"
            elif v not in above:
                label = "output"
            else:
                label = max((group[u] for u in forward.predecessors(v)), key=lambda x: first[x])
        group[v] = label
        first.setdefault(label, i)
    quotient = nx.DiGraph()
    quotient.add_nodes_from(group.values())
    quotient.add_edges_from((group[u], group[v]) for u, v in forward.edges if group[u] != group[v])
    merged = nx.condensation(quotient)
    names = {}
    for c in merged.nodes:
        members = sorted(merged.nodes[c]["members"], key=lambda x: first[x])
        names[c] = "+".join(members)
    out: dict[str, list[str]] = {}
    for c in nx.lexicographical_topological_sort(merged, key=lambda c: min(first[x] for x in merged.nodes[c]["members"])):
        out[names[c]] = []
    member_of = {x: names[c] for c in merged.nodes for x in merged.nodes[c]["members"]}
    for v in order:
        out[member_of[group[v]]].append(v)
    return out


class LayerCost:
    """Sums over one layer's operators for one ``t``: seconds forward and backward, trainable weight
    bytes, other resident bytes (buffers, gradients, optimizer state) and saved activations."""

    def __init__(self) -> None:
        self.forward = self.backward = self.weights = self.resident = self.saved = 0.0

    def add(self, fwd: float, bwd: float, weights: float, resident: float, saved: float, split: int) -> None:
        self.forward += fwd / split
        self.backward += bwd / split
        self.weights += weights / split
        self.resident += resident / split
        self.saved += saved / split


def _trainable(graph: OpGraph) -> tuple[dict[str, float], dict[str, float]]:
    """Trainable bytes each node owns, and trainable bytes each node reads but does not own."""
    owned: dict[str, float] = defaultdict(float)
    borrowed: dict[str, float] = defaultdict(float)
    for entry in (graph.meta.get("state") or {}).values():
        if not entry.get("trainable"):
            continue
        owner = entry.get("owner")
        if owner is not None:
            owned[owner] += entry["bytes"]
        for v in set(entry.get("readers") or ()) - {owner}:
            borrowed[v] += entry["bytes"]
    return owned, borrowed


def _allreduce(nbytes: float, t: int, bandwidth: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``t`` devices: ``2 (t-1)/t`` bytes each."""
    return 2.0 * (t - 1) / t * nbytes / bandwidth


def piper_problem(graph: OpGraph, *, kind: str, devices: int, memory_bytes: float, bandwidth: float,
                  microbatches: int, shapes: Mapping[str, Sequence[int]] | None = None,
                  heads: Mapping[str, int] | None = None, tensor_bandwidth: float | None = None,
                  degrees: Sequence[int] = DEGREES,
                  fx: Mapping[str, tuple[int, Sequence[str]]] | None = None) -> Problem:
    """The Piper problem of a profiled training graph (module docstring).

    Args:
        graph: a training OpGraph (:func:`~torchplace.profiling.training.training_graph`) whose
            times are for one micro-batch.
        kind: the device kind whose times to use (Piper's devices are alike).
        devices, memory_bytes, bandwidth, microbatches: Piper's ``K``, ``M``, ``B`` (stage links and
            the data-parallel all-reduce) and ``N``.
        shapes: parameter shapes by name (``meta["state"]`` names); without them nothing splits.
        heads: attention head counts by module path (``t`` must divide them).
        tensor_bandwidth: bytes/s of the tensor-parallel all-reduces (NVLink within a server in
            the paper); ``None`` means ``bandwidth``.
        degrees: the tensor-parallel degrees to try (1 is always kept).
        fx: :func:`fx_outputs` of the traced model, for exact edge bytes between layers.

    Returns:
        A throughput Problem over the layer graph with TMPCs on every layer and
        ``graph.meta["piper"]``: the operators of each layer and the Megatron pairs found.

    Raises:
        UsageError: a graph without backward nodes, or without times for ``kind``.
    """
    if not any(r.backward for _, r in graph.records()):
        raise UsageError("piper_problem needs a training graph (backward nodes): profile with mode='training'")
    fwd = _forward(graph)
    missing = [v for v, r in fwd.records() if kind not in r.times]
    if missing:
        raise UsageError(f"node {missing[0]!r} has no time for device kind {kind!r}; profile on that kind")
    tensor_bandwidth = bandwidth if tensor_bandwidth is None else tensor_bandwidth
    layer_nodes = layers(fwd)
    weights = linear_weights(fwd, shapes or {})
    wanted = sorted({t for t in degrees if 1 < t <= devices})
    pairs = {name: megatron_pairs(fwd, nodes, weights, heads or {}, wanted) for name, nodes in layer_nodes.items()}
    offered = [1] + [t for t in wanted if any(ps and all(t in p.degrees for p in ps) for ps in pairs.values())]
    member = {v: name for name, nodes in layer_nodes.items() for v in nodes}
    edges = _layer_edges(fwd, member, fx)
    out = OpGraph(meta={"source": "profiled model", "format": "piper",
                        "piper": {"layers": layer_nodes, "degrees": offered,
                                  "pairs": {k: [p.nodes for p in ps] for k, ps in pairs.items()}}})
    prices = _Prices(kind, microbatches, bandwidth, tensor_bandwidth, *_trainable(graph))
    for name, nodes in layer_nodes.items():
        tmpcs = _layer_tmpcs(graph, fwd, name, nodes, pairs[name], offered, edges, prices)
        modules = sorted({fwd.record(v).module for v in nodes})
        out.add_node(name, NodeRecord(name=name, op=f"layer ({len(nodes)} ops)", module=_common(modules),
                                      fx_nodes=tuple(f for v in nodes for f in fwd.record(v).fx_nodes),
                                      tmpcs=tmpcs))
    for (u, w), nbytes in edges.items():
        out.add_edge(u, w, nbytes)
    parallel = Parallel(devices=devices, memory_bytes=float(memory_bytes), bandwidth=float(bandwidth),
                        microbatches=microbatches)
    device = Device("accel", "meta", kind, int(memory_bytes))
    return Problem(out, Cluster((device,), bandwidth=float(bandwidth)), parallel=parallel)


@dataclass(frozen=True)
class _Prices:
    """What the TMPCs of every layer are priced with."""

    kind: str
    microbatches: int
    bandwidth: float
    tensor_bandwidth: float
    owned: Mapping[str, float]
    borrowed: Mapping[str, float]


def _layer_tmpcs(graph: OpGraph, fwd: OpGraph, name: str, nodes: Sequence[str], pairs: Sequence[MegatronPair],
                 offered: Sequence[int], edges: Mapping[tuple[str, str], float],
                 prices: _Prices) -> dict[int, tuple[TMPC, ...]]:
    """The TMPCs of layer ``name`` (module docstring), for each offered ``t`` all its pairs split into."""
    preds = {u for (u, w) in edges if w == name}
    succs = {w for (u, w) in edges if u == name}
    inputs = sum(edges[u, name] for u in preds)  # the tensors it reads from other layers: its stash
    tied = math.fsum(prices.borrowed.get(v, 0.0) for v in nodes) / prices.microbatches / prices.bandwidth
    out: dict[int, tuple[TMPC, ...]] = {}
    for t in offered:
        if t > 1 and any(t not in p.degrees for p in pairs):
            continue
        cost = _layer_cost(graph, nodes, pairs, t, prices)
        comm = sum(_allreduce(fwd.record(p.row).output_bytes, t, prices.tensor_bandwidth) for p in pairs)
        common = {"param_bytes": cost.weights, "sync_in": {u: edges[u, name] if t > 1 else 0.0 for u in preds},
                  "sync_out": {w: edges[name, w] if t > 1 else 0.0 for w in succs}}
        vanilla = TMPC("vanilla", time=cost.forward + cost.backward + 2 * comm + tied,
                       mem_a=cost.saved, mem_b=cost.weights + cost.resident, **common)
        recomp = TMPC("activation recomp", time=2 * cost.forward + cost.backward + 3 * comm + tied,
                      mem_a=float(inputs), mem_b=cost.weights + cost.resident + max(cost.saved - inputs, 0.0),
                      recompute=True, **common)
        out[t] = (vanilla, recomp) if cost.saved > 0 else (vanilla,)
    return out


def _layer_cost(graph: OpGraph, nodes: Sequence[str], pairs: Sequence[MegatronPair], t: int,
                prices: _Prices) -> LayerCost:
    split = {v for p in pairs for v in p.nodes} if t > 1 else set()
    factor = float((graph.meta.get("training") or {}).get("state_factor", 0.0))
    owned, borrowed, kind = prices.owned, prices.borrowed, prices.kind
    cost = LayerCost()
    for v in nodes:
        r, b = graph.record(v), graph.record(f"{v}:backward")
        w = owned.get(v, 0.0) + borrowed.get(v, 0.0)
        resident = (r.param_bytes - owned.get(v, 0.0)) + b.param_bytes + borrowed.get(v, 0.0) * (1.0 + factor)
        cost.add(r.times[kind], b.times.get(kind, 2.0 * r.times[kind]), w, resident, r.saved_bytes,
                 t if v in split else 1)
    return cost


def fx_outputs(gm: Any) -> dict[str, tuple[int, tuple[str, ...]]]:
    """``{fx node: (output bytes, fx nodes reading it)}`` of a traced GraphModule whose nodes carry
    ``meta["torchplace"]`` (:class:`~torchplace.fxutil.TensorInfo`)."""
    out: dict[str, tuple[int, tuple[str, ...]]] = {}
    for n in gm.graph.nodes:
        info = n.meta.get("torchplace")
        if info is not None:
            out[n.name] = (int(info.output_bytes), tuple(u.name for u in n.users))
    return out


def _layer_edges(fwd: OpGraph, member: Mapping[str, str],
                 fx: Mapping[str, tuple[int, Sequence[str]]] | None) -> dict[tuple[str, str], float]:
    """``c(U, W)``: bytes of ``U``'s outputs read in ``W``, each tensor once per ``W`` (per fx node
    where ``fx`` gives their sizes and readers, else per graph node)."""
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    for u, v in fwd.edges:
        if member[u] != member[v]:
            seen[member[u], member[v]].add(u)
    if fx is None:
        return {k: float(sum(fwd.record(u).output_bytes for u in us)) for k, us in seen.items()}
    layer_of = {f: member[v] for v, r in fwd.records() for f in r.fx_nodes}
    missing = sorted(set(layer_of) - set(fx))
    if missing:
        raise UsageError(f"the traced model's fx nodes do not match the graph (no fx node {missing[0]!r}): "
                         "give the traced model the graph was profiled from")
    out = {}
    for (a, b), producers in seen.items():
        tensors = {f for u in producers for f in fwd.record(u).fx_nodes
                   if f in fx and any(layer_of.get(x) == b for x in fx[f][1])}
        out[a, b] = float(sum(fx[f][0] for f in tensors))
    return out


def _common(modules: Sequence[str]) -> str:
    """The longest common dotted prefix of module paths."""
    parts = [m.split(".") for m in modules if m]
    if not parts:
        return ""
    prefix = []
    for xs in zip(*parts):
        if len(set(xs)) != 1:
            break
        prefix.append(xs[0])
    return ".".join(prefix)


def heads_by_module(model: object) -> dict[str, int]:
    """Attention head counts by module path (``num_heads``, ``num_attention_heads`` or ``n_head``)."""
    out: dict[str, int] = {}
    for path, m in model.named_modules():  # type: ignore[attr-defined]
        for attr in ("num_heads", "num_attention_heads", "n_head"):
            h = getattr(m, attr, None)
            if isinstance(h, int) and not isinstance(h, bool) and h > 0:
                out[path] = h
                break
    return out


def parameter_shapes(model: object) -> dict[str, tuple[int, ...]]:
    """Shapes of the model's parameters and buffers by every name they go by."""
    out: dict[str, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # type: ignore[attr-defined]
        out[name] = tuple(p.shape)
    for name, b in model.named_buffers(remove_duplicate=False):  # type: ignore[attr-defined]
        out[name] = tuple(b.shape)
    return out
