"""One self-contained HTML report of a plan (and of a measured run): no network, no scripts.

The page holds the plan's summary (solver, status, objective, proven lower bound, gap), the stage
table, the three pictures as inline SVG (:mod:`torchplace.report.pictures`), the device map, and,
when a run was measured (:class:`~torchplace.report.fidelity.Measurement`), its stage times beside
the cost model's and its measured timeline beside the predicted one.
"""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchplace import costmodel
from torchplace.errors import UnsupportedError
from torchplace.files import write_text
from torchplace.plan import Plan, recomputed_nodes
from torchplace.problem import Problem
from torchplace.report.figure import device_colors, xml_text
from torchplace.report.fidelity import Measurement
from torchplace.report.pictures import plot_graph, plot_memory, plot_schedule, plot_timeline
from torchplace.report.timeline import Bar
from torchplace.runtime.spans import StageSpan
from torchplace.units import format_bytes

__all__ = ["render", "write_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em}td,th{padding:.25em .7em;border-bottom:1px solid #eee;text-align:right}
th{background:#f5f5f5}td.l,th.l{text-align:left}.fig svg{max-width:100%;height:auto}.note{color:#666;font-size:.9em}
.kv td:first-child{text-align:left;color:#555}.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.3em}
"""


def _e(x: Any) -> str:
    return html.escape(xml_text(str(x)))


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1, cls: str = "") -> str:
    hs = "".join(f"<th{' class=l' if i < left else ''}>{_e(h)}</th>" for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f"<td{' class=l' if i < left else ''}>{c}</td>" for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f"<table class='{cls}'><thead><tr>{hs}</tr></thead><tbody>{body}</tbody></table>"


def _figure(picture: Any, caption: str) -> str:
    return f"<figure class='fig'>{picture.svg()}<figcaption class='note'>{_e(caption)}</figcaption></figure>"


def _summary(plan: Plan, problem: Problem | None) -> str:
    kind = problem.objective if problem is not None else plan.meta.get("objective")
    unit = "s (latency of one call)" if kind == "latency" else "s (max device load)"
    rows = [("solver", _e(plan.solver)), ("status", _e(plan.status)), ("objective", f"{plan.objective:.6g} {unit}"),
            ("proven lower bound", f"{plan.lower_bound:.6g}"), ("gap", f"{100 * plan.gap:.2f}%"),
            ("solve time", f"{plan.seconds:.3g} s"), ("stages", str(len(plan.stages))),
            ("devices", ", ".join(_e(d) for d in dict.fromkeys(s.device for s in plan.stages)))]
    if problem is not None:
        mode = "training" if problem.parallel is not None else problem.mode  # Piper plans training
        rows += [("objective kind", _e(problem.objective)), ("mode", _e(mode)),
                 ("graph nodes", str(len(problem.graph)))]
    return _table(("", ""), [(k, v) for k, v in rows], left=1, cls="kv")


def _stage_table(plan: Plan, problem: Problem | None) -> str:
    colors = device_colors(s.device for s in plan.stages)
    if problem is not None and problem.parallel is not None:  # Piper: a cost per stage, named by its device range
        costs = costmodel.evaluate_stages(problem, plan.stages)[1]
        memory = {c.device: c.memory for c in costs}
    elif problem is not None:
        costs = costmodel.stage_costs(problem, plan.stages)
        memory = costmodel.device_memory(problem, plan.stages)
    else:
        by_device = {c.device: c for c in plan.costs}
        costs = [by_device[s.device] for s in plan.stages if s.device in by_device]
        memory = {c.device: c.memory for c in plan.costs}
    rows = []
    piper = any(s.tmpcs for s in plan.stages)
    for i, (s, c) in enumerate(zip(plan.stages, costs)):
        swatch = f"<span class=swatch style='background:{colors[s.device]}'></span>"
        if piper:  # Piper: a stage is d x t devices; its load is the time per sample (Sec. 4), all-reduce included
            rows.append((str(i), swatch + _e(s.device), s.data_parallel, s.tensor_parallel, len(s.nodes),
                         f"{recomputed_nodes(s)}/{len(s.nodes)}", f"{c.compute:.4g}", f"{c.transfer_in:.4g}",
                         f"{c.transfer_out:.4g}", f"{c.allreduce:.4g}", f"{c.load:.4g}", _e(format_bytes(c.memory))))
            continue
        rows.append((str(i), swatch + _e(s.device), len(s.nodes), f"{c.compute:.4g}", f"{c.transfer_in:.4g}",
                     f"{c.transfer_out:.4g}", f"{c.load:.4g}", _e(format_bytes(memory.get(s.device, 0))),
                     "yes" if s.recompute else ""))
    if piper:
        head = ("stage", "devices", "d", "t", "#nodes", "recomputed nodes", "compute s", "xfer in s", "xfer out s",
                "all-reduce s", "TPS s", "memory per device")
        return _table(head, rows, left=2) + ("<p class=note>Piper: each stage runs on d x t devices; TPS is its time "
                                             "per sample, the sum of the columns before it.</p>")
    note = "" if problem is not None else ("<p class=note>From the plan file: a device with several stages shows "
                                           "its whole cost on each.</p>")
    head = ("stage", "device", "#nodes", "compute s", "xfer in s", "xfer out s", "load s", "device memory", "recompute")
    return _table(head, rows, left=2) + note


def _schedule(plan: Plan, problem: Problem | None, microbatches: int | None) -> str:
    """The predicted schedule's figure, or a note saying why it is not drawn."""
    try:
        picture = plot_schedule(plan, problem, microbatches)
    except UnsupportedError as why:
        return f"<p class=note>{_e(why)}.</p>"
    return _figure(picture, "Bars: a stage on a micro-batch (hatched: backward); rows: devices (and links in latency "
                            "mode). Times from the cost model.")


def _device_map(device_map: Mapping[str, str] | None) -> str:
    if not device_map:
        return "<p class=note>No device map: the plan was loaded without its model.</p>"
    rows = [(_e(k), _e(v)) for k, v in device_map.items()]
    return f"<details><summary>{len(rows)} modules</summary>{_table(('module', 'device'), rows, left=2)}</details>"


def _measured(measurement: Measurement, spans: Sequence[StageSpan], plan: Plan) -> str:
    m = measurement
    rows = [(str(s.stage), _e(s.kind), _e(s.device), f"{s.predicted:.4g}", f"{s.measured:.4g}", f"{100 * s.error:+.1f}%")
            for s in m.stages]
    what = "bottleneck (busiest device, s per call)" if m.objective == "throughput" else "makespan (s)"
    summary = _table(("", "predicted", "measured"), [
        (what, f"{m.predicted_objective:.4g}", f"{m.measured_objective:.4g}"),
        ("wall time per call (s)", f"{m.predicted_wall:.4g}", f"{m.measured_wall:.4g}"),
        ("Pearson r of stage times", "", f"{m.pearson:.3f}"),
        ("median |error| of stage times", "", f"{100 * m.median_error:.1f}%"),
    ], cls="kv")
    out = [summary, _table(("stage", "pass", "device", "predicted s", "measured s", "error"), rows, left=3),
           f"<p class=note>{m.runs} runs, {m.microbatches} micro-batches; stage times per call, summed over "
           "micro-batches (median over runs).</p>"]
    if spans:
        t0 = min(s.start for s in spans)
        bars = [Bar(s.worker, s.start - t0, s.finish - t0, s.stage, s.microbatch, s.kind) for s in spans]
        colors = device_colors(s.device for s in plan.stages)
        out.append(_figure(plot_timeline(bars, colors, "Measured timeline (last run)",
                                         list(dict.fromkeys(s.device for s in plan.stages))),
                           "Each bar is one stage on one micro-batch as the executor ran it (perf_counter)."))
    return "".join(out)


def _refinement(refinement: Any) -> str:
    """Both plans ``place(..., refine=True)`` ran (:class:`torchplace.refine.Refinement`)."""
    rows = [(f"{r.costs} costs" + (" (kept)" if i == refinement.kept else ""), _e(r.plan.solver),
             f"{r.plan.objective:.4g}", f"{r.on_measured:.4g}", f"{r.wall:.4g}")
            for i, r in enumerate(refinement.runs)]
    note = ("The measured costs gave the same plan." if len(refinement.runs) == 1 else
            "The plan kept is the one whose calls measured faster.")
    return "".join([_table(("solved on", "solver", "predicted s (profiled costs)", "predicted s (measured costs)",
                            "measured wall s per call"), rows, left=2),
                    f"<p class=note>Each stage re-timed to its measurement, the problem solved again. {note}</p>"])


def render(plan: Plan, problem: Problem | None = None, *, title: str = "torchplace plan",
           microbatches: int | None = None, device_map: Mapping[str, str] | None = None,
           measurement: Measurement | None = None, spans: Sequence[StageSpan] = (),
           refinement: Any = None) -> str:
    """The report as one HTML string (see the module docstring)."""
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>",
             f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
             "<h2 id=summary>Plan</h2>", _summary(plan, problem),
             "<h2 id=stages>Stages</h2>", _stage_table(plan, problem),
             "<h2 id=schedule>Predicted schedule</h2>", _schedule(plan, problem, microbatches),
             "<h2 id=memory>Memory</h2>",
             _figure(plot_memory(plan, problem), "Per device, by kind, from the cost model; dashed: the device's cap.")]
    parts.append("<h2 id=graph>Graph</h2>")
    if problem is not None:
        parts.append(_figure(plot_graph(plan, problem), "Modules (or operators) coloured by device, in layers."))
    else:
        parts.append("<p class=note>The graph needs the model or workload: pass --workload to `torchplace report`, "
                     "or use placed.report().</p>")
    parts += ["<h2 id=device-map>Device map</h2>", _device_map(device_map)]
    if measurement is not None:
        parts += ["<h2 id=measured>Measured vs predicted</h2>", _measured(measurement, spans, plan)]
    if refinement is not None:
        parts += ["<h2 id=refined>Refined on measured costs</h2>", _refinement(refinement)]
    parts.append("<p class=note>Written by torchplace; self-contained (no scripts, no network).</p></body></html>")
    return "".join(parts)


def write_report(path: str | Path, plan: Plan, problem: Problem | None = None, **options: Any) -> Path:
    """Write :func:`render` to ``path`` (atomically); returns the path."""
    write_text(path, render(plan, problem, **options))
    return Path(path)
