"""Reader for MOIRAI's instance CSV (Zhang et al., "MOIRAI", Sec. III-D, Table II).

The table (``moirai-placement/moirai``, ``example-1__instances.csv``) has one row per task:

    task, c_task, dir_succ, dir_succ_add, p0..p{K-1}, pcXY (X, Y < K), mi, m0..m{K-1}

``c_task`` lists the communication nodes of the augmented DAG (Sec. III-D, Fig. 8) on the task's
out-edges, ``dir_succ`` the successor tasks in the same order (communication node ``c_task[i]``
carries the data to ``dir_succ[i]``), ``dir_succ_add`` their union; ``pk`` is the processing time
on device ``k`` (``p_ik``), ``pcXY`` the transfer time of each out-edge's data from device ``X``
to ``Y`` (``p^comm_qXY``, one comma-separated value per communication node), ``mi`` the task
memory (``m_i``) and ``m0..`` the device memories (``Mem_k``, first row only). A task without
communication nodes (the virtual source) sends its output for free. The table ends at the first
blank row; notes below it are ignored. Numbers must be finite and non-negative, memories whole;
the one exception is a processing time written ``inf``, which says that the task cannot run on
that device (a number too large for a float, like ``1e400``, is an error, not an ``inf``).

Each device ``k`` becomes ``Device("dev{k}", "meta", kind="dev{k}", memory_bytes=m_k)``: every
device has its own kind, so ``p_ik`` is ``NodeRecord.times["dev{k}"]``, and ``pcXY`` is
``NodeRecord.link_times["devX->devY"]``.

Per-edge transfer data. torchplace's cost model moves a producer's output once per destination
device, with the producer's ``link_times`` (:func:`torchplace.costmodel.simulate`). A task whose
out-edges carry *different* transfer times (example-1: task 14 sends communication node 16 to
task 19 and node 17 to task 23) is split: one zero-time node ``"14>19"`` per out-edge, colocated
with the producer (``NodeRecord.colocation``) and carrying that edge's ``link_times``, so
``14 -> "14>19"`` never crosses devices and ``"14>19" -> 19`` pays communication node 16's times.
This is the paper's model exactly: each out-edge is its own transfer (two transfers to one device
serialize on its ports, as (8) demands of two communication nodes), and a zero-time node on its
producer's device can run the instant the producer finishes (an optimal schedule puts it there:
it occupies the device for 0 s and delays nothing), so it adds no time. Tasks whose out-edges all
carry the same times are not split.
"""
from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from torchplace.checks import brief, byte_count
from torchplace.devices import Cluster, Device
from torchplace.errors import WorkloadFormatError
from torchplace.files import read_text
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem

__all__ = ["read_moirai_csv"]


@dataclass
class _Row:
    """One task row, parsed."""

    line: int
    task: str
    comm: list[str]
    succ: list[str]
    times: list[float]
    link: list[dict[str, float]]  # per out-edge: "devX->devY" -> seconds
    memory: int
    device_memory: list[int] = field(default_factory=list)


class _Cells:
    """Typed access to the cells of one row; errors name the file, line, task and column."""

    def __init__(self, path: Path, line: int, cells: dict[str, str]) -> None:
        self.path, self.line, self.cells = path, line, cells

    def fail(self, col: str, msg: str) -> WorkloadFormatError:
        task = self.cells.get("task", "?")
        return WorkloadFormatError(f"{self.path}: line {self.line} (task {task}), column {col!r}: {msg}")

    def ids(self, col: str) -> list[str]:
        raw = self.cells.get(col, "").strip()
        parts = [s.strip() for s in raw.split(",")] if raw else []
        if any(not re.fullmatch(r"\d+", s) for s in parts):
            raise self.fail(col, f"expected comma-separated integer ids, got {raw!r}")
        return [str(int(s)) for s in parts]

    def numbers(self, col: str, allow_inf: bool = False) -> list[float]:
        """Comma-separated finite non-negative numbers (``inf`` written out too, if ``allow_inf``)."""
        raw = self.cells.get(col, "").strip()
        parts = [s.strip() for s in raw.split(",")] if raw else []
        try:
            vals = [float(s) for s in parts]
        except ValueError:
            raise self.fail(col, f"expected comma-separated numbers, got {brief(raw)}") from None
        for s, v in zip(parts, vals):
            written_inf = allow_inf and s.lower() in ("inf", "infinity")
            if math.isnan(v) or v < 0 or (math.isinf(v) and not written_inf):
                why = "; 'inf' marks a device the task cannot run on" if allow_inf else ""
                raise self.fail(col, f"expected non-negative finite numbers{why}, got {brief(raw)}")
        return vals

    def number(self, col: str, allow_inf: bool = False) -> float:
        vals = self.numbers(col, allow_inf)
        if len(vals) != 1:
            raise self.fail(col, f"expected one number, got {brief(self.cells.get(col, ''))}")
        return vals[0]

    def integer(self, col: str) -> int:
        """A whole number of bytes: ``1.7`` is an error, not 1."""
        raw = self.cells.get(col, "").strip()
        try:
            value: float | int = int(raw)  # exact, however many digits
        except ValueError:
            value = self.number(col)
        try:
            return byte_count(value, "")
        except ValueError as e:
            raise self.fail(col, str(e)) from None


def _device_count(path: Path, header: list[str]) -> int:
    k = sum(1 for h in header if re.fullmatch(r"p\d+", h))
    need = ["task", "c_task", "dir_succ", "dir_succ_add", *(f"p{i}" for i in range(k)),
            *(f"pc{x}{y}" for x in range(k) for y in range(k)), "mi", *(f"m{i}" for i in range(k))]
    missing = [c for c in need if c not in header] or (["p0"] if k == 0 else [])
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WorkloadFormatError(
            f"{path}: line 1: header lacks column(s) {missing[:5]}{more}; got {brief(header)}"
        )
    return k


def _links(c: _Cells, k: int, n_edges: int) -> list[dict[str, float]]:
    """Per out-edge transfer times ``devX->devY`` (X != Y); all zero for a task without comm nodes."""
    out: list[dict[str, float]] = [{} for _ in range(max(n_edges, 1))]
    for x in range(k):
        for y in range(k):
            col = f"pc{x}{y}"
            vals = c.numbers(col)
            if n_edges == 0:  # virtual source: no communication nodes, free transfers
                if any(v != 0 for v in vals):
                    raise c.fail(col, "a task without communication nodes (c_task empty) cannot have transfer times")
                vals = [0.0]
            elif len(vals) != n_edges:
                raise c.fail(col, f"expected {n_edges} value(s), one per communication node, got {len(vals)}")
            if x == y:
                if any(v != 0 for v in vals):
                    raise c.fail(col, "a transfer within one device must take 0")
                continue
            for edge, v in zip(out, vals):
                edge[f"dev{x}->dev{y}"] = v
    return out


def _parse_row(c: _Cells, k: int, first: bool) -> _Row:
    task = c.ids("task")
    if len(task) != 1:
        raise c.fail("task", f"expected one task id, got {c.cells.get('task')!r}")
    comm, succ = c.ids("c_task"), c.ids("dir_succ")
    if comm and len(comm) != len(succ):
        raise c.fail("c_task", f"{len(comm)} communication node(s) for {len(succ)} successor(s); they pair up in order")
    if set(c.ids("dir_succ_add")) != set(comm) | set(succ):
        raise c.fail("dir_succ_add", f"expected the union of c_task {comm} and dir_succ {succ}")
    times = [c.number(f"p{i}", allow_inf=True) for i in range(k)]
    if not any(math.isfinite(t) for t in times):
        raise c.fail("p0", f"the task cannot run on any device (every p0..p{k - 1} is inf)")
    links = _links(c, k, len(comm))
    memory = [c.integer(f"m{i}") for i in range(k)] if first else []
    return _Row(c.line, task[0], comm, succ, times, links, c.integer("mi"), memory)


def _read_rows(path: Path) -> tuple[int, list[_Row]]:
    text = read_text(path, "workload")  # names the file if it is missing, a directory, not UTF-8
    if not text.strip():
        raise WorkloadFormatError(f"{path}: the file is empty; expected a MOIRAI instance table")
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[_Row] = []
    try:
        header = [h.strip() for h in next(reader, [])]
        k = _device_count(path, header)
        for cells in reader:
            if not any(s.strip() for s in cells):
                break  # the table ends at the first blank row
            c = _Cells(path, reader.line_num, dict(zip(header, cells)))
            rows.append(_parse_row(c, k, first=not rows))
    except csv.Error as e:
        raise WorkloadFormatError(f"{path}: line {reader.line_num}: not a readable CSV row: {e}") from None
    if not rows:
        raise WorkloadFormatError(f"{path}: no task rows")
    return k, rows


def _add_task(g: OpGraph, row: _Row, k: int) -> list[tuple[str, str]]:
    """Add ``row``'s task (split per out-edge if its edges' times differ); return its edges."""
    kinds = [f"dev{i}" for i in range(k)]
    times = {kind: t for kind, t in zip(kinds, row.times) if math.isfinite(t)}
    distinct = {tuple(sorted(e.items())) for e in row.link}
    if len(distinct) <= 1:
        g.add_node(row.task, NodeRecord(row.task, op="moirai", param_bytes=row.memory, times=times,
                                        link_times=row.link[0]))
        return [(row.task, s) for s in row.succ]
    group = f"moirai-split:{row.task}"
    zero = {f"dev{x}->dev{y}": 0.0 for x in range(k) for y in range(k) if x != y}
    g.add_node(row.task, NodeRecord(row.task, op="moirai", param_bytes=row.memory, times=times,
                                    link_times=zero, colocation=group))
    edges = []
    for comm, succ, link in zip(row.comm, row.succ, row.link):
        split = f"{row.task}>{succ}"
        g.add_node(split, NodeRecord(split, op=f"moirai-comm:{comm}", times=dict.fromkeys(times, 0.0),
                                     link_times=link, colocation=group))
        edges += [(row.task, split), (split, succ)]
    return edges


def read_moirai_csv(path: str | Path) -> Problem:
    """Read a MOIRAI instance table into a latency Problem (non-contiguous, inference).

    Returns:
        A Problem with devices ``dev0..dev{K-1}`` (one kind each, memory ``m_k``), one node per
        task (times ``p_ik``, ``param_bytes = m_i``, ``link_times`` from ``pcXY``) plus one
        zero-time colocated node per out-edge of a task whose edges carry different transfer
        times (see the module docstring). ``graph.meta["comm"]`` maps each communication node to
        its ``[task, successor]``.

    Raises:
        WorkloadFormatError: naming the line, task and column of a malformed cell, an unknown
            successor, a task listed as its own successor, a repeated task, or a cycle.
    """
    path = Path(path)
    k, rows = _read_rows(path)
    comm = {q: [r.task, s] for r in rows for q, s in zip(r.comm, r.succ)}
    g = OpGraph(meta={"source": str(path), "format": "moirai", "comm": comm})
    edges: list[tuple[str, str, int]] = []
    for r in rows:
        if r.task in g:
            raise WorkloadFormatError(f"{path}: line {r.line}, column 'task': task {r.task} appears twice")
        edges += [(u, v, r.line) for u, v in _add_task(g, r, k)]
    for u, v, line in edges:
        if v not in g:
            raise WorkloadFormatError(f"{path}: line {line} (task {u}), column 'dir_succ': unknown task {v}")
        if u == v:
            raise WorkloadFormatError(f"{path}: line {line} (task {u}), column 'dir_succ': a task cannot succeed itself")
        g.add_edge(u, v)
    try:
        g.check_dag()
    except ValueError as e:
        raise WorkloadFormatError(f"{path}: {e}") from None
    devices = tuple(Device(f"dev{i}", "meta", f"dev{i}", m) for i, m in enumerate(rows[0].device_memory))
    return Problem(g, Cluster(devices), objective="latency", contiguous=False)
