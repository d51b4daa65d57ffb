"""Closing the loop (issue 13, item 5): place(..., refine=True) measures its plan, solves again on
the measured stage times, and keeps the plan whose calls measure faster; the report shows both."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import torchplace
from torchplace import costmodel, refine
from torchplace.errors import UsageError
from torchplace.models import build
from torchplace.report.fidelity import Measurement, StageFidelity

QUICK = {"progress": False, "repeats": 1, "warmup": 0, "microbatches": 1}


def _measurement(stages):
    return Measurement(stages, "throughput", 0.0, 0.0, 0.0, 0.0, 1, 1)


def test_the_measured_graph_makes_the_cost_model_reproduce_each_measured_stage():
    model, inputs = build("mlp", batch=4)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], inputs, **QUICK)
    problem, plan = placed.problem, placed.plan
    before = costmodel.stage_costs(problem, plan.stages)
    wanted = [c.load * f for c, f in zip(before, (3.0, 0.5))]
    measured = _measurement([StageFidelity(i, s.device, "F", c.load, m)
                             for i, (s, c, m) in enumerate(zip(plan.stages, before, wanted))])
    graph = refine.measured_graph(problem, plan, measured)
    after = costmodel.stage_costs(dataclasses.replace(problem, graph=graph), plan.stages)
    assert [c.load for c in after] == pytest.approx(wanted, rel=1e-9)
    assert [c.transfer_in + c.transfer_out for c in after] == [c.transfer_in + c.transfer_out for c in before]
    assert problem.graph == placed.problem.graph  # the placed problem is left as it was


def test_refine_runs_both_plans_and_keeps_the_faster(monkeypatch, tmp_path):
    """The measurement is made to say the stage with the most nodes took 1000x its prediction and
    the other exactly its prediction (whatever a loaded machine measured), so the second solve
    spreads that stage's nodes over both devices (a slowed stage of one node could not shrink: both
    devices are CPUs, so its node is as slow on either): two plans run, the one that measured
    faster is kept, and it computes the model."""
    real = refine.measured_graph

    def slower_stage(problem, plan, measurement):
        slow = max(range(len(plan.stages)), key=lambda i: len(plan.stages[i].nodes))
        stages = [dataclasses.replace(s, measured=s.predicted * (1000 if s.stage == slow else 1)) for s in measurement.stages]
        return real(problem, plan, dataclasses.replace(measurement, stages=stages))

    monkeypatch.setattr(refine, "measured_graph", slower_stage)
    model, (x,) = build("mlp", batch=4)
    # a split, always: on a busy machine place() may find one device faster, and then the slower
    # stage is the whole model on either device, and the second solve rightly changes nothing
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), refine=True, allow_single_device=False, **QUICK)
    r = placed.refinement
    assert [run.costs for run in r.runs] == ["profiled", "measured"]
    first, second = r.runs
    assert [(s.device, s.nodes) for s in first.plan.stages] != [(s.device, s.nodes) for s in second.plan.stages]
    assert r.kept == (0 if first.wall <= second.wall else 1)
    assert placed.plan is r.runs[r.kept].plan
    assert second.on_measured <= first.on_measured  # solved on the measured costs, it is better there
    assert second.plan.lower_bound == first.plan.lower_bound <= second.plan.objective
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))
    page = placed.report(tmp_path / "plan.html").read_text()
    assert "Refined on measured costs" in page and "(kept)" in page
    assert "kept" in str(r)


def test_the_plan_solved_on_measured_costs_keeps_the_placements_micro_batches(monkeypatch, tmp_path):
    """(found by fuzzing) the plan solved on measured costs had no predicted call: kept, it said it
    runs with the default 4 micro-batches where the placed model ran 2, printed no predicted call,
    and saved and reused with plan= it ran with 4."""
    real = refine.measured_graph

    def slower_stage(problem, plan, measurement):  # as above: the second solve gives another plan
        slow = max(range(len(plan.stages)), key=lambda i: len(plan.stages[i].nodes))
        stages = [dataclasses.replace(s, measured=s.predicted * (1000 if s.stage == slow else 1)) for s in measurement.stages]
        return real(problem, plan, dataclasses.replace(measurement, stages=stages))

    monkeypatch.setattr(refine, "measured_graph", slower_stage)
    monkeypatch.setattr(refine.RefinedPlan, "wall", property(lambda r: 0.0 if r.costs == "measured" else 1.0))
    model, (x,) = build("mlp", batch=4)
    options = {**QUICK, "microbatches": 2}
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), refine=True, allow_single_device=False, **options)
    assert placed.refinement.kept == 1 and placed.microbatches == 2
    assert placed.plan.microbatches == 2 and "predicted call" in str(placed.plan)
    assert placed.measure(x, runs=1, warmup=0).predicted_wall == placed.plan.meta["call"]["seconds"]
    placed.plan.save(tmp_path / "plan.json")
    again = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), plan=tmp_path / "plan.json", **QUICK | {"microbatches": None})
    assert again.microbatches == 2
    with torch.no_grad():
        assert torch.equal(again(x), torch.cat([model(c) for c in x.tensor_split(2)]))


def test_refine_keeps_the_plan_when_the_measured_costs_give_it_again():
    model, (x,) = build("mlp", batch=4)
    placed = torchplace.place(model, ["cpu:0"], (x,), refine=True, **QUICK)  # one device: one plan
    assert len(placed.refinement.runs) == 1 and placed.refinement.kept == 0
    assert "same plan" in str(placed.refinement)
    assert placed.last_measurement is placed.refinement.runs[0].measured
    assert "profile" in placed.plan.meta  # the kept plan is cacheable as any other
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))


def test_refine_is_refused_for_training_and_must_be_a_bool():
    model, inputs = build("mlp", batch=4)
    with pytest.raises(UsageError, match="refine=True measures inference calls"):
        torchplace.place(model, ["cpu:0", "cpu:1"], inputs, mode="training", refine=True, **QUICK)
    with pytest.raises(UsageError, match="refine must be True or False"):
        torchplace.place(model, ["cpu:0", "cpu:1"], inputs, refine="yes", **QUICK)


class CountsAndWritesItsInput(torch.nn.Module):
    """A step counter in a buffer, and its input written in place: every call changes both."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        self.n += 1
        x.add_(1)
        return self.layers(x) * self.n


def test_refine_leaves_the_models_buffers_and_the_example_as_they_were():
    """The measured calls left the counter at 4 (the placed model's first call then differed from
    the model's) and the caller's example 4 higher."""
    import copy

    torch.manual_seed(0)
    model = CountsAndWritesItsInput().eval()
    reference, x = copy.deepcopy(model), torch.randn(8, 16)
    example = x.clone()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (example,), refine=True, allow_single_device=False,
                              time_limit=2, **QUICK)
    assert torch.equal(example, x) and model.n.item() == 0
    with torch.no_grad():
        assert torch.equal(placed(x.clone()), reference(x.clone()))
