"""The ideals DP: published optima, brute force on random DAGs, cost-model consistency, errors."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError, TooManyIdealsError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN
from .graphs import brute_force_contiguous, problems, training_problems

# Tarnawski et al. 2020, Table 1 (contiguous optimum with the file's own k and l), and the forward
# ideal counts after contraction as printed by the authors' program.
PUBLISHED = {
    "OperatorGraphs/bert_l-3_inference.json": (27.9186, 1428),
    "OperatorGraphs/bert_l-6_inference.json": (29.5795, 1923),
    "OperatorGraphs/bert_l-12_inference.json": (147.478, 2906),
    "OperatorGraphs/resnet50_inference.json": (124.349, 241),
    "OperatorGraphs/bert_l-3_training.json": (65.3031, 2774),
    "OperatorGraphs/bert_l-6_training.json": (72.865, 3776),
    "OperatorGraphs/bert_L-12_training.json": (437.998, 2938),
    "OperatorGraphs/resnet50_training.json": (255.194, 258),
    "LayerGraphs/bert24_inference.json": (17.7899, None),  # authors merge zero-cost nodes: 30
    "LayerGraphs/bert24_training.json": (41.7458, None),
    "LayerGraphs/resnet50_inference.json": (33.7747, 242),
    "LayerGraphs/resnet50_training.json": (78.6318, 242),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dp_reproduces_published_optimum(name, workloads_dir):
    problem = read_dnn_partitioning(DNN / name)
    plan = dp.solve(problem)
    optimum, ideals = PUBLISHED[name]
    assert plan.objective == pytest.approx(optimum, rel=1e-4)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective
    if ideals is not None:
        assert plan.meta["ideals"] == ideals
    plan.validate(problem)
    assert len({s.device for s in plan.stages}) <= len(problem.cluster)


def _assert_dp_matches_brute_force(problem: Problem) -> None:
    expected = brute_force_contiguous(problem)
    if math.isinf(expected):
        with pytest.raises(InfeasibleError):
            dp.solve(problem)
        return
    plan = dp.solve(problem)
    assert plan.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.lower_bound <= plan.objective + 1e-9


@settings(max_examples=150, deadline=None)
@given(problems())
def test_dp_matches_brute_force(problem):
    _assert_dp_matches_brute_force(problem)


@settings(max_examples=150, deadline=None)
@given(st.one_of(training_problems(), training_problems(cpus=3)))
def test_dp_matches_brute_force_on_training_graphs(problem):
    """Backward nodes feeding backward nodes of other colour classes in any pattern: the DP's plan
    is valid (Plan.build validates it) and optimal among the contiguous splits."""
    _assert_dp_matches_brute_force(problem)


def _classes_problem(fw: dict[str, float], bw: dict[str, tuple[str | None, float]], edges: str, cpus: int) -> Problem:
    """A training graph on ``cpus`` CPUs (no transfer costs): forward nodes ``fw`` (name -> time,
    each its own colour class), backward nodes ``bw`` (name -> (class, time)), ``edges`` as
    ``"a>b c>d"``."""
    g = OpGraph()
    for v, t in fw.items():
        g.add_node(v, NodeRecord(v, times={"cpu": t}, colocation=v))
    for v, (color, t) in bw.items():
        g.add_node(v, NodeRecord(v, times={"cpu": t}, colocation=color, backward=True))
    for pair in edges.split():
        g.add_edge(*pair.split(">"))
    return Problem(g, Cluster(tuple(Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus))), mode="training")


def test_backward_edges_both_ways_between_classes_keep_them_together():
    """Regression (issue 9, item 10): classes ``a`` and ``b`` feed each other backward
    (``ca -> bb -> ba``), so every contiguous split keeps them on one device; ``c`` mirrors ``b``.
    The paper's contraction ignored the edges, split ``{a} / {b} / {c}`` (6) and failed with
    "stages feed each other in a cycle"; the optimum is ``{a, b} / {c}``: max(2+1+1 + 2+2, 3+3) = 8."""
    problem = _classes_problem(
        {"fa": 2.0, "fb": 2.0, "fc": 3.0},
        {"ba": ("fa", 1.0), "ca": ("fa", 1.0), "bb": ("fb", 2.0), "bc": ("fc", 3.0)},
        "fa>fb fb>fc fa>ca fb>bb fc>bc ca>bb bb>ba bc>bb", cpus=3,
    )
    plan = dp.solve(problem)
    assert plan.objective == 8.0 == brute_force_contiguous(problem)
    assert plan.meta["backward_order"] == "reverse"
    device = plan.assignment
    assert device["fa"] == device["fb"] != device["fc"]


def test_backward_edges_drawn_forward_give_backward_pieces_in_forward_order():
    """``f1 -> f2`` with ``b1 -> b2`` (as the LayerGraphs training files draw them): mirrored, the
    backward edge would close a cycle and force one device (10); in the forward order the split is
    ``{1} / {2}``: max(2 + 3, 1 + 4) = 5."""
    problem = _classes_problem({"f1": 2.0, "f2": 1.0}, {"b1": ("f1", 3.0), "b2": ("f2", 4.0)},
                               "f1>f2 f1>b1 f2>b2 b1>b2", cpus=2)
    plan = dp.solve(problem)
    assert plan.objective == 5.0 == brute_force_contiguous(problem)
    assert plan.meta["backward_order"] == "forward"
    assert plan.assignment["f1"] == plan.assignment["b1"] != plan.assignment["f2"] == plan.assignment["b2"]
    assert dp.solve(problem, linearize=True).objective == 5.0


def _chain(times, mem, params=1):
    g = OpGraph()
    for i, t in enumerate(times):
        g.add_node(str(i), NodeRecord(str(i), param_bytes=params, times={"accel": t, "cpu": 10 * t}, transfer_time=0.5))
        if i:
            g.add_edge(str(i - 1), str(i))
    return Problem(g, Cluster(tuple(Device(f"acc{i}", "meta", "accel", mem) for i in range(2))))


def test_dp_splits_a_chain_evenly():
    plan = dp.solve(_chain([1, 1, 1, 1], mem=10))
    # two halves of 2.0 compute, each with one 0.5 transfer out / in
    assert plan.objective == pytest.approx(2.5)
    assert [len(s.nodes) for s in plan.stages] == [2, 2]


def test_many_devices_and_few_nodes_use_no_more_states_than_nodes():
    # Each used device holds a node, so 4,000 accelerators and 90 CPUs search what 3 of each do;
    # the DP went over all 4,001 x 91 device counts and its time limit stopped it on 3 nodes.
    def cluster(accelerators: int, cpus: int) -> Cluster:
        return Cluster(tuple(Device(f"acc{i}", "meta", "accel", 10) for i in range(accelerators))
                       + tuple(Device(f"cpu{i}", "cpu", "cpu") for i in range(cpus)))

    graph = _chain([1, 2, 3], mem=10).graph
    few, many = Problem(graph, cluster(3, 3)), Problem(graph, cluster(4000, 90))
    plan = dp.solve(many, time_limit=5)
    assert plan.status == "optimal" and plan.objective == pytest.approx(brute_force_contiguous(few))
    assert costmodel.evaluate(many, plan) == plan.objective


def test_infeasible_memory_states_the_smallest_memory_that_fits():
    with pytest.raises(InfeasibleError) as e:
        dp.solve(_chain([1, 1, 1, 1, 1], mem=2, params=1))
    assert e.value.min_memory_bytes == 3  # 5 nodes of 1 byte on 2 devices: 3 + 2
    assert "at least 3 bytes" in str(e.value)


def test_no_contiguous_split_whatever_the_memory_is_not_blamed_on_an_operator_no_device_runs():
    """a -> b -> c with a, c accelerator-only and b CPU-only on one accelerator and one CPU: every
    operator runs somewhere, but no one-piece-per-device split exists (Tarnawski Fact 5.2)."""
    g = OpGraph()
    for v, times in (("a", {"accel": 1.0}), ("b", {"cpu": 1.0}), ("c", {"accel": 1.0})):
        g.add_node(v, NodeRecord(v, times=times))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    problem = Problem(g, Cluster((Device("acc0", "meta", "accel"), Device("cpu0", "cpu", "cpu"))))
    with pytest.raises(InfeasibleError, match="no contiguous split exists") as e:
        dp.solve(problem)
    assert "cannot run on any" not in str(e.value) and "contiguous=False" in str(e.value)
    assert "one more device like 'acc0'" in str(e.value)
    with pytest.raises(InfeasibleError, match=r"cannot run on any.*\['b'\]"):  # without the CPU: b runs nowhere
        dp.solve(Problem(g, Cluster((Device("acc0", "meta", "accel"),))))


def test_too_many_ideals_raises_a_clear_error():
    g = OpGraph()
    for i in range(16):  # no edges: 2**16 ideals
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": 1.0}))
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"),)))
    with pytest.raises(TooManyIdealsError, match="more than 1000 ideals") as e:
        dp.solve(problem, ideal_limit=1000)
    assert e.value.limit == 1000


def test_plan_is_deterministic(workloads_dir):
    problem = read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-3_inference.json")
    assert dp.solve(problem).stages == dp.solve(problem).stages


@settings(max_examples=100, deadline=None)
@given(st.one_of(problems(), training_problems()))
def test_dpl_is_valid_and_never_better_than_dp(problem):
    try:
        exact = dp.solve(problem)
    except InfeasibleError:
        return  # DPL searches a subset of the same splits: infeasible too, or a valid plan
    try:
        linear = dp.solve(problem, linearize=True)
    except InfeasibleError:
        return
    assert linear.objective >= exact.objective - 1e-9
    assert linear.objective == costmodel.evaluate(problem, linear)
    assert linear.status == "feasible" and linear.solver == "dpl"
    assert linear.meta["ideals"] <= len(problem.graph) + 1  # a chain: one ideal per (super)node, plus empty


@pytest.mark.parametrize("name", ["OperatorGraphs/bert_l-3_inference.json", "OperatorGraphs/resnet50_training.json"])
def test_dpl_on_published_workloads(name, workloads_dir):
    """Tarnawski Sec. 6: DPL loses nothing on these two."""
    problem = read_dnn_partitioning(DNN / name)
    linear = dp.solve(problem, linearize=True)
    assert linear.objective == pytest.approx(PUBLISHED[name][0], rel=1e-4)


def test_auto_falls_back_to_slicegraph_past_the_ideal_limit():
    from torchplace.solvers import solve

    g = OpGraph()
    for i in range(16):
        g.add_node(str(i), NodeRecord(str(i), times={"cpu": float(i + 1)}))
    problem = Problem(g, Cluster((Device("cpu0", "cpu", "cpu"), Device("cpu1", "cpu", "cpu"))))
    plan = solve(problem, ideal_limit=1000, time_limit=2)
    assert plan.solver in ("slicegraph", "brkga")
    # the heuristics prove nothing themselves; auto marks the plan optimal only when its bound meets it
    assert (plan.status == "optimal") == (plan.lower_bound >= plan.objective)
    assert plan.meta["auto"]["dp"] == "skipped: more than 1000 ideals"
    assert plan.objective == costmodel.evaluate(problem, plan) <= sum(range(1, 17))


def test_a_contiguous_optimum_of_a_problem_that_allows_any_split_is_not_called_optimal():
    """The DP's plan of a non-contiguous problem said status 'optimal' in its JSON and plan file,
    where auto found a better split (found by fuzzing): it is optimal among contiguous splits only."""
    import dataclasses

    from torchplace.solvers import solve
    from torchplace.workloads import read_dnn_partitioning

    from .conftest import DNN

    problem = read_dnn_partitioning(DNN / "LayerGraphs" / "bert24_inference.json")
    pieces = dataclasses.replace(problem, contiguous=False)
    assert solve(problem, "dp").status == "optimal"
    plan = solve(pieces, "dp")
    assert plan.status == "feasible" and plan.lower_bound < plan.objective
    assert "feasible; proven optimal among contiguous splits" in str(plan)
    assert plan.to_json()["status"] == "feasible"


def test_times_beyond_float_precision_are_a_typed_error_not_an_assertion(tmp_path):
    """A time of 1e18 (meant as "cannot run here") made the DP's prefix sums lose every small time,
    and solve failed with a bare AssertionError (found by fuzzing)."""
    import json

    from torchplace.errors import SolverError
    from torchplace.solvers import solve
    from torchplace.workloads import read_dnn_partitioning

    from .conftest import DNN

    data = json.loads((DNN / "LayerGraphs" / "bert24_inference.json").read_text())
    for node in data["nodes"][3:5]:
        node["cpuLatency"] = 1e18
    path = tmp_path / "huge.json"
    path.write_text(json.dumps(data))
    problem = read_dnn_partitioning(path)
    with pytest.raises(SolverError, match="lost precision.*supported devices"):
        solve(problem, "dp")
    plan = solve(problem, "auto", time_limit=5)
    assert plan.status != "optimal" and plan.meta["auto"]["dp"].startswith("failed")
