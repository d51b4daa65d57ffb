"""The three pictures of a plan: its predicted schedule, its memory per device, its graph by device.

Each function returns a :class:`~torchplace.report.figure.Picture` (inline in notebooks, saves as
PNG / SVG). They read a :class:`~torchplace.plan.Plan` and, when given, the
:class:`~torchplace.problem.Problem` it was solved for; all numbers come from the cost model
(:mod:`torchplace.report.timeline`, :func:`torchplace.costmodel.device_memory_parts`). Without the
problem (a plan file on its own) they draw what the plan holds: per-device costs and stages.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import networkx as nx

from torchplace import costmodel
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.report.figure import Picture, device_colors, literal, new_figure
from torchplace.report.timeline import Bar, drawn_microbatches, drawn_schedule, predicted_timeline
from torchplace.units import format_bytes

__all__ = ["graph_groups", "plot_graph", "plot_memory", "plot_schedule", "plot_timeline"]


def _devices(plan: Plan) -> list[str]:
    return list(dict.fromkeys(s.device for s in plan.stages))


def _seconds_unit(span: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if span * scale >= 1:
            return scale, unit
    return 1e9, "ns"


def plot_timeline(bars: Sequence[Bar], colors: dict[str, str], title: str, rows: Sequence[str] = ()) -> Picture:
    """A Gantt chart of ``bars``, one row per device (and per link), coloured by stage device;
    backward bars hatched, transfers grey."""
    rows = list(dict.fromkeys([*rows, *(b.row for b in bars)]))
    end = max((b.finish for b in bars), default=0.0)
    scale, unit = _seconds_unit(end)
    fig = new_figure(9, 1.2 + 0.45 * len(rows))
    ax = fig.add_subplot()
    index = {r: len(rows) - 1 - i for i, r in enumerate(rows)}
    by_look: dict[tuple[str, str, str], list[tuple[float, float]]] = defaultdict(list)
    for b in bars:
        color = "#9a9a9a" if b.kind == "transfer" else colors.get(b.row, "#4e79a7")
        by_look[(b.row, color, "///" if b.kind == "B" else "")].append((b.start * scale, (b.finish - b.start) * scale))
    for (row, color, hatch), spans in by_look.items():
        ax.broken_barh(spans, (index[row] - 0.38, 0.76), facecolors=color, edgecolors="white", linewidth=0.4,
                       hatch=hatch or None)
    small = len(bars) <= 80
    for b in bars:
        if small and b.kind in ("F", "B") and (b.finish - b.start) > end / 60:
            ax.text((b.start + b.finish) / 2 * scale, index[b.row], f"{b.kind}{b.microbatch}", ha="center",
                    va="center", fontsize=7, color="white")
    ax.set_yticks(list(index.values()), [literal(r) for r in index])
    ax.set_xlim(0, max(end * scale, 1e-12) * 1.01)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return Picture(fig)


def plot_schedule(plan: Plan, problem: Problem | None = None, microbatches: int | None = None) -> Picture:
    """The plan's predicted run as a Gantt chart per device (:func:`predicted_timeline`): the
    fill-drain pipeline of inference, GPipe / 1F1B forward and (hatched) backward passes of
    training, or the latency simulation with every node on its device and every transfer on its
    link.

    Raises:
        UnsupportedError: a Piper plan, or a training plan file without the step ``place()``
            predicted (:func:`predicted_timeline`).
    """
    bars = predicted_timeline(plan, problem, microbatches)
    end = max((b.finish for b in bars), default=0.0)
    if problem is not None and problem.objective == "latency":
        what = f"latency simulation: {plan.objective:.4g} s per sample"
    elif problem is None and plan.meta.get("objective") == "latency":
        what = "a latency plan's stages one after another (a plan file holds no graph)"
    elif (schedule := drawn_schedule(plan, problem)) is not None:
        what = f"training, {schedule}, {drawn_microbatches(plan, problem, microbatches)} micro-batches"
    else:
        what = f"fill-drain pipeline, {drawn_microbatches(plan, problem, microbatches)} micro-batches"
    return plot_timeline(bars, device_colors(_devices(plan)), f"Predicted schedule ({what}; {end:.4g} s)",
                         _devices(plan))


def plot_memory(plan: Plan, problem: Problem | None = None) -> Picture:
    """Each device's memory stacked by kind (:data:`~torchplace.costmodel.MEMORY_KINDS`, from the
    cost model) against its cap; without the problem, the plan's per-device totals."""
    devices = _devices(plan)
    if problem is not None and problem.parallel is not None:  # Piper: a ceil(s/d) + b per device of a stage, no parts
        costs = costmodel.evaluate_stages(problem, plan.stages)[1]
        parts = {c.device: {"per device (Piper)": c.memory} for c in costs}
        caps = {d: problem.parallel.memory_limit for d in devices}
        kinds = ["per device (Piper)"]
    elif problem is not None:
        parts = costmodel.device_memory_parts(problem, plan.stages)
        caps = {d: problem.cluster.device(d).memory_bytes for d in devices}
        kinds = [k for k in costmodel.MEMORY_KINDS if any(parts[d][k] for d in devices)] or ["parameters"]
    else:
        total = {c.device: c.memory for c in plan.costs}
        parts = {d: {"total (plan file: no breakdown)": total.get(d, 0)} for d in devices}
        caps, kinds = {}, ["total (plan file: no breakdown)"]
    used = max([sum(parts[d].values()) for d in devices], default=0)
    shown = {d: c for d, c in caps.items() if c and c <= 4 * max(used, 1)}  # a far-off cap would flatten the bars
    peak = max([used, *shown.values()]) or 1
    scale, unit = next(((1024.0 ** -p, u) for p, u in ((3, "GiB"), (2, "MiB"), (1, "KiB"))
                        if peak >= 1024 ** p), (1.0, "B"))
    fig = new_figure(max(5.0, 1.2 * len(devices) + 3), 4)
    ax = fig.add_subplot()
    bottom = [0.0] * len(devices)
    shades = ("#4e79a7", "#a0cbe8", "#f28e2b", "#59a14f", "#e15759")
    for k, kind in enumerate(kinds):
        heights = [parts[d].get(kind, 0) * scale for d in devices]
        ax.bar([literal(d) for d in devices], heights, bottom=bottom, label=kind, color=shades[k % len(shades)])
        bottom = [b + h for b, h in zip(bottom, heights)]
    labelled = False
    for i, d in enumerate(devices):
        if d in shown:
            ax.hlines(shown[d] * scale, i - 0.45, i + 0.45, colors="black", linestyles="--",
                      label=None if labelled else "cap")
            labelled = True
        elif caps.get(d):
            ax.annotate(f"cap {format_bytes(caps[d])}", (i, bottom[i]), xytext=(0, 3), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_ylim(0, peak * scale * 1.15)
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title("Memory per device (cost model)")
    ax.legend(fontsize=8, loc="upper right")
    return Picture(fig)


def graph_groups(plan: Plan, problem: Problem, level: str = "module", max_boxes: int = 60) -> nx.DiGraph:
    """The graph to draw: at ``level="operator"`` (or when it has at most ``max_boxes`` nodes) the
    problem's graph itself; at ``"module"`` its
    nodes merged by (module path cut at the deepest depth that gives at most ``max_boxes`` boxes,
    device), and by stage when even depth 1 gives too many (graphs from workload files have no
    modules). Each box has ``device``, ``label`` and ``size`` (nodes merged) attributes; edges
    keep the graph's direction, self-loops dropped; ``graph["members"]`` maps each box to its nodes.

    Raises:
        UsageError: for another ``level``.
    """
    from torchplace.errors import UsageError

    if level not in ("module", "operator"):
        raise UsageError(f"level must be 'module' or 'operator', got {level!r}")
    g, device_of = problem.graph, plan.assignment
    stage_of = {v: i for i, s in enumerate(plan.stages) for v in s.nodes}
    if level == "operator" or len(g) <= max_boxes:
        return _merged(g, device_of, lambda v: v, lambda v: g.record(v).name or v)
    modules = {v: g.record(v).module.split(".") if g.record(v).module else [] for v in g}
    deepest = max((len(p) for p in modules.values()), default=0)
    for depth in range(deepest, 0, -1):
        def key(v: str, depth: int = depth) -> str:
            return ".".join(modules[v][:depth]) or "(top)"
        if len({(key(v), device_of[v]) for v in g}) <= max_boxes:
            return _merged(g, device_of, lambda v, k=key: f"{k(v)}@{device_of[v]}", key)
    return _merged(g, device_of, lambda v: f"stage {stage_of[v]}", lambda v: f"stage {stage_of[v]}")


def _merged(g: Any, device_of: dict[str, str], box: Any, label: Any) -> nx.DiGraph:
    out = nx.DiGraph(members={})
    for v in g:
        b = box(v)
        if b not in out:
            out.add_node(b, device=device_of[v], label=label(v), size=0)
            out.graph["members"][b] = []
        out.nodes[b]["size"] += 1
        out.graph["members"][b].append(v)
    for u, v in g.edges:
        if box(u) != box(v):
            out.add_edge(box(u), box(v))
    return out


def _layers(h: nx.DiGraph, g: Any) -> dict[Any, int]:
    """Each box's layer: the earliest longest-path depth of its nodes in the graph, ranked (a box
    graph may have cycles, the node graph has none, so boxes keep the data's left-to-right flow)."""
    depth: dict[str, int] = {}
    for v in g.topological_order():
        depth[v] = max((depth[u] + 1 for u in g.predecessors(v)), default=0)
    first = {b: min(depth[v] for v in members) for b, members in h.graph["members"].items()}
    rank = {d: i for i, d in enumerate(sorted(set(first.values())))}
    return {b: rank[first[b]] for b in h}


def plot_graph(plan: Plan, problem: Problem, level: str = "module", max_boxes: int = 60) -> Picture:
    """The graph coloured by device, in layers left to right (:func:`graph_groups`): modules by
    default, every operator with ``level="operator"`` (labels dropped past 150 nodes)."""
    h = graph_groups(plan, problem, level, max_boxes)
    layer = _layers(h, problem.graph)
    for v in h:
        h.nodes[v]["layer"] = layer[v]
    pos = nx.multipartite_layout(h, subset_key="layer", align="vertical") if len(h) else {}
    colors = device_colors(_devices(plan))
    width = max(6.0, min(16.0, 0.8 * (max(layer.values(), default=0) + 1)))
    tallest = max((list(layer.values()).count(k) for k in set(layer.values())), default=1)
    fig = new_figure(width, max(2.8, min(20.0, 0.6 * tallest + 2)))
    ax = fig.add_subplot()
    nx.draw_networkx_edges(h, pos, ax=ax, alpha=0.35, arrowsize=6, node_size=120, width=0.7, arrows=True,
                           connectionstyle="arc3,rad=0.25")
    drawn, named = [], []
    for dev, color in colors.items():
        nodes = [v for v in h if h.nodes[v]["device"] == dev]
        if not nodes:  # networkx draws nothing for no nodes (None), which a legend cannot show
            continue
        sizes = [60 + 25 * min(h.nodes[v]["size"], 12) for v in nodes]
        drawn.append(nx.draw_networkx_nodes(h, pos, nodelist=nodes, node_color=color, node_size=sizes, ax=ax))
        named.append(literal(dev))
    if len(h) <= 150:
        labels = {v: literal(_short(h.nodes[v]["label"])) for v in h}
        for text in nx.draw_networkx_labels(h, pos, labels, font_size=7, ax=ax, verticalalignment="bottom").values():
            text.set_rotation(20)
    ax.set_title(f"Graph by device ({level} level, {len(h)} boxes of {len(problem.graph)} nodes)")
    # labels given with their handles: matplotlib leaves out an artist whose own label starts with "_"
    if drawn:
        ax.legend(drawn, named, fontsize=8, loc="upper right", markerscale=0.6)
    ax.set_axis_off()
    return Picture(fig)


def _short(label: str, width: int = 22) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1):]
