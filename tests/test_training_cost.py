"""The training cost model: activations in flight per schedule and pipeline position, and
activation recomputation (issue 10, item 3)."""
from __future__ import annotations

import pytest

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InvalidPlanError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Pipeline, Problem


def _training_chain(n: int = 3) -> OpGraph:
    """f0 -> f1 -> ... -> b(n-1) -> ... -> b0, each fi colocated with bi; fi keeps 100 bytes."""
    g = OpGraph()
    for i in range(n):
        g.add_node(f"f{i}", NodeRecord(f"f{i}", param_bytes=10, output_bytes=40, temp_bytes=20, saved_bytes=100,
                                       times={"accel": 1.0 + i}, colocation=f"c{i}", transfer_time=0.0))
    for i in range(n):
        g.add_node(f"b{i}", NodeRecord(f"b{i}", param_bytes=30, times={"accel": 2.0 + i}, colocation=f"c{i}",
                                       backward=True, transfer_time=0.0))
    for i in range(n - 1):
        g.add_edge(f"f{i}", f"f{i + 1}")
        g.add_edge(f"b{i + 1}", f"b{i}")
    for i in range(n):
        g.add_edge(f"f{i}", f"b{i}")
    return g


def _problem(schedule: str, m: int = 4, recompute: bool = True, n: int = 3) -> Problem:
    devices = tuple(Device(f"d{i}", "meta", "accel") for i in range(n))
    return Problem(_training_chain(n), Cluster(devices), mode="training",
                   pipeline=Pipeline(microbatches=m, schedule=schedule, recompute=recompute))


def _one_per_device(n: int = 3, recompute: tuple[bool, ...] = ()) -> list[Stage]:
    rc = recompute or (False,) * n
    return [Stage(f"d{i}", (f"f{i}",), rc[i]) for i in range(n)] + [
        Stage(f"d{i}", (f"b{i}",), rc[i]) for i in reversed(range(n))]


def test_1f1b_holds_fewer_microbatches_further_down_the_pipeline():
    stages = _one_per_device()
    assert costmodel.in_flight(_problem("1f1b", m=4), stages) == {"d0": 3, "d1": 2, "d2": 1}
    assert costmodel.in_flight(_problem("1f1b", m=2), stages) == {"d0": 2, "d1": 2, "d2": 1}
    assert costmodel.in_flight(_problem("gpipe", m=4), stages) == {"d0": 4, "d1": 4, "d2": 4}
    # the executor ranks forward stages, not devices: d1 holding the last two runs the middle
    # one's warm-up, two micro-batches (it was ranked last of two devices: 1)
    two = [Stage("d0", ("f0",)), Stage("d1", ("f1",)), Stage("d1", ("f2",)), Stage("d1", ("b2",)),
           Stage("d1", ("b1",)), Stage("d0", ("b0",))]
    assert costmodel.in_flight(_problem("1f1b", m=4), two) == {"d0": 3, "d1": 2}


@pytest.mark.parametrize("schedule, holds", [("1f1b", {"d0": 3, "d1": 2, "d2": 1}), ("gpipe", {"d0": 4, "d1": 4, "d2": 4})])
def test_memory_is_params_plus_one_microbatch_of_work_plus_the_activations_in_flight(schedule, holds):
    problem = _problem(schedule, m=4)
    need = costmodel.device_memory(problem, _one_per_device())
    # params 10 + grads/optimizer 30, work ceil(20 / 4) = 5, saved ceil(100 / 4) = 25 per micro-batch
    assert need == {d: 10 + 30 + 5 + 25 * k for d, k in holds.items()}


def test_recomputing_keeps_the_inputs_and_runs_the_forward_twice():
    problem = _problem("1f1b", m=4)
    stages = _one_per_device(recompute=(False, True, False))
    need = costmodel.device_memory(problem, stages)
    # d1 keeps f0's output (40 bytes, 10 per micro-batch) for its 2 in flight, and recomputes one
    # micro-batch's 25 bytes at a time
    assert need["d1"] == 10 + 30 + 5 + 2 * 10 + 25
    plan = Plan.build(problem, stages, solver="manual", seconds=0.0, lower_bound=0.0)
    loads = {c.device: c.load for c in plan.costs}
    assert loads == {"d0": 1.0 + 2.0, "d1": 2.0 + 3.0 + 2.0, "d2": 3.0 + 4.0}
    assert plan.objective == 7.0 == costmodel.evaluate(problem, plan)


def test_a_recomputing_stage_needs_a_pipeline_that_allows_it():
    stages = _one_per_device(recompute=(True, False, False))
    with pytest.raises(InvalidPlanError, match="recomputation"):
        Plan.build(_problem("1f1b", recompute=False), stages, solver="manual", seconds=0.0, lower_bound=0.0)
    bare = Problem(_training_chain(), _problem("1f1b").cluster, mode="training")
    with pytest.raises(InvalidPlanError, match="recomputation"):
        Plan.build(bare, stages, solver="manual", seconds=0.0, lower_bound=0.0)


def test_memory_caps_apply_to_the_plan_s_in_flight_memory():
    devices = tuple(Device(f"d{i}", "meta", "accel", 10 + 30 + 5 + 25 * 2) for i in range(3))
    problem = Problem(_training_chain(), Cluster(devices), mode="training", pipeline=Pipeline(4, "1f1b"))
    with pytest.raises(InvalidPlanError, match="'d0' needs 120 bytes"):  # holds 3 micro-batches
        Plan.build(problem, _one_per_device(), solver="manual", seconds=0.0, lower_bound=0.0)
    plan = Plan.build(problem, _one_per_device(recompute=(True, False, False)), solver="manual", seconds=0.0,
                      lower_bound=0.0)
    assert plan.stages[0].recompute


def test_a_recomputing_plan_round_trips_through_json(tmp_path):
    problem = _problem("1f1b")
    plan = Plan.build(problem, _one_per_device(recompute=(False, True, False)), solver="manual", seconds=0.0,
                      lower_bound=0.0)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").stages == plan.stages


def test_without_a_pipeline_the_published_model_holds():
    problem = Problem(_training_chain(), _problem("1f1b").cluster, mode="training")
    need = costmodel.device_memory(problem, _one_per_device())
    assert need == {d: 10 + 20 + 30 for d in ("d0", "d1", "d2")}
