"""torchplace.report: pictures, the HTML report, Chrome traces of measured runs, predicted vs measured.

Pictures and reports are checked for what they contain (parsed SVG/HTML, trace JSON), not pixel
by pixel; one test renders the report in headless Chromium where it is installed.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

import torchplace
from torchplace import callmodel, costmodel
from torchplace.callmodel import Overheads
from torchplace.cli import main
from torchplace.errors import MissingDependencyError, UnsupportedError, UsageError
from torchplace.models import build
from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.report import Picture, plot_graph, plot_memory, plot_schedule, predicted_timeline
from torchplace.report.timeline import MOST_MICROBATCHES
from torchplace.report import fidelity
from torchplace.report.html import render
from torchplace.report.trace import chrome_trace
from torchplace.runtime.schedule import training_schedule
from torchplace.solvers import solve
from torchplace.workloads import read_dnn_partitioning, read_moirai_csv

from tests.conftest import DNN, WORKLOADS
from tests.graphs import pipelined_problems

pytest.importorskip("matplotlib")
QUICK = {"progress": False, "repeats": 1, "warmup": 1}
LAYERS = DNN / "LayerGraphs"
MOIRAI = WORKLOADS / "moirai" / "example-1__instances.csv"


@pytest.fixture(scope="module")
def pipelined():
    model, inputs = build("mlp", batch=8)
    return torchplace.place(model, ["cpu:0", "cpu:1"], inputs, microbatches=4, **QUICK), inputs


@pytest.fixture(scope="module")
def latency():
    model, inputs = build("inception", batch=2)
    return torchplace.place(model, ["cpu:0", "cpu:1"], inputs, objective="latency", solver="m-etf", **QUICK), inputs


@pytest.fixture(scope="module")
def training():
    model, inputs = build("mlp", batch=8)
    placed = torchplace.place(model.train(), ["cpu:0", "cpu:1"], inputs, mode="training", microbatches=4,
                              schedule="1f1b", **QUICK)
    return placed, inputs


@pytest.fixture(scope="module")
def workload_plan():
    problem = read_dnn_partitioning(LAYERS / "resnet50_inference.json")
    return problem, solve(problem)


# -- the cost model's parts ------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(pipelined_problems())
def test_memory_parts_sum_to_the_cost_model_s_memory(problem):
    nodes = list(problem.graph)
    for k in (None, 1, 2):
        for again in (False, True):
            parts = costmodel.memory_parts(problem, nodes, in_flight=k, recompute=again)
            assert set(parts) == set(costmodel.MEMORY_KINDS)
            assert sum(parts.values()) == costmodel.memory(problem, nodes, in_flight=k, recompute=again)


def test_stage_costs_of_one_stage_per_device_are_the_device_costs(workload_plan):
    problem, plan = workload_plan
    assert len({s.device for s in plan.stages}) == len(plan.stages)
    for c, d in zip(costmodel.stage_costs(problem, plan.stages), plan.costs):
        assert c.device == d.device and c.load == pytest.approx(d.load)


# -- predicted timelines -----------------------------------------------------------------------------
def _no_overlap(bars_or_spans, row=lambda b: b.row, eps=1e-12):
    rows = defaultdict(list)
    for b in bars_or_spans:
        rows[row(b)].append((b.start, b.finish))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] + eps for a, b in zip(spans, spans[1:])), spans


def test_fill_drain_timeline_of_two_equal_stages():
    from torchplace.plan import Plan, Stage
    from torchplace.costmodel import StageCost

    plan = Plan([Stage("a", ("x",)), Stage("b", ("y",))], 2.0, 2.0, "test", 0.0,
                costs=[StageCost("a", 1, 2.0, 0, 0, 0), StageCost("b", 1, 2.0, 0, 0, 0)])
    bars = predicted_timeline(plan, None, microbatches=4)
    assert len(bars) == 8
    _no_overlap(bars)
    assert max(b.finish for b in bars) == pytest.approx((4 + 2 - 1) * 2.0 / 4)  # (m + S - 1) ticks of load / m
    plan.meta["call"] = {"microbatches": 8}  # place() ran it with 8: a plan file alone draws its 8
    assert len(predicted_timeline(plan)) == 16 and "8 micro-batches" in plot_schedule(plan).figure.axes[0].get_title()
    plan.meta["call"] = {"microbatches": 1000}
    assert len(predicted_timeline(plan)) == 2 * MOST_MICROBATCHES  # at most what a picture can show


def test_training_timeline_runs_every_action_once_in_dependency_order(training):
    placed, _ = training
    bars = predicted_timeline(placed.plan, placed.problem)
    p = placed.problem.pipeline
    n = len(costmodel.training_stage_times(placed.problem, placed.plan.stages))
    assert sorted((b.kind, b.microbatch, b.stage) for b in bars) == sorted(
        (a.kind, a.microbatch, a.stage) for a in training_schedule(p.schedule, p.microbatches, n))
    _no_overlap(bars)
    finish = {(b.kind, b.microbatch, b.stage): b for b in bars}
    for (kind, i, s), b in finish.items():
        if kind == "B":
            dep = ("B", i, s + 1) if s < n - 1 else ("F", i, n - 1)
            assert finish[dep].finish <= b.start + 1e-12


def test_a_training_plan_file_draws_the_training_step_place_predicted(training, tmp_path):
    placed, _ = training
    placed.plan.save(tmp_path / "plan.json")
    plan = Plan.load(tmp_path / "plan.json")  # no problem: the step place() predicted, as the plan records it
    assert plan.meta["schedule"] == "1f1b" and plan.microbatches == 4
    bars = predicted_timeline(plan)
    p, n = placed.problem.pipeline, len(plan.stages)
    assert sorted((b.kind, b.microbatch, b.stage) for b in bars) == sorted(
        (a.kind, a.microbatch, a.stage) for a in training_schedule(p.schedule, p.microbatches, n))
    _no_overlap(bars)
    recorded = {(i, kind): t for i, kind, t in plan.meta["call"]["stage_seconds"]}
    for (i, kind), t in recorded.items():  # each pass's bars add up to the predicted step's time of that pass
        assert sum(b.finish - b.start for b in bars if (b.stage, b.kind) == (i, kind)) == pytest.approx(t)
    assert "training, 1f1b, 4 micro-batches" in plot_schedule(plan).figure.axes[0].get_title()
    del plan.meta["call"]  # a training plan no place() made: nothing says what its passes take
    with pytest.raises(UnsupportedError, match="records no predicted step"):
        predicted_timeline(plan)
    plan.save(tmp_path / "bare.json")
    assert main(["report", str(tmp_path / "bare.json"), "-o", str(tmp_path / "bare.html")]) == 0
    assert "records no predicted step" in (tmp_path / "bare.html").read_text()


def test_latency_timeline_is_the_simulation(latency):
    placed, _ = latency
    bars = predicted_timeline(placed.plan, placed.problem)
    sched = costmodel.simulate(placed.problem, placed.plan.stages)
    nodes = [b for b in bars if b.kind == "node"]
    assert len(nodes) == len(placed.problem.graph)
    assert max(b.finish for b in bars) == pytest.approx(placed.plan.objective) == pytest.approx(sched.makespan)
    _no_overlap(nodes)


# -- pictures ---------------------------------------------------------------------------------------
def test_pictures_are_svg_and_png_and_show_in_notebooks(pipelined, tmp_path):
    placed, _ = pipelined
    for picture in (placed.plot_schedule(), placed.plot_memory(), placed.plot_graph(),
                    placed.plot_graph(level="operator"), placed.plan.plot_schedule()):
        assert isinstance(picture, Picture)
        assert picture._repr_svg_().startswith("<svg") and picture._repr_svg_().rstrip().endswith("</svg>")
        assert picture._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert placed.plot_memory().save(tmp_path / "m.svg").read_text().count("<svg") == 1
    assert (tmp_path / "m.png").exists() is False and placed.plot_memory().save(tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(UsageError, match=r"\.png, \.svg or \.pdf"):
        placed.plot_memory().save(tmp_path / "m.jpeg")
    with pytest.raises(UsageError, match="level"):
        placed.plot_graph(level="layer")


def test_memory_picture_shows_each_kind_the_cost_model_counts(training):
    placed, _ = training
    svg = placed.plot_memory().svg()
    parts = costmodel.device_memory_parts(placed.problem, placed.plan.stages)
    for kind in costmodel.MEMORY_KINDS:
        assert (kind in svg) == any(p[kind] for p in parts.values()), kind


def test_graph_picture_collapses_a_big_graph_to_at_most_max_boxes(workload_plan):
    from torchplace.report.pictures import graph_groups

    problem, plan = workload_plan
    h = graph_groups(plan, problem, max_boxes=10)
    assert len(h) <= max(10, len(plan.stages))
    assert sum(h.nodes[b]["size"] for b in h) == len(problem.graph)
    assert "Graph by device" in plot_graph(plan, problem).svg()


def _chain(names, devices) -> Problem:
    """A chain of nodes ``names`` (each its own module) on accelerators ``devices`` of 25 bytes."""
    g = OpGraph()
    for i, name in enumerate(names):
        g.add_node(name, NodeRecord(name, module=name, times={"accel": 1.0 + i}, param_bytes=10, transfer_time=0.1))
    for u, v in zip(names, names[1:]):
        g.add_edge(u, v)
    return Problem(g, Cluster(tuple(Device(d, "meta", "accel", 25) for d in devices)))


def test_names_with_dollar_signs_are_drawn_as_they_are():
    """A node or device named with a pair of $ was matplotlib mathtext: `a$b$c` drawn in italics,
    `$\\foo$` a ValueError from its parser, so such a plan drew no picture and no report; a device
    named `_acc1` was left out of the graph's legend."""
    names = [r"$\foo$", "a$b$c", "x"]
    problem = _chain(names, ("$acc0$", "_acc1"))
    plan = solve(problem)
    assert {s.device for s in plan.stages} == {"$acc0$", "_acc1"}
    for picture in (plot_schedule(plan, problem), plot_memory(plan, problem)):
        assert "$acc0$" in picture.svg()
    svg = plot_graph(plan, problem).svg()
    assert all(name in svg for name in names)
    assert ">_acc1<" in svg  # in the legend: matplotlib's legend leaves out labels starting with "_"
    assert "$acc0$" in render(plan, problem)


def test_a_name_that_reads_like_an_id_or_a_reference_is_drawn_as_it_is():
    """The SVG's ids and references get a prefix of their own per figure; the rewrite ran over the
    whole text, so a node named 'id="x" url(#y)' was drawn as 'id="tp0-x" url(#tp0-y)'. Only tags
    are rewritten now, and every reference still names an id of its own figure."""
    import re
    import xml.etree.ElementTree as ET

    name = 'id="x" url(#y)'  # short: longer labels are cut to 22 characters
    problem = _chain([name, "b", "c"], ("acc0", "acc1"))
    svg = plot_graph(solve(problem), problem).svg()
    root = ET.fromstring(svg)
    assert name in "".join(root.itertext())
    own = {e.get("id") for e in root.iter() if e.get("id")}
    refs = {r for e in root.iter() for v in e.attrib.values() for r in re.findall(r"url\(#([^)]+)\)", v)}
    assert own and all(i.startswith("tp") for i in own) and refs and refs <= own


def test_names_with_control_characters_give_well_formed_svg(tmp_path):
    """A workload file's node named with a control character (U+0001) went into the SVG as it was,
    which XML cannot hold: a saved .svg did not parse, and matplotlib warned of a missing glyph."""
    import warnings
    import xml.etree.ElementTree as ET

    problem = _chain(["a\x01b", "c\x0bd", "e"], ("acc0", "acc1"))
    plan = solve(problem)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Glyph 1 missing from font(s)"
        picture = plot_graph(plan, problem)
        ET.parse(picture.save(tmp_path / "g.svg"))
        texts = "".join(ET.fromstring(picture.svg()).itertext())
    assert "a\ufffdb" in texts and "c\ufffdd" in texts
    page = render(plan, problem, title="a\x01 plan")  # the report's text, tables and title too
    assert "\x01" not in page and "\x0b" not in page and "a\ufffd plan" in page


def test_missing_matplotlib_is_a_clear_error(pipelined, monkeypatch):
    placed, _ = pipelined
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'torchplace\[report\]'"):
        placed.plot_schedule()


def test_importing_torchplace_and_the_cli_does_not_import_matplotlib():
    code = ("import sys, torchplace, torchplace.cli, torchplace.report, torchplace.plan; "
            "sys.exit('matplotlib' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# -- traces of measured runs -----------------------------------------------------------------------
def _check_trace(path, devices, passes):
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(devices)
    spans = [e for e in events if e["ph"] == "X"]
    assert passes == len(spans)
    for e in spans:
        assert {"name", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0 and e["ts"] >= 0
        assert names[e["tid"]] == e["args"]["device"]
    _no_overlap([type("S", (), {"start": e["ts"], "finish": e["ts"] + e["dur"], "tid": e["tid"]}) for e in spans],
                row=lambda s: s.tid, eps=1e-3)
    return spans


def test_trace_of_a_pipelined_run(pipelined, tmp_path):
    placed, inputs = pipelined
    spans = placed.trace(inputs, tmp_path / "run.json")
    stages = len(placed.stage_modules)
    assert sorted((s.stage, s.microbatch) for s in spans) == [(s, i) for s in range(stages) for i in range(4)]
    _check_trace(tmp_path / "run.json", {s.device for s in placed.plan.stages}, stages * 4)


def test_trace_of_a_latency_run(latency, tmp_path):
    placed, inputs = latency
    placed.trace(inputs, tmp_path / "run.json")
    _check_trace(tmp_path / "run.json", {s.device for s in placed.plan.stages}, len(placed.plan.stages))


def test_trace_of_a_training_step_has_forward_and_backward(training, tmp_path):
    placed, inputs = training
    target = torch.randint(0, 10, (8,))
    spans = placed.trace(inputs, tmp_path / "step.json", target=target, loss_fn=torch.nn.functional.cross_entropy)
    stages = len(placed.stage_modules)
    assert sorted((s.kind, s.stage, s.microbatch) for s in spans) == sorted(
        (k, s, i) for k in "FB" for s in range(stages) for i in range(4))
    events = _check_trace(tmp_path / "step.json", {s.worker for s in spans}, 2 * stages * 4)
    assert {e["cat"] for e in events} == {"forward", "backward"}
    placed.zero_grad()


def test_chrome_trace_orders_tracks_by_the_given_devices():
    from torchplace.runtime.spans import StageSpan

    trace = chrome_trace([StageSpan(0, "b", 1.0, 2.0), StageSpan(1, "a", 2.0, 2.5)], devices=["a", "b"])
    tids = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tids == {"a": 0, "b": 1}
    first = next(e for e in trace["traceEvents"] if e["ph"] == "X")
    assert first["ts"] == 0 and first["dur"] == pytest.approx(1e6)


# -- fidelity ---------------------------------------------------------------------------------------
def test_measure_compares_every_stage_and_the_objective(pipelined):
    placed, inputs = pipelined
    m = placed.measure(inputs, runs=2)
    assert [s.stage for s in m.stages] == list(range(len(placed.plan.stages)))
    assert all(s.measured > 0 and s.predicted > 0 for s in m.stages)
    assert m.predicted_objective == placed.plan.objective and m.measured_objective > 0 and m.measured_wall > 0
    assert m.runs == 2 and m.microbatches == 4 and "Pearson" in str(m)
    with pytest.raises(UsageError, match="runs"):
        placed.measure(inputs, runs=0)


def test_a_stage_is_predicted_as_the_call_runs_it(pipelined):
    """Each stage is set beside its tasks in the predicted call (m micro-batches, each timed at the
    micro-batch size plus the executor's per-task cost), not beside its whole-batch steady-state cost."""
    placed, inputs = pipelined
    call = placed.plan.meta["call"]
    tasks = callmodel.predict_call(placed.problem, placed.plan.stages, 4, overheads=Overheads(per_task=1e-3))
    assert callmodel.stage_seconds(tasks) == [
        [i, "F", pytest.approx(4 * (t + 1e-3))]
        for i, (_, t) in enumerate(callmodel.microbatch_stage_times(placed.problem, placed.plan.stages, 4))]
    m = placed.measure(inputs, runs=1)
    assert call["microbatches"] == 4
    assert [[s.stage, s.kind, s.predicted] for s in m.stages] == call["stage_seconds"]
    plan = dataclasses.replace(placed.plan, meta={k: v for k, v in placed.plan.meta.items() if k != "call"})
    spans = [placed._last_spans]
    old = fidelity.compare(plan, placed.problem, spans, [1.0], 4)  # without a call: the steady-state costs
    assert [s.predicted for s in old.stages] == [c.load for c in costmodel.stage_costs(placed.problem, plan.stages)]


def test_measure_counts_the_micro_batches_the_runs_made():
    """(found by fuzzing) placed with more micro-batches than the example has rows, the executor runs one
    per row and place() predicts that call; measure() labelled the runs with the m asked for, missed the
    prediction and fell back to whole-batch steady-state costs."""
    model, inputs = build("mlp", batch=4)
    with pytest.warns(RuntimeWarning, match="8 micro-batches requested for a batch of 4"):
        placed = torchplace.place(model, ["cpu:0", "cpu:1"], inputs, microbatches=8, **QUICK)
        m = placed.measure(inputs, runs=1, warmup=0)
    call = placed.plan.meta["call"]
    assert placed.microbatches == 8 and call["microbatches"] == 4
    assert m.microbatches == 4 and m.predicted_wall == call["seconds"]
    assert [[s.stage, s.kind, s.predicted] for s in m.stages] == call["stage_seconds"]


def test_a_placed_model_with_more_micro_batches_than_a_picture_holds_is_measured_and_reported(
        pipelined, monkeypatch, tmp_path):
    """(found by fuzzing) with more micro-batches than MOST_MICROBATCHES, report() and plot_schedule()
    raised UsageError ('not readable'), and so did measure() on a batch of another size (its wall
    prediction was the end of a picture's timeline)."""
    import torchplace.report.timeline as timeline

    placed, (x,) = pipelined  # 4 micro-batches
    monkeypatch.setattr(timeline, "MOST_MICROBATCHES", 2)
    bars = placed.plot_schedule()  # drawn with 2
    assert bars is not None
    assert "Predicted schedule" in placed.report(tmp_path / "plan.html").read_text()
    m = placed.measure((x[:3],), runs=1, warmup=0)  # 3 micro-batches of one sample: no call predicted for them
    assert m.microbatches == 3 and m.predicted_wall == timeline.predicted_end(placed.plan, placed.problem, 3) > 0


def test_eval_calls_of_a_training_placement_are_set_beside_the_forward_passes(training):
    """(found by fuzzing) measure() in eval mode of a model placed for training set its forward calls
    beside the predicted training step (objective and wall with every backward pass)."""
    placed, inputs = training
    step = placed.measure(inputs, target=torch.randn(8, 10), loss_fn=torch.nn.functional.mse_loss, runs=1, warmup=0)
    placed.eval()
    try:
        calls = placed.measure(inputs, runs=1, warmup=0)
    finally:
        placed.train()
    forward = costmodel.training_stage_times(placed.problem, placed.plan.stages)
    load = defaultdict(float)
    for device, seconds, _ in forward:
        load[device] += seconds
    assert {s.kind for s in calls.stages} == {"F"}
    assert calls.predicted_objective == max(load.values()) < step.predicted_objective == placed.plan.objective
    assert 0 < calls.predicted_wall < step.predicted_wall


def test_measure_and_trace_of_training_steps_leave_the_model_as_they_found_it():
    """(found by fuzzing) measure(x, target=y) and trace(..., target=y) ran real steps: gradients
    accumulated, BatchNorm statistics moved and dropout's generator advanced, so the user's next
    optimizer.step() took the measured steps too. Each now leaves gradients (the same tensors, or
    None), buffers and the random number generator as it found them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3)).train()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=2,
                              loss_fn=torch.nn.functional.mse_loss, example_target=y, **QUICK)
    before_any = [p.grad for p in placed.parameters()]
    placed.measure(x, target=y, runs=1, warmup=0)
    assert before_any == [None] * len(before_any)
    assert [p.grad for p in placed.parameters()] == before_any

    placed.step(x, target=y)
    grads = [p.grad for p in placed.parameters()]
    saved = [g.clone() for g in grads]
    buffers = [b.clone() for b in placed.buffers()]
    torch.manual_seed(1)
    state = torch.get_rng_state()
    placed.measure(x, target=y, runs=2, warmup=1)
    placed.trace(x, target=y)
    placed.trace(x)  # a forward call in training mode updates the statistics too
    assert all(p.grad is g for p, g in zip(placed.parameters(), grads))
    assert all(torch.equal(g, s) for g, s in zip(grads, saved))
    assert all(torch.equal(b, s) for b, s in zip(placed.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), state)


class _WritesItsInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        x.mul_(2)
        return y


@pytest.mark.parametrize("objective", ["throughput", "latency"])
def test_measure_and_trace_leave_the_inputs_the_model_writes_as_they_found_them(objective):
    """(found by fuzzing) a model that writes its input (x.mul_(2)) wrote the caller's tensor on every
    measured call: measure() (warm-up and runs) and trace() left x at 32 times its value."""
    torch.manual_seed(0)
    model, x = _WritesItsInput().eval(), torch.ones(4, 8)
    options = {"microbatches": 2} if objective == "throughput" else {}
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x.clone(),), objective=objective, **QUICK, **options)
    placed.measure(x, runs=2, warmup=1)
    placed.trace((x,))
    assert torch.equal(x, torch.ones(4, 8))
    with torch.no_grad():
        placed(x)  # a call still writes it, as the model's does
    assert torch.equal(x, torch.full((4, 8), 2.0))


def test_a_model_with_no_operators_is_drawn_reported_and_refined(tmp_path):
    """(found by fuzzing) place() gives a model with no operators a one-stage plan and runs it, but
    report() and plot_graph() failed in matplotlib's legend (TypeError: 'NoneType' object is not
    subscriptable), and refine=True with 'num_stages must be at least 1 (got 0)'."""
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.randn(4, 8)
    placed = torchplace.place(Identity(), ["cpu:0", "cpu:1"], (x,), **QUICK)
    assert placed(x) is x
    placed.measure(x, runs=1, warmup=0)
    assert isinstance(placed.plot_graph(), Picture)
    _self_contained(_parse(placed.report(tmp_path / "plan.html").read_text()))
    refined = torchplace.place(Identity(), ["cpu:0", "cpu:1"], (x,), refine=True, **QUICK)
    assert refined(x) is x and refined.refinement.kept == 0


def test_measure_of_a_latency_plan_compares_the_makespan(latency):
    placed, inputs = latency
    m = placed.measure(inputs, runs=2)
    assert m.objective == "latency" and m.microbatches == 1 and m.measured_objective > 0


# -- the report -------------------------------------------------------------------------------------
class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    return page


def _self_contained(page: _Page) -> None:
    assert not [t for t, _ in page.tags if t in ("script", "link", "iframe", "img", "object", "embed")]
    for _, attrs in page.tags:
        for key, value in attrs.items():  # the SVGs' namespaces name URLs, and nothing else does
            if key not in ("xmlns", "xmlns:xlink"):
                assert "http:" not in str(value) and "https:" not in str(value) and not str(value).startswith("//"), attrs
    assert not [t for t in page.text if "http:" in t or "https:" in t]


def test_report_of_a_measured_placed_model(pipelined, tmp_path):
    placed, inputs = pipelined
    placed.measure(inputs, runs=2)
    text = placed.report(tmp_path / "plan.html").read_text()
    page = _parse(text)
    _self_contained(page)
    ids = {a.get("id") for _, a in page.tags}
    assert {"summary", "stages", "schedule", "memory", "graph", "device-map", "measured"} <= ids
    assert sum(t == "svg" for t, _ in page.tags) == 4  # schedule, memory, graph, measured timeline
    body = " ".join(page.text)
    assert "proven lower bound" in body and "Pearson" in body and "Measured timeline" in body
    assert f"{placed.plan.objective:.6g}" in body
    for module, device in placed.device_map().items():
        assert module in body and device in body


def test_report_figures_have_ids_of_their_own_and_every_reference_resolves_in_its_figure(pipelined, tmp_path):
    """Every inlined SVG numbered its ids afresh (figure_1, patch_1, axes_1, ...), so a page with
    several figures repeated them, and a browser may resolve one figure's references in another."""
    import re
    import xml.etree.ElementTree as ET

    placed, inputs = pipelined
    placed.measure(inputs, runs=1)
    text = placed.report(tmp_path / "plan.html").read_text()
    ids = [a["id"] for _, a in _parse(text).tags if "id" in a]
    assert len(ids) == len(set(ids)), sorted(i for i in set(ids) if ids.count(i) > 1)[:5]
    svgs = re.findall(r"<svg\b.*?</svg>", text, re.S)
    assert len(svgs) == 4
    xlink = "{http://www.w3.org/1999/xlink}href"
    for svg in svgs:
        root = ET.fromstring(svg)
        own = {e.get("id") for e in root.iter() if e.get("id")}
        refs = {r for e in root.iter() for k, v in e.attrib.items()
                for r in re.findall(r"url\(#([^)]+)\)", v) + ([v[1:]] if k in (xlink, "href") and v[:1] == "#" else [])}
        assert refs and refs <= own, refs - own


def test_report_of_a_plan_file_alone_and_with_its_workload(workload_plan, tmp_path):
    problem, plan = workload_plan
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "a.html")]) == 0
    alone = _parse((tmp_path / "a.html").read_text())
    _self_contained(alone)
    assert sum(t == "svg" for t, _ in alone.tags) == 2 and "--workload" in " ".join(alone.text)
    workload = str(LAYERS / "resnet50_inference.json")
    assert main(["report", str(tmp_path / "plan.json"), "--workload", workload, "-o", str(tmp_path / "b.html")]) == 0
    both = _parse((tmp_path / "b.html").read_text())
    assert sum(t == "svg" for t, _ in both.tags) == 3 and "memory" in " ".join(both.text)


def test_report_cli_errors_are_one_line(tmp_path, capsys, workload_plan):
    problem, plan = workload_plan
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json")]) == 2  # -o is required
    other = str(LAYERS / "bert24_inference.json")
    assert main(["report", str(tmp_path / "plan.json"), "--workload", other, "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert err.count("torchplace: error:") == 2
    assert "the plan was solved for another workload; give the workload file it was solved for" in err  # not a node


def test_report_of_a_plan_for_other_devices_names_the_options(tmp_path, capsys):
    bert = str(LAYERS / "bert24_inference.json")
    plan = str(tmp_path / "eight.json")
    assert main(["solve", bert, "--accelerators", "8", "--method", "dp", "-o", plan]) == 0
    capsys.readouterr()
    assert main(["report", plan, "--workload", bert, "--accelerators", "2", "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert "is not a valid plan of" in err and "unknown device" in err and "--accelerators" in err


def test_report_rebuilds_the_problem_the_plan_was_solved_for(tmp_path, capsys):
    """report --workload rebuilt every problem contiguous with the file's device counts: plans of
    `solve --noncontiguous` or `--accelerators 8` were refused, and a throughput plan reported with
    --objective latency printed its throughput value as its latency (found by fuzzing)."""
    bert = str(LAYERS / "bert24_inference.json")
    for name, options in (("pieces", ["--noncontiguous", "--method", "slicegraph", "--time-limit", "2"]),
                          ("eight", ["--accelerators", "8", "--method", "dp"])):
        plan = str(tmp_path / f"{name}.json")
        assert main(["solve", bert, *options, "-o", plan]) == 0
        assert main(["report", plan, "--workload", bert, "-o", str(tmp_path / f"{name}.html")]) == 0
    capsys.readouterr()
    plan = str(tmp_path / "eight.json")
    assert main(["report", plan, "--workload", bert, "--objective", "latency", "-o", str(tmp_path / "l.html")]) == 2
    assert "is not its latency on" in capsys.readouterr().err
    piper = str(WORKLOADS / "piper" / "bert32a100.json")
    assert main(["report", plan, "--workload", piper, "-o", str(tmp_path / "p.html")]) == 2
    assert "is a Piper workload" in capsys.readouterr().err


def test_latency_report_draws_transfers_on_links(tmp_path):
    problem = read_moirai_csv(MOIRAI)
    plan = solve(problem, method="moirai", time_limit=60)  # ~2 s; its optimum needs no limit (a loaded machine)
    text = render(plan, problem)
    assert " -&gt; " in text or " -> " in text
    _self_contained(_parse(text))


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium is not installed "
                    "(apt-get install chromium)")
def test_report_renders_in_headless_chromium(pipelined, tmp_path):
    from PIL import Image

    placed, inputs = pipelined
    placed.measure(inputs, runs=1)
    page = placed.report(tmp_path / "plan.html")
    shot = tmp_path / "shot.png"
    run = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--enable-logging=stderr", "--v=0", f"--screenshot={shot}", "--window-size=1200,2400",
                          page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 0, run.stderr[-2000:]
    assert "CONSOLE" not in run.stderr, [line for line in run.stderr.splitlines() if "CONSOLE" in line]
    image = Image.open(shot).convert("RGB")
    colors = image.getcolors(maxcolors=1 << 20) or []
    non_white = sum(n for n, c in colors if c != (255, 255, 255))
    assert non_white > 0.05 * image.width * image.height  # figures, not a blank page
    first_device = (0x4E, 0x79, 0xA7)  # the first device's colour fills schedule bars
    assert any(sum(abs(a - b) for a, b in zip(c, first_device)) < 12 and n > 500 for n, c in colors)


def test_bad_counts_for_measure_and_the_pictures_are_usage_errors(pipelined, workload_plan, tmp_path, capsys):
    """measure(runs=2.5) and plot_graph(None) raised TypeError and AttributeError, plot_schedule(problem, 0)
    drew 4 micro-batches, and report --microbatches 1e6 ran for minutes (found by fuzzing)."""
    placed, inputs = pipelined
    for runs in (2.5, float("nan"), "3", 0):
        with pytest.raises(UsageError, match="runs"):
            placed.measure(inputs, runs=runs)
    for m in (-1, 0, 2.5):
        with pytest.raises(UsageError, match="microbatches"):
            placed.plan.plot_schedule(placed.problem, m)
    with pytest.raises(UsageError, match="plot_graph needs the Problem"):
        placed.plan.plot_graph(None)
    problem, plan = workload_plan
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "r.html"), "--microbatches", "100000"]) == 2
    assert "is not readable" in capsys.readouterr().err


def test_report_of_a_piper_plan_with_its_problem(tmp_path, workloads_dir):
    """plan.report(path, problem) and plot_memory(plan, problem) with the Piper problem the plan was
    solved for looked the stages' device ranges up among the problem's devices: a KeyError from the
    cost model (found by fuzzing). The table is the plan's, the cap the problem's."""
    from torchplace.solvers import piper
    from torchplace.workloads import read_piper

    problem = read_piper(workloads_dir / "piper" / "bert32a100.json", devices=8, memory_bytes=8 * 2**30)
    plan = piper.solve(problem)
    page = Path(plan.report(tmp_path / "plan.html", problem)).read_text()
    assert "<td class=l>mode</td><td>training</td>" in page
    for s, c in zip(plan.stages, plan.costs):
        assert f"<td>{s.data_parallel}</td><td>{s.tensor_parallel}</td><td>{len(s.nodes)}</td>" in page
        assert f"<td>{c.allreduce:.4g}</td><td>{c.load:.4g}</td>" in page
    assert isinstance(plot_memory(plan, problem), Picture)


def test_report_options_of_the_workload_need_the_workload(tmp_path, capsys, workloads_dir):
    """report PLAN.json --objective latency / --noncontiguous / --accelerators / --cpus without
    --workload wrote the report as if they were not given (found by fuzzing, on a Piper plan)."""
    plan = tmp_path / "plan.json"
    assert main(["solve", str(workloads_dir / "piper" / "bert32a100.json"), "--devices", "4", "--memory-gb", "80",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    for extra in (["--objective", "latency"], ["--noncontiguous"], ["--accelerators", "2"], ["--cpus", "0"]):
        assert main(["report", str(plan), "-o", str(tmp_path / "r.html"), *extra]) == 2
        assert f"{extra[0]} describe the problem of --workload" in capsys.readouterr().err
    assert main(["report", str(plan), "-o", str(tmp_path / "r.html")]) == 0
