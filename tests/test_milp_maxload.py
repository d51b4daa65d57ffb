"""The max-load IP (Tarnawski App. C) and the MTPP MIP (Archer Sec. 3.1) against brute force and the DP."""
from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import replace

import pyomo.environ as pyo
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, InvalidPlanError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan, Stage
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.solvers.milp import maxload, mtpp
from torchplace.solvers.milp.bounds import guess_the_bottleneck_bound
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import has_pipeline_order, problems, scaled_chain
from .graphs import training_problems as random_training_problems

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def brute_force(problem: Problem, *, contiguous: bool) -> float:
    """Min max-load over every assignment that keeps colocation, support and memory; with
    ``contiguous``, one whose devices run as a pipeline (:func:`has_pipeline_order`)."""
    g, devices = problem.graph, problem.cluster.devices
    nodes = list(g)
    best = math.inf
    for choice in itertools.product(devices, repeat=len(nodes)):
        assign = dict(zip(nodes, choice))
        if any(math.isinf(problem.node_time(v, d)) for v, d in assign.items()):
            continue
        groups: dict[str, set[str]] = {}
        for v, r in g.records():
            if r.colocation is not None:
                groups.setdefault(r.colocation, set()).add(assign[v].name)
        if any(len(s) > 1 for s in groups.values()):
            continue
        held = {d.name: [v for v in nodes if assign[v] is d] for d in devices}
        if any(d.memory_bytes is not None and costmodel.memory(problem, held[d.name]) > d.memory_bytes for d in devices):
            continue
        if contiguous and not has_pipeline_order(problem, {v: d.name for v, d in assign.items()}):
            continue
        stages = [Stage(name, tuple(vs)) for name, vs in held.items() if vs]
        best = min(best, costmodel.evaluate_stages(problem, stages)[0])
    return best


def _solve_or_inf(solver, problem, **opts) -> Plan | None:
    try:
        return solver(problem, **opts)
    except InfeasibleError:
        return None


def _check(plan: Plan, problem: Problem) -> None:
    """The plan validates and its objective is the cost model's and (proven optimal) the MILP's."""
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective * (1 + 1e-9)
    if plan.status == "optimal":
        assert plan.objective == pytest.approx(plan.meta["milp_objective"], rel=1e-6, abs=1e-9)


# -- max-load IP --------------------------------------------------------------------------------
def _assert_ip_matches_brute_force(problem: Problem, *, contiguous: bool) -> Plan | None:
    """The IP's optimum is brute force's (both infeasible, or equal values); its plan checks out."""
    expected = brute_force(problem, contiguous=contiguous)
    plan = _solve_or_inf(maxload.solve, problem, contiguous=contiguous)
    if plan is None:
        assert math.isinf(expected)
        return None
    _check(plan, replace(problem, contiguous=contiguous))
    assert plan.objective == pytest.approx(expected, rel=1e-6, abs=1e-9)
    return plan


@FAST
@given(problems(max_nodes=5))
def test_contiguous_ip_matches_brute_force(problem):
    _assert_ip_matches_brute_force(problem, contiguous=True)


@FAST
@given(problems(max_nodes=7), st.sampled_from(["none", "index", "load"]))
def test_contiguous_ip_equals_dp(problem, symmetry):
    """Both search the chains of ideals (Fact 5.2), i.e. the splits with an acyclic quotient graph."""
    expected = _solve_or_inf(dp.solve, problem)
    plan = _solve_or_inf(maxload.solve, problem, contiguous=True, symmetry=symmetry, mip_gap=1e-9)
    assert (expected is None) == (plan is None)
    if plan is None:
        return
    _check(plan, problem)
    assert plan.objective == pytest.approx(expected.objective, rel=1e-9, abs=1e-12)


@FAST
@given(problems(max_nodes=5))
def test_noncontiguous_ip_matches_brute_force(problem):
    plan = _assert_ip_matches_brute_force(problem, contiguous=False)
    if plan is not None:
        assert plan.lower_bound == pytest.approx(plan.objective, rel=1e-6, abs=1e-9)  # the IP's proof


@FAST
@given(problems(max_nodes=7), st.sampled_from(["index", "load", "none"]))
def test_noncontiguous_is_at_most_contiguous_under_every_symmetry_rule(problem, symmetry):
    plans = [_solve_or_inf(maxload.solve, problem, contiguous=c, symmetry=symmetry) for c in (True, False)]
    if plans[0] is None:
        return
    assert plans[1] is not None
    assert plans[1].objective <= plans[0].objective * (1 + 1e-6) + 1e-9
    assert plans[0].objective == pytest.approx(maxload.solve(problem, contiguous=True, symmetry="none").objective, rel=1e-6)


@pytest.mark.parametrize("memory", ["shared tensor", "liveness"])
def test_noncontiguous_ip_through_solve_on_a_contiguous_problem_with_non_additive_memory(memory):
    """``solve(problem, "ip", contiguous=False)`` on a contiguous problem whose memory goes through
    a wrapper (a shared tensor, liveness): the plan holds a split piece (Sec. 5.2) and is checked
    against the problem that allows it, as ``maxload.solve`` checks it, not refused as non-contiguous."""
    from torchplace.solvers import solve

    g = OpGraph()
    for v, times in (("a", {"accel": 1.0, "cpu": 10.0}), ("b", {"cpu": 1.0}), ("c", {"accel": 1.0, "cpu": 10.0})):
        g.add_node(v, NodeRecord(v, times=times, transfer_time=0.0, param_bytes=1, output_bytes=1, temp_bytes=1))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    if memory == "liveness":
        g.meta["liveness"] = True
    else:
        g.meta["state"] = {"w": {"bytes": 1, "owner": "a", "readers": ["a", "c"]}}
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel", 100), Device("cpu0", "cpu", "cpu"))))
    plan = solve(problem, "ip", contiguous=False)
    plan.validate(replace(problem, contiguous=False))
    assert plan.objective == 2.0 == costmodel.evaluate(problem, plan)  # a and c on acc0: two pieces


def test_auto_finds_a_non_contiguous_split_where_no_contiguous_one_fits():
    """a -> b -> c with a and c accelerator-only and b CPU-only: every split holds two pieces on
    acc0. ``auto`` took the contiguous DP's InfeasibleError for the problem's; the IP decides."""
    from torchplace.solvers import solve

    g = OpGraph()
    for v, times in (("a", {"accel": 1.0}), ("b", {"cpu": 1.0}), ("c", {"accel": 1.0})):
        g.add_node(v, NodeRecord(v, times=times, transfer_time=0.0))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel"), Device("cpu0", "cpu", "cpu"))), contiguous=False)
    plan = solve(problem, "auto", time_limit=20)
    _check_plan_of(plan, problem)
    assert plan.objective == 2.0 and plan.status == "optimal"
    with pytest.raises(InfeasibleError):
        solve(replace(problem, contiguous=True), "auto", time_limit=20)


def test_auto_on_a_non_contiguous_problem_that_nothing_fits_keeps_the_memory_that_fits():
    """Nothing fits 3 bytes (a and c, 2 bytes each, must share acc0): the IP's verdict, with the
    contiguous DP's memory that fits (a contiguous split that fits is a split)."""
    from torchplace.solvers import solve

    g = OpGraph()
    for v, times in (("a", {"accel": 1.0}), ("b", {"cpu": 1.0}), ("c", {"accel": 1.0, "cpu": 5.0})):
        g.add_node(v, NodeRecord(v, times=times, transfer_time=0.0, param_bytes=2))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    devices = (Device("acc0", "meta", "accel", 1), Device("cpu0", "cpu", "cpu"))
    problem = Problem(g, Cluster(devices), contiguous=False)
    with pytest.raises(InfeasibleError) as err:
        solve(problem, "auto", time_limit=20)
    need = err.value.min_memory_bytes
    assert need == 2
    roomy = replace(problem, cluster=Cluster((Device("acc0", "meta", "accel", need), devices[1])))
    assert solve(roomy, "auto", time_limit=20).objective == 6.0  # a on acc0; b and c on the CPU


def _check_plan_of(plan: Plan, problem: Problem) -> None:
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective * (1 + 1e-9)


@FAST
@given(problems(max_nodes=5))
def test_auto_on_a_non_contiguous_problem_is_infeasible_only_when_no_split_fits(problem):
    from torchplace.solvers import solve

    problem = replace(problem, contiguous=False)
    expected = brute_force(problem, contiguous=False)
    plan = _solve_or_inf(solve, problem, method="auto", time_limit=20)
    assert (plan is None) == math.isinf(expected)
    if plan is not None:
        _check_plan_of(plan, problem)
        assert plan.objective >= expected * (1 - 1e-9) - 1e-12
        assert plan.lower_bound <= expected * (1 + 1e-9) + 1e-12


def _crossing_problem(contiguous: bool = True) -> Problem:
    """1 -> 4 and 2 -> 5 with 1, 3, 5 colocated: {1, 3, 5} and {0, 2, 4} are each contiguous but
    feed each other (1 -> 4 one way, 2 -> 5 the other)."""
    g = OpGraph()
    for i in range(6):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": 1.0}, colocation="k" if i in (1, 3, 5) else None))
    g.add_edge("1", "4")
    g.add_edge("2", "5")
    return Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu"))), contiguous=contiguous)


def test_devices_feeding_each_other_are_not_contiguous():
    """Per-device contiguity (Def. 3.1) admits the 3/3 split; ordered contiguity does not, so the
    contiguous IP finds the DP's 4 and only the non-contiguous IP finds 3."""
    problem = _crossing_problem()
    plan = maxload.solve(problem, contiguous=True)
    _check(plan, problem)
    assert plan.objective == 4.0 == dp.solve(problem).objective == mtpp.solve(problem).objective
    loose = maxload.solve(problem, contiguous=False)
    assert loose.objective == 3.0
    assert len(loose.stages) == 3  # one device holds two stages, the other sits between them
    loose.validate(_crossing_problem(contiguous=False))
    with pytest.raises(InvalidPlanError, match="cycle of devices"):
        loose.validate(problem)


def test_dp_and_ip_agree_on_an_orphan_backward_node():
    """The paper's DP ties a backward node without a forward sibling to the reversed forward order
    (App. E.1, mirrored edges) and misses ``{fu, bu} / {fw, bv}`` (5), whose backward piece runs in
    the forward order; the DP over both orientations finds it, as the IP does."""
    g = OpGraph()
    for v, t, color in [("fu", 3, "u"), ("bu", 2, "u"), ("fw", 1, None), ("bv", 4, None)]:
        g.add_node(v, NodeRecord(v, times={"cpu": float(t)}, colocation=color, backward=v.startswith("b")))
    for u, v in [("fu", "fw"), ("fu", "bu"), ("bu", "bv")]:
        g.add_edge(u, v)
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu"))), mode="training")
    plan = maxload.solve(problem, contiguous=True)
    _check(plan, problem)
    assert plan.objective == 5.0 == brute_force(problem, contiguous=True)
    exact = dp.solve(problem)
    assert exact.objective == 5.0 and exact.meta["backward_order"] == "forward"


def test_backward_pieces_run_in_the_forward_order_or_its_reverse():
    """``f1 -> f2 -> f3``, ``b2 -> b1``, ``b2 -> b3``, ``(f_i, b_i)`` colocated, three CPUs: one class
    per device orders each side (backward from device 2) but in neither of the two ways a
    contiguous training split runs its backward pieces, so the contiguous optimum puts two classes
    on one device (4) and only the non-contiguous one reaches 2."""
    g = OpGraph()
    for i in (1, 2, 3):
        g.add_node(f"f{i}", NodeRecord(f"f{i}", times={"cpu": 1.0}, colocation=str(i)))
        g.add_node(f"b{i}", NodeRecord(f"b{i}", times={"cpu": 1.0}, colocation=str(i), backward=True))
        g.add_edge(f"f{i}", f"b{i}")
    for u, v in [("f1", "f2"), ("f2", "f3"), ("b2", "b1"), ("b2", "b3")]:
        g.add_edge(u, v)
    problem = Problem(g, Cluster(tuple(Device(f"cpu{i}", "cpu", "cpu") for i in range(3))), mode="training")
    split = [Stage(f"cpu{i}", (f"f{i + 1}",)) for i in range(3)] + [
        Stage("cpu1", ("b2",)), Stage("cpu0", ("b1",)), Stage("cpu2", ("b3",))]
    Plan.build(replace(problem, contiguous=False), split, solver="test", seconds=0.0, lower_bound=0.0)
    with pytest.raises(InvalidPlanError, match="neither in the forward pieces' device order nor in its reverse"):
        Plan.build(problem, split, solver="test", seconds=0.0, lower_bound=0.0)
    plan = maxload.solve(problem, contiguous=True)
    _check(plan, problem)
    assert plan.objective == 4.0 == dp.solve(problem).objective == brute_force(problem, contiguous=True)
    assert maxload.solve(problem, contiguous=False).objective == 2.0


def test_backward_order_is_its_own():
    """f1 -> f2, f3 -> f4 with (f_i, b_i) colocated and b1 -> b2, b4 -> b3: {1, 3} / {2, 4} is
    ordered forward but its backward pieces feed each other, so it is not contiguous; the best
    contiguous split puts one of the heavy pairs 3, 4 alone."""
    g = OpGraph()
    for i, t in zip(range(1, 5), (1.0, 1.0, 3.0, 3.0)):
        g.add_node(f"f{i}", NodeRecord(f"f{i}", times={"cpu": t}, colocation=str(i)))
        g.add_node(f"b{i}", NodeRecord(f"b{i}", times={"cpu": t}, colocation=str(i), backward=True))
        g.add_edge(f"f{i}", f"b{i}")
    for u, v in [("f1", "f2"), ("f3", "f4"), ("b1", "b2"), ("b4", "b3")]:
        g.add_edge(u, v)
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu"))), mode="training")
    split = [Stage("cpu0", ("f1", "f3")), Stage("cpu1", ("f2", "f4")), Stage("cpu1", ("b4",)),
             Stage("cpu0", ("b1", "b3")), Stage("cpu1", ("b2",))]
    Plan.build(replace(problem, contiguous=False), split, solver="test", seconds=0.0, lower_bound=0.0)
    with pytest.raises(InvalidPlanError, match="backward pieces feed each other"):
        Plan.build(problem, split, solver="test", seconds=0.0, lower_bound=0.0)
    plan = maxload.solve(problem, contiguous=True)
    _check(plan, problem)
    assert plan.objective == 10.0 == brute_force(problem, contiguous=True)
    assert maxload.solve(problem, contiguous=False).objective == 8.0


def _training_problem() -> Problem:
    """f0 -> f1 -> f2 -> loss -> b2 -> b1 -> b0 with (f_i, b_i) colocated, plus f_i -> b_i."""
    g = OpGraph()
    times = {"f0": 3, "f1": 1, "f2": 2, "loss": 1, "b2": 4, "b1": 2, "b0": 5}
    for v, t in times.items():
        color = v[1] if v != "loss" else None
        g.add_node(v, NodeRecord(v, times={"accel": t, "cpu": 4 * t}, transfer_time=0.5, colocation=color,
                                 backward=v.startswith("b"), param_bytes=1))
    for u, v in [("f0", "f1"), ("f1", "f2"), ("f2", "loss"), ("loss", "b2"), ("b2", "b1"), ("b1", "b0"),
                 ("f0", "b0"), ("f1", "b1"), ("f2", "b2")]:
        g.add_edge(u, v)
    devices = (Device("acc0", "meta", "accel", 4), Device("acc1", "meta", "accel", 4), Device("cpu0", "cpu", "cpu"))
    return Problem(g, Cluster(devices), mode="training")


def test_training_graph_contiguity_is_per_part():
    problem = _training_problem()
    plan = maxload.solve(problem, contiguous=True)
    _check(plan, problem)
    assert plan.objective == pytest.approx(brute_force(problem, contiguous=True))
    assert plan.objective == pytest.approx(dp.solve(problem).objective)
    loose = maxload.solve(problem, contiguous=False)
    assert loose.objective == pytest.approx(brute_force(problem, contiguous=False))
    assert all(not any(problem.graph.record(v).backward for v in s.nodes)
               or all(problem.graph.record(v).backward for v in s.nodes) for s in loose.stages)


@st.composite
def training_problems(draw, max_forward: int = 3, orphans: bool = True) -> Problem:
    """A random forward DAG ``f_i`` and its mirror ``b_i`` (``f_u -> f_v`` gives ``b_v -> b_u``),
    ``f_i -> b_i``; ``(f_i, b_i)`` colocated unless ``b_i`` is drawn as an orphan."""
    n = draw(st.integers(1, max_forward))
    g = OpGraph()
    for i in range(n):
        tied = not orphans or draw(st.booleans())
        for side in "fb":
            t = float(draw(st.integers(1, 6)))
            g.add_node(f"{side}{i}", NodeRecord(
                f"{side}{i}", times={"accel": t, "cpu": 3 * t}, transfer_time=float(draw(st.integers(0, 3))),
                param_bytes=draw(st.integers(0, 2)), colocation=str(i) if tied else None, backward=side == "b"))
        g.add_edge(f"f{i}", f"b{i}")
    for u, v in itertools.combinations(range(n), 2):
        if draw(st.booleans()):
            g.add_edge(f"f{u}", f"f{v}")
            g.add_edge(f"b{v}", f"b{u}")
    devices = [Device(f"acc{i}", "meta", "accel", draw(st.integers(2, 8))) for i in range(draw(st.integers(1, 2)))]
    devices += [Device("cpu0", "cpu", "cpu")] * draw(st.integers(0, 1))
    return Problem(g, Cluster(tuple(devices)), mode="training")


@FAST
@given(training_problems())
def test_contiguous_ip_matches_brute_force_on_training_graphs(problem):
    _assert_ip_matches_brute_force(problem, contiguous=True)


@FAST
@given(st.one_of(random_training_problems(), random_training_problems(cpus=3)))
def test_contiguous_ip_matches_brute_force_with_backward_edges_between_classes(problem):
    _assert_ip_matches_brute_force(problem, contiguous=True)


@FAST
@given(st.one_of(training_problems(max_forward=4, orphans=False), random_training_problems(),
                 random_training_problems(cpus=3)))
def test_contiguous_ip_equals_dp_on_training_graphs(problem):
    """Both search the splits whose backward pieces run in the forward pieces' order or its reverse:
    the DP over one contraction per orientation, the IP with its ``reverse`` binary."""
    expected = _solve_or_inf(dp.solve, problem)
    plan = _solve_or_inf(maxload.solve, problem, contiguous=True, mip_gap=1e-9)
    assert (expected is None) == (plan is None)
    if plan is not None:
        _check(plan, problem)
        assert plan.objective == pytest.approx(expected.objective, rel=1e-9, abs=1e-12)


@FAST
@given(problems(max_nodes=7), st.randoms(use_true_random=False))
def test_stages_from_any_assignment_run_in_order(problem, rng):
    """Every assignment becomes stages whose order sends every edge forward (Sec. 5.2)."""
    g, names = problem.graph, problem.cluster.names
    assignment = {v: rng.choice(names) for v in g}
    stages = maxload.stages_from_assignment(problem, assignment)
    stage_of = {v: i for i, s in enumerate(stages) for v in s.nodes}
    assert sorted(stage_of) == sorted(g)
    assert all(stage_of[u] <= stage_of[v] for u, v in g.edges)
    assert all(assignment[v] == s.device for s in stages for v in s.nodes)


def test_stages_from_a_chain_split_are_one_per_device():
    problem = _training_problem()
    plan = dp.solve(problem)
    stages = maxload.stages_from_assignment(problem, plan.assignment)
    assert len(stages) == len(plan.stages)


def _violated(m: pyo.ConcreteModel, tol: float = 1e-9) -> list[str]:
    bad = []
    for c in m.component_data_objects(pyo.Constraint, active=True):
        body = pyo.value(c.body)
        if (c.lower is not None and body < pyo.value(c.lower) - tol) or (c.upper is not None and body > pyo.value(c.upper) + tol):
            bad.append(c.name)
    return bad


@FAST
@given(problems(max_nodes=6), st.sampled_from(["index", "load", "none"]), st.booleans())
def test_warm_start_values_are_feasible(problem, symmetry, contiguous):
    """The MIP start from a DP plan satisfies every constraint (after relabelling devices)."""
    dp_plan = _solve_or_inf(dp.solve, problem)
    if dp_plan is None:
        return
    m = maxload.build(problem, contiguous=contiguous, symmetry=symmetry)
    maxload.initialize(m, problem, dp_plan.assignment, symmetry)
    assert _violated(m) == []
    assert pyo.value(m.max_load) * m.unit == pytest.approx(dp_plan.objective, rel=1e-9)
    warm = maxload.solve(problem, contiguous=contiguous, symmetry=symmetry, warm_start=dp_plan)
    assert warm.objective <= dp_plan.objective * (1 + 1e-6) + 1e-9


def test_unit_that_fits_nowhere_is_infeasible():
    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"accel": 1.0}, param_bytes=10))
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel", 5), Device("cpu0", "cpu", "cpu"))))
    with pytest.raises(InfeasibleError, match="raise max_memory to at least 10 bytes"):
        maxload.solve(problem)


@pytest.mark.parametrize("method", ["dp", "ip", "slicegraph"])
def test_a_node_no_kind_present_runs_names_the_kind_it_has_times_for(method):
    # With a CPU present and a node timed on 'cuda' only, the advice was "add a device of a kind
    # that can run them, e.g. 'cpu'".
    from torchplace.solvers import solve

    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"cpu": 1.0}))
    g.add_node("b", NodeRecord("b", times={"cuda": 1.0, "tpu": 2.0}))
    g.add_edge("a", "b")
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"),)))
    with pytest.raises(InfeasibleError, match=r"add a device of kind 'cuda' \(they have times for \['cuda', 'tpu'\]\), "
                                              r"or give them a time on 'cpu'") as e:
        solve(problem, method)
    assert "e.g. 'cpu'" not in str(e.value)


def test_time_limit_holds_on_an_operator_graph(workloads_dir):
    """BERT-6 operators non-contiguous (about a minute to prove optimal here): HiGHS stops at the limit
    with a valid plan and a proven bound.

    The limit covers everything solve does (building the model, handing it to HiGHS, the plan):
    HiGHS gets what is left minus a reserve, so the whole call ends at about 3 s even with both
    cores of a 2-core machine busy (measured 2.9-3.0 s). What is left over the limit is HiGHS's
    own clock check, tenths of a second; a limit that does not hold (HiGHS alone proves it in a
    minute) fails this by far.
    """
    problem = replace(read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-6_inference.json"), contiguous=False)
    start = dp.solve(replace(problem, contiguous=True))  # as auto starts it: on a loaded machine HiGHS alone
    t0 = time.perf_counter()                             # may find no incumbent of its own in 3 s
    plan = maxload.solve(problem, time_limit=3, warm_start=start)
    total = time.perf_counter() - t0
    assert plan.status == "time_limit" and plan.objective <= start.objective * (1 + 1e-9)
    assert total <= 3 * 1.1 + 1.0
    assert plan.meta["build_seconds"] + plan.meta["solve_seconds"] <= plan.seconds <= total
    _check(plan, problem)
    assert plan.lower_bound <= plan.objective


def test_noncontiguous_ip_reproduces_table_1_on_bert3(workloads_dir):
    """Tarnawski Table 1: the best non-contiguous split of BERT-3 inference is 21.91 (contiguous 27.92)."""
    problem = read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-3_inference.json")
    plan = maxload.solve(problem, contiguous=False, time_limit=120)
    _check(plan, replace(problem, contiguous=False))
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(21.91, abs=5e-3)
    assert plan.lower_bound == pytest.approx(plan.objective, rel=1e-6)


@pytest.mark.parametrize(("name", "expected"), [
    ("LayerGraphs/bert24_inference.json", 17.7899),  # Table 1
    ("OperatorGraphs/bert_l-3_inference.json", 27.92),  # Table 1
])
def test_contiguous_ip_reproduces_the_dp_on_published_graphs(name, expected, workloads_dir):
    """A few seconds each: the class order fixed on the pipeline order removes the symmetry."""
    problem = read_dnn_partitioning(DNN / name)
    plan = maxload.solve(problem, contiguous=True, time_limit=120)
    _check(plan, problem)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected, abs=5e-3)
    assert plan.objective == pytest.approx(dp.solve(problem).objective, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "contiguous", "expected"), [
    ("OperatorGraphs/bert_l-3_training.json", False, 54.21),  # Table 1, non-contiguous
    ("OperatorGraphs/bert_l-6_inference.json", False, 28.33),  # Table 1, non-contiguous
])
def test_ip_reproduces_published_optima(name, contiguous, expected, workloads_dir):
    problem = read_dnn_partitioning(DNN / name)
    plan = maxload.solve(problem, contiguous=contiguous, time_limit=600)
    _check(plan, replace(problem, contiguous=contiguous))
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected, abs=5e-3)


# -- MTPP MIP ------------------------------------------------------------------------------------
@FAST
@given(problems(max_nodes=7))
def test_mtpp_equals_dp(problem):
    """Acyclic-quotient splits are the DP's chains of ideals, on any mix of device classes."""
    expected = _solve_or_inf(dp.solve, problem)
    plan = _solve_or_inf(mtpp.solve, problem)
    assert (expected is None) == (plan is None)
    if plan is None:
        return
    _check(plan, problem)
    assert plan.objective == pytest.approx(expected.objective, rel=1e-6, abs=1e-9)
    assert len({s.device for s in plan.stages}) == len(plan.stages)


def _homogeneous(n: int, rng: random.Random) -> Problem:
    g = OpGraph()
    for i in range(n):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": float(rng.randint(1, 6))},
                                      transfer_time=float(rng.randint(0, 2)), param_bytes=1))
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.4:
            g.add_edge(str(u), str(v))
    return Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel", n) for i in range(rng.randint(1, 3)))))


@pytest.mark.parametrize("seed", range(8))
def test_mtpp_is_at_least_noncontiguous_on_homogeneous_devices(seed):
    problem = _homogeneous(6, random.Random(seed))
    chain = mtpp.solve(problem)
    assert chain.objective == pytest.approx(dp.solve(problem).objective, rel=1e-6)
    assert maxload.solve(problem, contiguous=False).objective <= chain.objective * (1 + 1e-6)


def test_noncontiguous_beats_mtpp_when_devices_feed_each_other():
    """Archer's MTPP requires an acyclic quotient graph (Sec. 2.2); the non-contiguous optimum
    need not have one (Tarnawski Fig. 1b), so it can be strictly better."""
    g = OpGraph()
    for v, t, c in [("0", 6, 0), ("1", 2, 2), ("2", 2, 0), ("3", 2, 2), ("4", 5, 0), ("5", 4, 2)]:
        g.add_node(v, NodeRecord(v, times={"accel": float(t)}, transfer_time=float(c)))
    for u, v in [("0", "1"), ("0", "3"), ("1", "4"), ("3", "4"), ("4", "5")]:
        g.add_edge(u, v)
    problem = Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel") for i in range(2))))
    assert mtpp.solve(problem).objective == pytest.approx(13.0)
    loose = maxload.solve(problem, contiguous=False)
    assert loose.objective == pytest.approx(11.0) == brute_force(problem, contiguous=False)


def test_mtpp_reproduces_the_published_layer_graph_optimum(workloads_dir):
    problem = read_dnn_partitioning(DNN / "LayerGraphs/bert24_inference.json")
    plan = mtpp.solve(problem)
    _check(plan, problem)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(17.7899, rel=1e-4)


def test_mtpp_rejects_training_graphs():
    with pytest.raises(ValueError, match="inference"):
        mtpp.solve(_training_problem())


def test_a_unit_too_big_for_every_device_gives_a_floor_not_a_memory_that_fits():
    """InfeasibleError.min_memory_bytes is a memory that makes the problem feasible; one unit's
    bytes are only a floor (a and b need 8 together on the one device), so none is claimed; and a
    unit no device kind can run is named before any memory shortfall, which no memory fixes."""
    g = OpGraph()
    for v in "ab":
        g.add_node(v, NodeRecord(v, times={"accel": 1.0}, param_bytes=4))
    g.add_edge("a", "b")
    with pytest.raises(InfeasibleError, match="at least 4 bytes") as err:
        maxload.solve(Problem(g, Cluster((Device("acc0", "meta", "accel", 3),))))
    assert err.value.min_memory_bytes is None
    with pytest.raises(InfeasibleError):
        maxload.solve(Problem(g, Cluster((Device("acc0", "meta", "accel", 4),))))
    g.add_node("c", NodeRecord("c", times={"cpu": 1.0}))
    g.add_edge("b", "c")
    with pytest.raises(InfeasibleError, match=r"\['c'\].*can run on none"):
        maxload.solve(Problem(g, Cluster((Device("acc0", "meta", "accel", 3),))))


def test_mtpp_on_one_device_too_small_names_the_bytes_and_logs_nothing(caplog):
    """One block holds every unit, so the memory row is a constant: it raised inside a Pyomo rule,
    which logged 'Rule failed' errors, and the message named no bytes."""
    g = OpGraph()
    for v in "ab":
        g.add_node(v, NodeRecord(v, times={"accel": 1.0}, param_bytes=3))
    g.add_edge("a", "b")
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel", 3),)))
    with pytest.raises(InfeasibleError, match="6 bytes") as err:
        mtpp.solve(problem)
    assert err.value.min_memory_bytes == 6
    assert not [r for r in caplog.records if r.name.startswith("pyomo")]


@pytest.mark.parametrize("seed", [1, 6])
def test_mtpp_and_bounds_hold_at_microsecond_times(seed):
    # Raw seconds of 1e-5 put HiGHS's absolute tolerances at a visible fraction of the objective:
    # unscaled, seed 1 broke MTPP's value check and seed 6 returned a non-optimal "optimal" split.
    rng = random.Random(seed)
    g = OpGraph()
    for i in range(14):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": rng.uniform(1, 10) * 1e-5},
                                      transfer_time=rng.uniform(0, 3) * 1e-5))
    for u in range(14):
        for v in range(u + 1, 14):
            if rng.random() < 0.25 or v == u + 1:
                g.add_edge(str(u), str(v))
    p = Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel") for i in range(3))))
    best = dp.solve(p).objective
    plan = mtpp.solve(p)
    assert plan.objective == pytest.approx(best, rel=1e-9)
    assert plan.meta["milp_bound"] <= best * (1 + 1e-6)
    assert guess_the_bottleneck_bound(p, time_limit=20) <= best * (1 + 1e-9)


@pytest.mark.parametrize("scale", [1e9, 1e15])
def test_ip_mtpp_and_bounds_hold_at_nanosecond_counts(scale):
    # Times of 1e9 beside the 0/1 assignment rows: unscaled, HiGHS's presolve fixed every column
    # and proved 6 * scale (all on one accelerator) for a chain whose best split takes 3 * scale;
    # at 1e15 the IP had no placement to read back (KeyError) and MTPP raised IndexError.
    p = scaled_chain(scale)
    for contiguous in (True, False):
        best = brute_force(p, contiguous=contiguous)
        plan = maxload.solve(p, contiguous=contiguous)
        _check(plan, replace(p, contiguous=contiguous))
        assert plan.status == "optimal" and plan.objective == pytest.approx(best, rel=1e-9)
        assert plan.meta["milp_bound"] <= best * (1 + 1e-6)
    best = brute_force(p, contiguous=True)
    plan = mtpp.solve(p)
    assert plan.objective == pytest.approx(best, rel=1e-9) and plan.meta["milp_bound"] <= best * (1 + 1e-6)
    assert guess_the_bottleneck_bound(p, time_limit=20) <= best * (1 + 1e-9)


def _petabyte_chain(scale: float, objective: str = "throughput") -> Problem:
    """Four nodes of ``scale`` or twice as many bytes; accelerators of 3 * scale, a CPU of 2 * scale:
    memory binds (all on one device does not fit)."""
    g = OpGraph()
    for i in range(4):
        g.add_node(str(i), NodeRecord(str(i), times={"accel": 1.0 + i, "cpu": 10.0}, transfer_time=0.5,
                                      param_bytes=int(scale * (1 + i % 2))))
    for i in range(3):
        g.add_edge(str(i), str(i + 1))
    cluster = Cluster((Device("a0", "meta", "accel", int(3 * scale)), Device("a1", "meta", "accel", int(3 * scale)),
                       Device("cpu0", "cpu", "cpu", int(2 * scale))))
    return Problem(g, cluster, objective=objective, contiguous=objective == "throughput")


@pytest.mark.parametrize("scale", [1e15, 1.4e15])  # 6 * 1.5e15 would pass 2**53 bytes
def test_ip_mtpp_and_bounds_hold_at_petabyte_memories(scale):
    # HiGHS reads a coefficient of 1e15 or more as infinite: unscaled memory rows made the IP read
    # back no placement (KeyError) and MTPP raise IndexError. Bytes are scaled like times (byte_unit).
    p = _petabyte_chain(scale)
    best = dp.solve(p).objective
    assert best == pytest.approx(7.5)  # memory forces a split: without it one accelerator takes 10
    for contiguous in (True, False):
        plan = maxload.solve(p, contiguous=contiguous)
        _check(plan, replace(p, contiguous=contiguous))
        assert plan.status == "optimal" and plan.objective <= best * (1 + 1e-9)
    assert mtpp.solve(p).objective == pytest.approx(best, rel=1e-9)
    assert guess_the_bottleneck_bound(p, time_limit=20) <= best * (1 + 1e-9)


def test_byte_unit_leaves_real_memories_alone_and_scales_petabytes():
    assert maxload.byte_unit([80 * 2**30, 5 * 10**11]) == 1.0
    assert maxload.byte_unit([3e15, 1e15]) == 1e6  # 3e15 -> 3e9
    assert maxload.byte_unit([]) == 1.0
