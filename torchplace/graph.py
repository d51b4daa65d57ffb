"""OpGraph: the operator DAG every solver works on.

A thin, typed layer over :class:`networkx.DiGraph`. Each node carries a frozen :class:`NodeRecord`
(costs and sizes of one fx node, or of a group of fx nodes); an edge ``u -> v`` says that ``v``
reads the output of ``u``. Costs live on the producing node: a tensor crossing a device boundary
is paid once however many consumers it has (Tarnawski et al. 2020, Sec. 3; Archer et al. 2024,
Sec. 2.2).
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from torchplace.errors import WorkloadFormatError

__all__ = ["NodeRecord", "OpGraph"]

_FORMAT = "torchplace.opgraph/1"


@dataclass(frozen=True)
class NodeRecord:
    """Costs and sizes of one node of an :class:`OpGraph`.

    Attributes:
        name: human-readable name (fx node name, or the name in a workload file).
        op: operator kind or target, e.g. ``"aten.mm.default"`` or ``"call_module:Linear"``.
        fx_nodes: names of the fx nodes this node covers (empty for graphs read from files).
        module: dotted path of the innermost ``nn.Module`` the node belongs to (``""`` if none).
        param_bytes: bytes of parameters and buffers that live with this node (counted once).
        output_bytes: bytes of the node's output tensors (what a transfer moves).
        temp_bytes: bytes of working memory the node needs on its device while its stage runs.
        times: seconds on each device kind (``"cpu"``, ``"cuda"``, ``"accel"``, ...) for the graph's
            unit of work: one sample in workload files, one call on the example inputs for profiled
            models (transfers are sized from the same inputs, so the units agree). A kind that is
            absent means the node cannot run on that kind.
        transfer_time: seconds to move the output across a device boundary when it is given
            directly (workload files); ``None`` means the cluster's links decide from bytes.
        link_times: seconds to move the output from one device to another, keyed ``"src->dst"``
            by device name, when a workload gives them per device pair (MOIRAI's ``p^comm``);
            pairs not listed fall back to ``transfer_time`` or the cluster's links.
        colocation: nodes with the same non-``None`` value must share a device.
        backward: ``True`` for backward-pass nodes of a training graph.
    """

    name: str
    op: str = ""
    fx_nodes: tuple[str, ...] = ()
    module: str = ""
    param_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    times: Mapping[str, float] = field(default_factory=dict)
    transfer_time: float | None = None
    link_times: Mapping[str, float] = field(default_factory=dict)
    colocation: str | None = None
    backward: bool = False

    def time_on(self, kind: str) -> float:
        """Seconds on a device of ``kind``; ``math.inf`` if the node cannot run there."""
        return self.times.get(kind, math.inf)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fx_nodes"] = list(self.fx_nodes)
        d["times"] = dict(self.times)
        d["link_times"] = dict(self.link_times)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NodeRecord:
        d = dict(d)
        d["fx_nodes"] = tuple(d.get("fx_nodes", ()))
        d["times"] = {str(k): float(v) for k, v in d.get("times", {}).items()}
        d["link_times"] = {str(k): float(v) for k, v in d.get("link_times", {}).items()}
        return cls(**d)


class OpGraph:
    """A DAG of :class:`NodeRecord` s keyed by string node ids.

    Node order is deterministic: :meth:`topological_order` breaks ties by insertion order, so the
    same model gives the same order, and the same plan, on every run.

    Example:
        >>> g = OpGraph()
        >>> g.add_node("a", NodeRecord("a", times={"cpu": 1.0}))
        >>> g.add_node("b", NodeRecord("b", times={"cpu": 2.0}))
        >>> g.add_edge("a", "b")
        >>> g.topological_order()
        ['a', 'b']
    """

    def __init__(self, meta: Mapping[str, Any] | None = None) -> None:
        self.nx = nx.DiGraph()
        self.meta: dict[str, Any] = dict(meta or {})
        self._order: list[str] | None = None

    # -- building ------------------------------------------------------------------------------
    def add_node(self, node_id: str, record: NodeRecord) -> None:
        if node_id in self.nx:
            raise ValueError(f"node {node_id!r} already exists in the graph")
        self.nx.add_node(node_id, record=record)
        self._order = None

    def replace_record(self, node_id: str, record: NodeRecord) -> None:
        """Swap the record of an existing node (used by profiling to fill in times)."""
        self.nx.nodes[node_id]["record"] = record

    def add_edge(self, u: str, v: str) -> None:
        for n in (u, v):
            if n not in self.nx:
                raise ValueError(f"edge ({u!r}, {v!r}) names unknown node {n!r}")
        if u == v:
            raise ValueError(f"self-loop on node {u!r}: an operator cannot consume its own output")
        self.nx.add_edge(u, v)
        self._order = None

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.nx.number_of_nodes()

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.nx

    def __iter__(self) -> Iterator[str]:
        return iter(self.nx.nodes)

    def record(self, node_id: str) -> NodeRecord:
        return self.nx.nodes[node_id]["record"]

    def records(self) -> Iterator[tuple[str, NodeRecord]]:
        yield from self.nx.nodes(data="record")

    def successors(self, node_id: str) -> Iterator[str]:
        return self.nx.successors(node_id)

    def predecessors(self, node_id: str) -> Iterator[str]:
        return self.nx.predecessors(node_id)

    @property
    def edges(self) -> Iterable[tuple[str, str]]:
        return self.nx.edges

    def device_kinds(self) -> set[str]:
        """Every device kind some node has a time for."""
        return {k for _, r in self.records() for k in r.times}

    def topological_order(self) -> list[str]:
        """Node ids in a topological order, ties broken by insertion order.

        Raises:
            ValueError: if the graph has a cycle (naming nodes on it).
        """
        if self._order is None:
            index = {n: i for i, n in enumerate(self.nx.nodes)}
            try:
                self._order = list(nx.lexicographical_topological_sort(self.nx, key=index.__getitem__))
            except nx.NetworkXUnfeasible:
                cycle = nx.find_cycle(self.nx)
                raise ValueError(f"graph is not a DAG; cycle: {cycle}") from None
        return list(self._order)

    def check_dag(self) -> None:
        """Raise ValueError naming a cycle if the graph is not acyclic."""
        self.topological_order()

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "meta": self.meta,
            "nodes": [{"id": n, **r.to_dict()} for n, r in self.records()],
            "edges": [[u, v] for u, v in self.nx.edges],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OpGraph:
        if data.get("format") != _FORMAT:
            raise WorkloadFormatError(
                f"not an OpGraph file: field 'format' is {data.get('format')!r}, expected {_FORMAT!r}"
            )
        g = cls(meta=data.get("meta"))
        for i, nd in enumerate(data["nodes"]):
            nd = dict(nd)
            try:
                node_id = str(nd.pop("id"))
                g.add_node(node_id, NodeRecord.from_dict(nd))
            except (KeyError, TypeError) as e:
                raise WorkloadFormatError(f"nodes[{i}] is malformed: {e}") from e
        for u, v in data["edges"]:
            g.add_edge(str(u), str(v))
        return g

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        return cls.from_json(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return (
            list(self.records()) == list(other.records())
            and sorted(self.nx.edges) == sorted(other.nx.edges)
            and self.meta == other.meta
        )

    def __repr__(self) -> str:
        return f"OpGraph({len(self)} nodes, {self.nx.number_of_edges()} edges)"
