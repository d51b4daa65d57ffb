"""torchplace.solvers.repair: a plan that overfills devices made to fit, priced with liveness memory."""
from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers import solve
from torchplace.solvers.liveness import relaxed
from torchplace.solvers.repair import renamed, repair

from tests.test_liveness import _live_training_problems


@st.composite
def _dags(draw):
    """Small DAGs (a chain with skip edges) with liveness memory on 2-3 CPUs with memory limits."""
    n = draw(st.integers(3, 8))
    g = OpGraph(meta={"liveness": True, "outputs": [f"v{n - 1}"]})
    for i in range(n):
        out = draw(st.sampled_from([4, 10, 40, 100]))
        g.add_node(f"v{i}", NodeRecord(f"v{i}", fx_nodes=(f"v{i}",), output_bytes=out, temp_bytes=out,
                                       peak_bytes=out, param_bytes=draw(st.sampled_from([0, 10, 30])),
                                       times={"cpu": float(draw(st.integers(1, 4)))}))
        if i:
            g.add_edge(f"v{i - 1}", f"v{i}")
    for a, b in draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2)):
        if a + 1 < b:
            g.add_edge(f"v{a}", f"v{b}")
    caps = draw(st.lists(st.sampled_from([60, 100, 150, 200]), min_size=2, max_size=3))
    contiguous = draw(st.booleans())
    devices = tuple(Device(f"cpu:{i}", "cpu", "cpu", cap) for i, cap in enumerate(caps))
    return Problem(g, Cluster(devices), contiguous=contiguous)


@settings(max_examples=60, deadline=None)
@given(_dags())
def test_what_the_repair_returns_is_a_valid_plan_that_fits(p):
    try:
        start = solve(relaxed(p), "dp" if p.contiguous else "ip")
    except InfeasibleError:
        return
    stages = repair(p, start)
    if stages is None:
        return
    plan = Plan.build(p, stages, solver="repair", seconds=0.0, lower_bound=0.0, status="feasible")  # validates
    caps = {d.name: d.memory_bytes for d in p.cluster.devices}
    assert all(need <= caps[d] for d, need in costmodel.device_memory(p, plan.stages).items())


@settings(max_examples=40, deadline=None)
@given(_dags())
def test_renamings_report_the_overflow_they_have(p):
    try:
        start = solve(relaxed(p), "dp")
    except InfeasibleError:
        return
    caps = {d.name: d.memory_bytes for d in p.cluster.devices}
    seen = []
    for over, stages in renamed(p, start.stages):
        need = costmodel.device_memory(p, stages)
        assert over == sum(max(n - caps[d], 0) for d, n in need.items())
        assert sorted(s.nodes for s in stages) == sorted(s.nodes for s in start.stages)
        assert [s.device for s in stages] != [s.device for s in start.stages]
        seen.append(over)
    assert seen == sorted(seen)


def test_the_walk_stops_at_its_deadline():
    from tests.test_liveness import _chain_of

    p = _chain_of([(100, 30, 2.0), (100, 10, 2.0), (40, 0, 3.0), (10, 0, 2.0), (4, 30, 1.0), (40, 0, 1.0),
                   (4, 10, 1.0)], (150, 200))
    start = solve(relaxed(p), "dp")
    assert max(costmodel.device_memory(p, start.stages).values()) > 200  # does not fit as it is
    assert repair(p, start) is not None
    assert repair(p, start, deadline=time.perf_counter()) is None


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_fitting_plan_is_returned_as_it_is(contiguous):
    from tests.test_liveness import _chain_of

    p = dataclasses.replace(_chain_of([(4, 10, 1.0), (4, 10, 1.0), (4, 10, 1.0)], (200, 200)), contiguous=contiguous)
    start = solve(relaxed(p), "dp" if contiguous else "ip")
    assert repair(p, start) == list(start.stages)


def test_the_renamings_that_overflow_least_come_first_however_many_devices():
    """Six one-node pieces on six devices, the large piece on a small device: the one renaming
    that fits (it and the first piece swapped) lay past the first 64 in a fixed order."""
    g = OpGraph(meta={"liveness": True, "outputs": ["v5"]})
    for i, out in enumerate([4, 100, 4, 4, 4, 4]):
        g.add_node(f"v{i}", NodeRecord(f"v{i}", fx_nodes=(f"v{i}",), output_bytes=out, temp_bytes=out,
                                       peak_bytes=out, param_bytes=10, times={"cpu": 1.0}))
        if i:
            g.add_edge(f"v{i - 1}", f"v{i}")
    p = Problem(g, Cluster(tuple(Device(f"d{i}", "cpu", "cpu", cap) for i, cap in enumerate([1000] + [60] * 5))))
    stages = [Stage(f"d{i}", (f"v{i}",)) for i in range(6)]
    assert costmodel.device_memory(p, stages)["d1"] == 110
    out = renamed(p, stages)
    assert out[0][0] == 0 and [s.device for s in out[0][1]][:2] == ["d1", "d0"]
    assert [over for over, _ in out] == sorted(over for over, _ in out)


def test_a_piece_is_never_renamed_onto_a_device_that_cannot_run_it():
    g = OpGraph(meta={"liveness": True, "outputs": ["b"]})
    g.add_node("a", NodeRecord("a", fx_nodes=("a",), output_bytes=100, temp_bytes=100, peak_bytes=100,
                               times={"cpu": 1.0}))  # no accelerator time: runs on CPUs only
    g.add_node("b", NodeRecord("b", fx_nodes=("b",), output_bytes=4, temp_bytes=4, peak_bytes=4,
                               times={"cpu": 1.0, "accel": 1.0}))
    g.add_edge("a", "b")
    p = Problem(g, Cluster((Device("cpu:0", "cpu", "cpu", 50), Device("acc", "meta", "accel", 1000))))
    out = renamed(p, [Stage("cpu:0", ("a",)), Stage("acc", ("b",))])
    assert all(s.device != "acc" for _, stages in out for s in stages if s.nodes == ("a",))


@settings(max_examples=150, deadline=None)
@given(_live_training_problems(), st.lists(st.sampled_from([20, 40, 80, 160]), min_size=2, max_size=2))
def test_training_plans_stay_valid_each_backward_node_with_its_forward_node(case, caps):
    p = case[0]
    for v, r in list(p.graph.records()):
        p.graph.replace_record(v, dataclasses.replace(r, colocation=f"c{v[1:]}"))  # f3 with b3, as traced
    p = dataclasses.replace(p, cluster=Cluster(tuple(dataclasses.replace(d, memory_bytes=cap)
                                                     for d, cap in zip(p.cluster.devices, caps))))
    try:
        start = solve(relaxed(p), "dp")
    except InfeasibleError:
        return
    stages = repair(p, start)
    if stages is not None:
        Plan.build(p, stages, solver="repair", seconds=0.0, lower_bound=0.0, status="feasible")  # validates


def test_a_plan_built_on_the_true_problem_keeps_its_solvers_proofs_only_as_it_was_solved():
    """The DP's meta says its plan is optimal among contiguous splits, with the table's value: true
    of the relaxation's plan as solved, not of a restriction's or of a changed plan (a restricted
    or repaired plan printed "proven optimal among contiguous splits" beside a 40% gap)."""
    from torchplace.solvers.stand_in import CLAIMS, on_true_problem
    from tests.test_liveness import _chain_of

    p = _chain_of([(4, 10, 1.0), (4, 10, 1.0), (4, 10, 1.0)], (200, 200))
    solved = solve(relaxed(p), "dp")
    claims = {**solved.meta, "optimal_among": "contiguous splits"}
    solved = dataclasses.replace(solved, meta=claims)
    kept = on_true_problem(p, solved, 0.0, "relaxed", key="how", kept=True)
    assert all(k in kept.meta for k in CLAIMS) and kept.status == solved.status == "optimal"
    changed = on_true_problem(p, solved, 0.0, "conservative", key="how")
    assert not any(k in changed.meta for k in CLAIMS) and changed.status == "feasible"
    assert changed.objective == costmodel.evaluate(p, changed) and changed.meta["how"] == "conservative"
    assert on_true_problem(p, solved, changed.objective, "conservative", key="how").status == "optimal"  # by bound
