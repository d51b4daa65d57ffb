"""OpGraph: the operator DAG every solver works on.

A thin, typed layer over :class:`networkx.DiGraph`. Each node carries a frozen :class:`NodeRecord`
(costs and sizes of one fx node, or of a group of fx nodes); an edge ``u -> v`` says that ``v``
reads the output of ``u``. Costs live on the producing node: a tensor crossing a device boundary
is paid once however many consumers it has (Tarnawski et al. 2020, Sec. 3; Archer et al. 2024,
Sec. 2.2).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import networkx as nx

from torchplace.checks import MOST_BYTES, MOST_SECONDS, brief, byte_count, non_negative_float, seconds
from torchplace.errors import UsageError, WorkloadFormatError
from torchplace.files import read_json, write_json

__all__ = ["TMPC", "NodeRecord", "OpGraph", "SharedTensor", "saved_key", "saved_producer", "union_of_saved"]

_FORMAT = "torchplace.opgraph/1"


@dataclass(frozen=True)
class TMPC:
    """A tensor-model-parallel configuration of one node (Piper, Sec. 3.3 and 3.6).

    One way to run a layer on ``t`` devices (``t`` is the key it is listed under in
    :attr:`NodeRecord.tmpcs`); activation recomputation is a TMPC too.

    Attributes:
        id: its name, unique among the node's TMPCs for one ``t`` (``"vanilla"``,
            ``"activation recomp"``).
        time: ``X.p``, seconds per sample, forward plus backward, the t devices' own traffic included.
        param_bytes: ``X.w``, bytes of weights on each device (all-reduced under data parallelism).
        mem_a, mem_b: the affine memory ``X.a * ceil(s/d) + X.b`` bytes per device (Sec. 3.5, App. A).
        sync_in: ``X.c^fw(u, v)`` by predecessor ``u``: bytes to spread an incoming tensor over the
            ``t`` devices (App. B).
        sync_out: ``X.c^bw(v, w)`` by successor ``w``: the same for an outgoing edge's gradient.
        recompute: whether the configuration recomputes activations in the backward pass.
    """

    id: str
    time: float
    param_bytes: float = 0.0
    mem_a: float = 0.0
    mem_b: float = 0.0
    sync_in: Mapping[str, float] = field(default_factory=dict)
    sync_out: Mapping[str, float] = field(default_factory=dict)
    recompute: bool = False


def saved_key(node: str, index: int | None) -> str:
    """The key of saved storage: ``index``-th distinct output storage of fx node ``node``
    (``"node#index"``), or with ``index=None`` the temporaries ``node`` saves (``"node~"``)."""
    return f"{node}~" if index is None else f"{node}#{index}"


def saved_producer(key: str) -> str:
    """The fx node whose output (or temporaries) saved storage ``key`` is (:func:`saved_key`)."""
    return key[:-1] if key.endswith("~") else key.rpartition("#")[0]


def union_of_saved(parts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Saved storages of several nodes together (``NodeRecord.saved_parts``): each key once."""
    out: dict[str, int] = {}
    for p in parts:
        for key, nbytes in p.items():
            out[key] = max(out.get(key, 0), nbytes)
    return out


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
        temp_bytes: bytes of working memory the node needs on its device while its stage runs: in
            graphs without liveness (workload files) its whole share, summed over a device's nodes;
            in a profiled graph (``meta["liveness"]``) the bytes of all its fx nodes' outputs, an
            upper bound of what it holds at once (:func:`torchplace.costmodel.working_memory`).
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
        saved_bytes: bytes a forward node keeps for the backward pass (its saved activations) for
            the graph's unit of work; used with :class:`~torchplace.problem.Pipeline`.
        tmpcs: Piper's configurations by tensor-parallel degree ``t`` (used with
            :class:`~torchplace.problem.Parallel`; empty otherwise).
        peak_bytes: in a profiled graph, the most bytes the node holds at once while it runs, its
            output included and its inputs not (the liveness peak over its fx nodes); ``None``
            means ``temp_bytes``. Never above ``temp_bytes``.
        resident_bytes: in a profiled graph, the new memory its outputs keep alive after it runs
            (distinct storages: a view or an ``expand`` of a tensor adds nothing); ``None`` means
            ``output_bytes``, which is what a transfer moves.
        saved_parts: in a profiled training graph, ``saved_bytes`` by the storage each saved
            tensor lives in (:func:`saved_key`: which fx node's
            output, or this node's temporaries); nodes that save the same tensor name the same
            key, and a device holding several keeps it once
            (:func:`torchplace.costmodel.saved_union`). Empty: ``saved_bytes`` is this node's own.
        resident_parts: in a profiled graph, ``resident_bytes`` by the fx node whose memory each
            part is (a view's base inside the node), for a node whose outputs are several memories
            that its readers may free at different times. Empty: one memory.
        reads: in a profiled graph, the memories of other nodes this node reads (fx node names, a
            view's base inside its node; keys of their ``resident_parts``): a reader keeps alive
            only the parts it reads (:func:`torchplace.costmodel.working_memory`). Empty: it
            keeps every part of every node before it (nothing known, or only an ordering edge:
            an upper bound either way).
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
    saved_bytes: int = 0
    tmpcs: Mapping[int, tuple[TMPC, ...]] = field(default_factory=dict)
    peak_bytes: int | None = None
    resident_bytes: int | None = None
    saved_parts: Mapping[str, int] = field(default_factory=dict)
    resident_parts: Mapping[str, int] = field(default_factory=dict)
    reads: tuple[str, ...] = ()

    @property
    def own_peak(self) -> int:
        """:attr:`peak_bytes`, or ``temp_bytes`` where it is not known."""
        return self.temp_bytes if self.peak_bytes is None else min(self.peak_bytes, self.temp_bytes)

    @property
    def resident(self) -> int:
        """:attr:`resident_bytes`, or ``output_bytes`` where it is not known; never above ``temp_bytes``."""
        return self.output_bytes if self.resident_bytes is None else min(self.resident_bytes, self.temp_bytes)

    def time_on(self, kind: str) -> float:
        """Seconds on a device of ``kind``; ``math.inf`` if the node cannot run there."""
        return self.times.get(kind, math.inf)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fx_nodes"] = list(self.fx_nodes)
        d["times"] = dict(self.times)
        d["link_times"] = dict(self.link_times)
        d["tmpcs"] = {str(t): [asdict(x) for x in xs] for t, xs in self.tmpcs.items()}
        if not self.tmpcs:
            del d["tmpcs"]
        for keyed in ("saved_parts", "resident_parts"):
            d[keyed] = dict(d[keyed])
            if not d[keyed]:
                del d[keyed]
        d["reads"] = list(self.reads)
        if not self.reads:
            del d["reads"]
        for optional in ("peak_bytes", "resident_bytes"):
            if d[optional] is None:
                del d[optional]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "node") -> NodeRecord:
        """The record :meth:`to_dict` wrote, every field checked (types, finite non-negative numbers).

        Raises:
            WorkloadFormatError: naming ``where`` and the field that is missing, unknown or malformed.
        """
        if not isinstance(d, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object, got {brief(d)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted((k for k in d if k not in known), key=str)
        if unknown:
            raise WorkloadFormatError(f"{where}: unknown field {brief(unknown[0])} (fields: {sorted(known)})")
        if "name" not in d:
            raise WorkloadFormatError(f"{where}: missing field 'name'")
        return cls(**{k: _RECORD_FIELDS[k](v, f"{where}.{k}") if k in _RECORD_FIELDS else v for k, v in d.items()})


def _node_id(value: Any, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise WorkloadFormatError(f"{where}: expected a string or integer node id, got {brief(value)}")
    return str(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WorkloadFormatError(f"{where}: expected a string, got {brief(value)}")
    return value


def _optional_text(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)


def _texts(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise WorkloadFormatError(f"{where}: expected a list of strings, got {brief(value)}")
    return tuple(_text(v, f"{where}[{i}]") for i, v in enumerate(value))


def _nbytes(value: Any, where: str) -> int:
    return byte_count(value, where, error=WorkloadFormatError)


def _optional_nbytes(value: Any, where: str) -> int | None:
    return None if value is None else _nbytes(value, where)


def _seconds(value: Any, where: str) -> float:
    return seconds(value, where, error=WorkloadFormatError)


def _optional_seconds(value: Any, where: str) -> float | None:
    return None if value is None else _seconds(value, where)


def _seconds_by_key(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise WorkloadFormatError(f"{where}: expected an object of seconds, got {brief(value)}")
    return {_text(k, f"{where} key"): _seconds(v, f"{where}[{k!r}]") for k, v in value.items()}


def _nbytes_by_key(value: Any, where: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise WorkloadFormatError(f"{where}: expected an object of byte counts, got {brief(value)}")
    return {_text(k, f"{where} key"): _nbytes(v, f"{where}[{k!r}]") for k, v in value.items()}


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise WorkloadFormatError(f"{where}: expected true or false, got {brief(value)}")
    return value


def _tmpcs(value: Any, where: str) -> dict[int, tuple[TMPC, ...]]:
    if not isinstance(value, Mapping):
        raise WorkloadFormatError(f"{where}: expected an object of TMPC lists by degree, got {brief(value)}")
    out: dict[int, tuple[TMPC, ...]] = {}
    for t, xs in value.items():
        if not str(t).isdigit() or int(t) < 1 or not isinstance(xs, list):
            raise WorkloadFormatError(f"{where}[{t!r}]: expected a positive degree and a list of TMPCs")
        out[int(t)] = tuple(
            TMPC(**{**x, "sync_in": dict(x.get("sync_in", {})), "sync_out": dict(x.get("sync_out", {}))})
            if isinstance(x, Mapping) else _bad_tmpc(x, f"{where}[{t!r}]") for x in xs)
    return out


def _bad_tmpc(x: Any, where: str) -> TMPC:
    raise WorkloadFormatError(f"{where}: expected a TMPC object, got {brief(x)}")


_RECORD_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "name": _text, "op": _text, "fx_nodes": _texts, "module": _text,
    "param_bytes": _nbytes, "output_bytes": _nbytes, "temp_bytes": _nbytes, "saved_bytes": _nbytes,
    "times": _seconds_by_key, "transfer_time": _optional_seconds, "link_times": _seconds_by_key,
    "colocation": _optional_text, "backward": _flag, "tmpcs": _tmpcs, "peak_bytes": _optional_nbytes,
    "resident_bytes": _optional_nbytes, "saved_parts": _nbytes_by_key, "resident_parts": _nbytes_by_key,
    "reads": _texts,
}  # the check of each NodeRecord field read from a file (fields not listed are taken as they are)


@dataclass(frozen=True)
class SharedTensor:
    """A parameter or buffer that several nodes read (a tied weight, a module called twice).

    Its bytes are in the owner's ``param_bytes``; a device that holds readers but not the owner
    holds a copy too, and the cost model charges it there (:func:`torchplace.costmodel.memory`).
    """

    name: str
    nbytes: int
    owner: str
    readers: frozenset[str]
    trainable: bool = False


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
        self._sized = False  # check_numbers passed since the last change

    # -- building ------------------------------------------------------------------------------
    def add_node(self, node_id: str, record: NodeRecord) -> None:
        if node_id in self.nx:
            raise ValueError(f"node {node_id!r} already exists in the graph")
        self.nx.add_node(node_id, record=record)
        self._order = None
        self._sized = False

    def replace_record(self, node_id: str, record: NodeRecord) -> None:
        """Swap the record of an existing node (used by profiling to fill in times)."""
        self.nx.nodes[node_id]["record"] = record
        self._sized = False

    def add_edge(self, u: str, v: str, nbytes: float | None = None) -> None:
        """Add ``u -> v``; ``nbytes`` is the edge's own transfer size where a workload gives one
        per edge (Piper's ``c(u, v)``) rather than per producer."""
        for n in (u, v):
            if n not in self.nx:
                raise ValueError(f"edge ({u!r}, {v!r}) names unknown node {n!r}")
        if u == v:
            raise ValueError(f"self-loop on node {u!r}: an operator cannot consume its own output")
        if nbytes is None:
            self.nx.add_edge(u, v)
        else:
            self.nx.add_edge(u, v, nbytes=float(nbytes))
        self._order = None

    def with_records(self, record: Callable[[str, NodeRecord], NodeRecord],
                     meta: Mapping[str, Any] | None = None) -> OpGraph:
        """A copy with each node's record replaced by ``record(node_id, record)``, the same edges
        (per-edge bytes kept) and ``meta`` (default: this graph's)."""
        out = OpGraph(meta=self.meta if meta is None else meta)
        for v, r in self.records():
            out.add_node(v, record(v, r))
        for u, v, nbytes in self.nx.edges(data="nbytes"):
            out.add_edge(u, v, nbytes)
        return out

    def edge_bytes(self, u: str, v: str) -> float:
        """Bytes the edge ``u -> v`` carries when given per edge (0 otherwise)."""
        return float(self.nx.edges[u, v].get("nbytes", 0.0))

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

    def shared_tensors(self) -> tuple[SharedTensor, ...]:
        """The tensors of ``meta["state"]`` that two or more nodes read (none for workload files)."""
        state = self.meta.get("state") or {}
        return tuple(
            SharedTensor(name, int(e["bytes"]), str(e["owner"]), frozenset(map(str, e["readers"])),
                         bool(e.get("trainable")))
            for name, e in state.items()
            if len(set(e.get("readers", ()))) > 1
        )

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

    def check_numbers(self) -> None:
        """Raise UsageError naming the node if a finite time (on a kind, of a transfer) is above
        :data:`~torchplace.checks.MOST_SECONDS` (sums of such times overflow), or if the nodes'
        bytes together (parameters, outputs, working memory, saved activations) reach
        :data:`~torchplace.checks.MOST_BYTES`, naming the largest node: the solvers add bytes up
        exactly only below it. Checked once per change of the graph."""
        if self._sized:
            return
        for v, r in self.records():
            times = {**{f"times[{k!r}]": t for k, t in r.times.items()}, "transfer_time": r.transfer_time,
                     **{f"link_times[{k!r}]": t for k, t in r.link_times.items()}}
            for what, t in times.items():
                if t is not None and MOST_SECONDS < t < math.inf:
                    raise UsageError(f"node {v!r}: {what} is {t!r} s, more than 1e+100 s, so large that sums of "
                                     "times overflow; give times in a larger unit")
        sizes = {v: r.param_bytes + r.output_bytes + r.temp_bytes + r.saved_bytes for v, r in self.records()}
        total = sum(sizes.values())
        if total >= MOST_BYTES:
            big = max(sizes, key=sizes.__getitem__)
            raise UsageError(
                f"the graph's nodes hold {total} bytes together (node {big!r}: {sizes[big]}), more than the solvers "
                "count exactly (below 2**53 = 9.0e15 bytes); divide every size and memory limit by one factor "
                "(memory depends on their ratios only)")
        self._sized = True

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "meta": self.meta,
            "nodes": [{"id": n, **r.to_dict()} for n, r in self.records()],
            "edges": [[u, v] if b is None else [u, v, b] for u, v, b in self.nx.edges(data="nbytes")],
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "graph") -> OpGraph:
        """The graph :meth:`to_json` wrote, checked: records (:meth:`NodeRecord.from_dict`), edges, acyclicity.

        Raises:
            WorkloadFormatError: naming ``source`` and the malformed field.
        """
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT:
            got = brief(data.get("format")) if isinstance(data, Mapping) else f"a JSON {type(data).__name__}"
            raise WorkloadFormatError(f"{source}: not an OpGraph file: expected 'format': {_FORMAT!r}, got {got}")
        for key in ("nodes", "edges"):
            if not isinstance(data.get(key), list):
                raise WorkloadFormatError(f"{source}: field {key!r} must be a list, got {brief(data.get(key))}")
        if not isinstance(data.get("meta", {}), Mapping):
            raise WorkloadFormatError(f"{source}: meta: expected an object, got {brief(data['meta'])}")
        _check_state(data.get("meta", {}).get("state"), f"{source}: meta.state")
        g = cls(meta=data.get("meta"))
        for i, nd in enumerate(data["nodes"]):
            where = f"{source}: nodes[{i}]"
            if not isinstance(nd, Mapping) or "id" not in nd:
                raise WorkloadFormatError(f"{where}: expected an object with an 'id', got {brief(nd)}")
            node_id = _node_id(nd["id"], f"{where}.id")
            if node_id in g:
                raise WorkloadFormatError(f"{where}.id: duplicate id {node_id!r}")
            g.add_node(node_id, NodeRecord.from_dict({k: v for k, v in nd.items() if k != "id"}, where))
        for i, e in enumerate(data["edges"]):
            where = f"{source}: edges[{i}]"
            if not isinstance(e, list) or len(e) not in (2, 3):
                raise WorkloadFormatError(f"{where}: expected a [source, destination] pair, got {brief(e)}")
            u, v = (_node_id(n, where) for n in e[:2])
            nbytes = non_negative_float(e[2], f"{where}[2]", unit="of bytes", error=WorkloadFormatError) if len(e) == 3 else None
            for n in (u, v):
                if n not in g:
                    raise WorkloadFormatError(f"{where}: {n!r} is not the id of any node")
            if u == v:
                raise WorkloadFormatError(f"{where}: self-loop on node {u!r}")
            g.add_edge(u, v, nbytes)
        try:
            g.check_dag()
        except ValueError as e:
            raise WorkloadFormatError(f"{source}: {e}") from None
        return g

    def save(self, path: str | Path) -> None:
        """Write the graph as JSON (atomically: :func:`torchplace.files.write_json`)."""
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> OpGraph:
        """Read a graph :meth:`save` wrote.

        Raises:
            WorkloadFormatError: naming the file (unreadable, not JSON) and the malformed field.
        """
        return cls.from_json(read_json(path, "graph"), str(path))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpGraph):
            return NotImplemented
        return (
            list(self.records()) == list(other.records())
            and sorted(self.nx.edges(data="nbytes", default=0.0)) == sorted(other.nx.edges(data="nbytes", default=0.0))
            and self.meta == other.meta
        )

    def __repr__(self) -> str:
        return f"OpGraph({len(self)} nodes, {self.nx.number_of_edges()} edges)"


def _check_state(state: Any, source: str) -> None:
    """Raise :class:`WorkloadFormatError` unless ``state`` is ``meta["state"]`` as
    :func:`torchplace.profiling.tensors.state_meta` writes it (or absent)."""
    if state is None:
        return
    if not isinstance(state, Mapping):
        raise WorkloadFormatError(f"{source}: expected an object of tensors by name, got {brief(state)}")
    for name, entry in state.items():
        where = f"{source}[{name!r}]"
        if not isinstance(entry, Mapping):
            raise WorkloadFormatError(f"{where}: expected an object with 'bytes', 'owner' and 'readers', got {brief(entry)}")
        byte_count(entry.get("bytes"), f"{where}.bytes", error=WorkloadFormatError)
        if entry.get("owner") is not None and not isinstance(entry["owner"], str):
            raise WorkloadFormatError(f"{where}.owner: expected a node id or null, got {brief(entry['owner'])}")
        for key in ("readers", "names"):
            value = entry.get(key, [])
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise WorkloadFormatError(f"{where}.{key}: expected a list of strings, got {brief(value)}")
        if not isinstance(entry.get("trainable", False), bool):
            raise WorkloadFormatError(f"{where}.trainable: expected true or false, got {brief(entry['trainable'])}")
