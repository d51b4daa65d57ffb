"""The latency simulation (costmodel.simulate): exact schedules on small cases."""
from __future__ import annotations

import dataclasses

import pytest

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem


def _diamond(link: float = 2.0) -> Problem:
    """a -> (b, c) -> d; a and d take 1 s, b and c 3 s on 'gpu'; every cross-device move ``link`` s."""
    g = OpGraph()
    for v, t in zip("abcd", (1.0, 3.0, 3.0, 1.0)):
        g.add_node(v, NodeRecord(v, times={"gpu": t}, link_times={"g0->g1": link, "g1->g0": link}))
    for u, v in ("ab", "ac", "bd", "cd"):
        g.add_edge(u, v)
    devs = (Device("g0", "meta", "gpu", None), Device("g1", "meta", "gpu", None))
    return Problem(g, Cluster(devs), objective="latency")


def test_one_device_runs_nodes_back_to_back() -> None:
    p = _diamond()
    s = costmodel.simulate(p, [Stage("g0", tuple("abcd"))])
    assert s.start == {"a": 0, "b": 1, "c": 4, "d": 7}
    assert s.makespan == 8 and s.transfers == []


def test_branches_on_two_devices_overlap_after_the_transfer() -> None:
    p = _diamond(link=0.5)
    s = costmodel.simulate(p, [Stage("g0", ("a", "b")), Stage("g1", ("c",)), Stage("g0", ("d",))])
    # c waits for a's output (0.5 s), runs 1.5..4.5, its output reaches g0 at 5.0; b ran 1..4.
    assert s.start == {"a": 0, "b": 1, "c": 1.5, "d": 5.0}
    assert s.makespan == 6.0
    assert [(t.node, t.src, t.dst, t.start, t.finish) for t in s.transfers] == [
        ("a", "g0", "g1", 1.0, 1.5), ("c", "g1", "g0", 4.5, 5.0)]


def test_slow_link_makes_splitting_worse_and_plan_build_uses_simulation() -> None:
    p = dataclasses.replace(_diamond(link=5.0), contiguous=False)
    split = Plan.build(p, [Stage("g0", ("a", "b")), Stage("g1", ("c",)), Stage("g0", ("d",))],
                       solver="hand", seconds=0, lower_bound=0, status="feasible")
    single = Plan.build(p, [Stage("g0", tuple("abcd"))], solver="hand", seconds=0, lower_bound=0)
    assert (split.objective, single.objective) == (15.0, 8.0)  # c: 6..9, back at 14, d: 14..15
    assert costmodel.evaluate(p, split) == 15.0


def test_transfers_out_of_one_device_serialize() -> None:
    g = OpGraph()
    g.add_node("s", NodeRecord("s", times={"gpu": 1.0}, link_times={"g0->g1": 2.0, "g0->g2": 2.0}))
    for v in ("x", "y"):
        g.add_node(v, NodeRecord(v, times={"gpu": 1.0}))
        g.add_edge("s", v)
    devs = tuple(Device(f"g{i}", "meta", "gpu", None) for i in range(3))
    p = Problem(g, Cluster(devs), objective="latency")
    s = costmodel.simulate(p, [Stage("g0", ("s",)), Stage("g1", ("x",)), Stage("g2", ("y",))])
    assert [(t.dst, t.start) for t in s.transfers] == [("g1", 1.0), ("g2", 3.0)]
    assert s.makespan == 6.0


def test_a_port_serves_transfers_in_plan_order() -> None:
    # a (g0, 1 s) and b (g1, 2 s) both send to g2 over its one in-port, a for 4 s, b for 1 s.
    g = OpGraph()
    for v, dev, t, link in (("a", "g0", 1.0, 4.0), ("b", "g1", 2.0, 1.0)):
        g.add_node(v, NodeRecord(v, times={dev: t}, link_times={f"{dev}->g2": link}))
    g.add_node("z", NodeRecord("z", times={"g2": 1.0}))
    for u in "ab":
        g.add_edge(u, "z")
    devs = tuple(Device(f"g{i}", "meta", f"g{i}", None) for i in range(3))
    p = Problem(g, Cluster(devs), objective="latency")
    a_first = costmodel.simulate(p, [Stage("g0", ("a",)), Stage("g1", ("b",)), Stage("g2", ("z",))])
    assert [(t.node, t.start, t.finish) for t in a_first.transfers] == [("a", 1.0, 5.0), ("b", 5.0, 6.0)]
    # b first in plan order: the port waits for b although a's output is ready at 1
    b_first = costmodel.simulate(p, [Stage("g1", ("b",)), Stage("g0", ("a",)), Stage("g2", ("z",))])
    assert [(t.node, t.start, t.finish) for t in b_first.transfers] == [("b", 2.0, 3.0), ("a", 3.0, 7.0)]
    assert (a_first.makespan, b_first.makespan) == (7.0, 8.0)


def test_per_side_transfer_time_is_paid_by_each_accelerator_end() -> None:
    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"accel": 1.0, "cpu": 1.0}, transfer_time=2.0))
    g.add_node("b", NodeRecord("b", times={"accel": 1.0, "cpu": 1.0}))
    g.add_edge("a", "b")
    devs = (Device("acc0", "meta", "accel", None), Device("acc1", "meta", "accel", None),
            Device("cpu0", "cpu", "cpu", None), Device("cpu1", "cpu", "cpu", None))
    p = Problem(g, Cluster(devs), objective="latency")
    lat = {pair: costmodel.simulate(p, [Stage(pair[0], ("a",)), Stage(pair[1], ("b",))]).makespan
           for pair in [("acc0", "acc1"), ("acc0", "cpu0"), ("cpu0", "cpu1")]}
    assert lat == {("acc0", "acc1"): 6.0, ("acc0", "cpu0"): 4.0, ("cpu0", "cpu1"): 2.0}


def test_a_node_before_its_input_in_plan_order_is_reported() -> None:
    p = _diamond()
    with pytest.raises(ValueError, match="runs 'd' before its input"):
        costmodel.simulate(p, [Stage("g0", ("d",)), Stage("g0", tuple("abc"))])


def test_bounds_round_up_only_when_every_objective_is_an_integer() -> None:
    from torchplace.solvers.bounds import integral_objective, round_up_bound

    p = _diamond(link=2.0)
    assert integral_objective(p) and round_up_bound(p, 29.9999991) == 30.0 and round_up_bound(p, 29.0000004) == 29.0
    q = _diamond(link=0.5)
    assert not integral_objective(q) and round_up_bound(q, 29.9999991) == 29.9999991
