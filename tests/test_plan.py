"""Plan validation, cost-model consistency, JSON, printing and device maps."""
from __future__ import annotations

import json

import pytest

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InvalidPlanError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.solvers.bounds import simple_lower_bound


def _problem(contiguous=True, mem=None):
    """a -> b -> c and a -> c; b is colocated with c; c has 8 parameter bytes."""
    g = OpGraph()
    g.add_node("a", NodeRecord("a", module="enc", param_bytes=4, times={"accel": 1.0, "cpu": 4.0}, transfer_time=0.25))
    g.add_node("b", NodeRecord("b", module="dec.0", times={"accel": 2.0, "cpu": 5.0}, transfer_time=0.5, colocation="k"))
    g.add_node("c", NodeRecord("c", module="dec.1", param_bytes=8, times={"accel": 3.0}, colocation="k"))
    for u, v in [("a", "b"), ("b", "c"), ("a", "c")]:
        g.add_edge(u, v)
    devices = (Device("acc0", "meta", "accel", mem), Device("acc1", "meta", "accel", mem), Device("cpu0", "cpu", "cpu"))
    return Problem(g, Cluster(devices), contiguous=contiguous)


def test_cost_model_counts_each_tensor_once_per_side():
    p = _problem()
    costs = {c.device: c for c in costmodel.evaluate_stages(p, [Stage("acc0", ("a",)), Stage("acc1", ("b", "c"))])[1]}
    # a's output goes to b and c on acc1: paid once out of acc0, once into acc1
    assert costs["acc0"].transfer_out == 0.25 and costs["acc0"].transfer_in == 0
    assert costs["acc1"].transfer_in == 0.25 and costs["acc1"].transfer_out == 0
    assert costs["acc1"].load == 5.25
    # the CPU pays no transfers
    cpu = costmodel.device_cost(p, {"a"}, p.cluster.device("cpu0"))
    assert (cpu.transfer_in, cpu.transfer_out, cpu.load) == (0, 0, 4.0)


@pytest.mark.parametrize(
    "stages, message",
    [
        ([Stage("acc0", ("a", "b"))], "not placed"),
        ([Stage("acc0", ("a", "b", "c")), Stage("acc1", ("a",))], "two stages"),
        ([Stage("gpu9", ("a", "b", "c"))], "unknown device"),
        ([Stage("acc0", ("a",)), Stage("cpu0", ("b", "c"))], "cannot run on 'cpu0'"),
        ([Stage("acc0", ("a", "b")), Stage("acc1", ("c",))], "colocation group 'k' is split"),
        ([Stage("acc1", ("b", "c")), Stage("acc0", ("a",))], "goes from stage 1 back to stage 0"),
        ([Stage("acc0", ("a", "x"))], "not a node of the graph"),
    ],
)
def test_validate_rejects(stages, message):
    plan = Plan(stages, 0.0, 0.0, "test", 0.0)
    with pytest.raises(InvalidPlanError, match=message):
        plan.validate(_problem())


def test_building_a_plan_on_devices_the_cluster_lacks_is_refused_with_the_fix():
    """A plan file reused with fewer devices failed with a bare KeyError from the cost model."""
    with pytest.raises(InvalidPlanError, match=r"stages on 'gpu9', which is not among the devices.*plan's devices"):
        Plan.build(_problem(), [Stage("gpu9", ("a", "b", "c"))], solver="test", seconds=0.0, lower_bound=0.0)


def test_validate_rejects_memory_overflow():
    plan = Plan([Stage("acc0", ("a", "b", "c"))], 0.0, 0.0, "test", 0.0)
    with pytest.raises(InvalidPlanError, match="needs 12 bytes but has 10"):
        plan.validate(_problem(mem=10))


def test_validate_rejects_non_contiguous_when_asked():
    g = OpGraph()
    for n in "xyz":
        g.add_node(n, NodeRecord(n, times={"cpu": 1.0}))
    g.add_edge("x", "y")
    g.add_edge("y", "z")
    cluster = Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu")))
    plan = Plan([Stage("cpu0", ("x",)), Stage("cpu1", ("y",)), Stage("cpu0", ("z",))], 0.0, 0.0, "t", 0.0)
    with pytest.raises(InvalidPlanError, match="not contiguous"):
        plan.validate(Problem(g, cluster))
    plan.validate(Problem(g, cluster, contiguous=False))  # fine as non-contiguous


def _crossing(contiguous: bool, backward: bool = False) -> Problem:
    """Edges 1 -> 4 and 2 -> 5 on six nodes (all forward or all backward)."""
    g = OpGraph()
    for i in range(6):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": 1.0}, backward=backward))
    g.add_edge("1", "4")
    g.add_edge("2", "5")
    cluster = Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu")))
    return Problem(g, cluster, mode="training" if backward else "inference", contiguous=contiguous)


@pytest.mark.parametrize("backward", [False, True])
def test_validate_rejects_contiguous_pieces_that_feed_each_other(backward):
    """A = {1, 5} and B = {2, 4} are each contiguous (Def. 3.1), but A -> B (1 -> 4) and
    B -> A (2 -> 5): no order of the devices lets data only flow forward (Fact 5.2)."""
    plan = Plan([Stage("cpu0", ("0", "1")), Stage("cpu1", ("2", "3", "4")), Stage("cpu0", ("5",))], 0.0, 0.0, "t", 0.0)
    side = "backward" if backward else "forward"
    with pytest.raises(InvalidPlanError, match=f"the {side} pieces feed each other in a cycle of devices cpu[01] -> cpu[01] -> cpu[01]"):
        plan.validate(_crossing(contiguous=True, backward=backward))
    plan.validate(_crossing(contiguous=False, backward=backward))


def test_validate_accepts_an_ordered_contiguous_split():
    plan = Plan([Stage("cpu0", ("0", "1", "2", "3")), Stage("cpu1", ("4", "5"))], 0.0, 0.0, "t", 0.0)
    plan.validate(_crossing(contiguous=True))


def test_solver_plan_round_trips_and_prints(tmp_path):
    p = _problem()
    plan = dp.solve(p)
    assert plan.objective == costmodel.evaluate(p, plan)
    assert plan.lower_bound == simple_lower_bound(p) <= plan.objective
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again.stages == plan.stages and again.objective == plan.objective and again.costs == plan.costs
    text = str(plan)
    for word in ("stage", "device", "#ops", "compute", "xfer in", "xfer out", "memory", "load", "lower bound", "gap"):
        assert word in text
    # a plan file written by hand, without costs, printed a header and no stages (found by fuzzing)
    data = plan.to_json()
    data.pop("costs", None)
    (tmp_path / "hand.json").write_text(json.dumps(data))
    lines = str(Plan.load(tmp_path / "hand.json")).splitlines()
    rows = [line.split() for line in lines[2:2 + len(plan.stages)]]
    assert [(r[0], r[1], r[2]) for r in rows] == [(str(i), s.device, str(len(s.nodes))) for i, s in enumerate(plan.stages)]
    assert all(r[3:] == ["-"] * 5 for r in rows)


def test_simple_lower_bound_is_max_of_largest_group_and_average():
    p = _problem()
    # groups: a (min 1.0), {b, c} (only accel runs c: 5.0); total 6.0 over 3 devices = 2.0
    assert simple_lower_bound(p) == 5.0


def test_device_map_in_accelerate_form():
    p = _problem()
    plan = Plan([Stage("acc0", ("a",)), Stage("acc1", ("b", "c"))], 0.0, 0.0, "t", 0.0)
    assert plan.device_map(p) == {"enc": "acc0", "dec": "acc1"}
    whole = Plan([Stage("acc0", ("a", "b", "c"))], 0.0, 0.0, "t", 0.0)
    assert whole.device_map(p) == {"": "acc0"}


def test_a_bound_above_the_objective_is_a_bug_not_clamped():
    p = _problem()
    stages = dp.solve(p).stages
    with pytest.raises(AssertionError, match="lower bound .* exceeds the objective"):
        Plan.build(p, stages, solver="broken", seconds=0.0, lower_bound=1e9)


def test_an_invalid_plan_is_refused_as_invalid_whatever_its_bound():
    # found on a GPU: the whole model on a capped fast device beats the split's true bound, but
    # does not fit; build() must say "invalid", not "your bound is wrong"
    p = _problem(mem=10)
    with pytest.raises(InvalidPlanError, match="needs 12 bytes but has 10"):
        Plan.build(p, [Stage("acc0", ("a", "b", "c"))], solver="one device", seconds=0.0, lower_bound=100.0)


@pytest.mark.parametrize("objective", ["latency", "throughput"])
def test_one_device_too_small_for_the_model_is_skipped_not_an_error(objective):
    from torchplace import callplan
    from torchplace.callmodel import Overheads

    g = OpGraph()
    g.add_node("a", NodeRecord("a", param_bytes=8, output_bytes=4, times={"fast": 1.0, "cpu": 10.0}))
    g.add_node("b", NodeRecord("b", param_bytes=8, times={"fast": 1.0, "cpu": 10.0}))
    g.add_edge("a", "b")
    cluster = Cluster((Device("gpu", "meta", "fast", 12), Device("cpu", "cpu", "cpu")))
    p = Problem(g, cluster, objective=objective)
    split = Plan.build(p, [Stage("gpu", ("a",)), Stage("cpu", ("b",))], solver="test", seconds=0.0, lower_bound=10.0)
    assert callplan._single_plans(p, split)[0].stages[0].device == "cpu"  # the GPU (2 s alone) holds 8 of 16 bytes
    decision = callplan.decide(p, split, 1, None, lambda m: None, overheads=Overheads())
    assert decision.plan.meta["single_device"]["device"] == "cpu"
