"""Fusion: MOIRAI GCOF rules, Baechi co-placement, merge_nodes, and plans expanded back to the original.

Every coarsening is checked against the same certificate (:func:`check_coarsening`): the coarse
graph is the quotient DAG of a partition of the original nodes, and every record is the merge of
its members' records. Plans solved on a coarse graph must validate on the original problem.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchplace import costmodel, solvers
from torchplace.devices import Cluster, Device
from torchplace.errors import InfeasibleError
from torchplace.fusion import (
    DEFAULT_RULES,
    Quotient,
    coarsen,
    coplace,
    gcof,
    merge_nodes,
    op_kind,
)
from torchplace.fusion.coplace import node_work
from torchplace.fusion.rules import MOIRAI_TABLE_I
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Problem
from torchplace.solvers.bounds import simple_lower_bound

from .graphs import brute_force_contiguous, problems

pytestmark = pytest.mark.usefixtures("mha_fastpath_off")


# -- certificates -----------------------------------------------------------------------------------
def check_coarsening(original: OpGraph, coarse: OpGraph, mapping) -> None:
    """``coarse`` is the quotient DAG of ``mapping`` and its records merge their members'."""
    coarse.check_dag()
    pos = {v: i for i, v in enumerate(original.topological_order())}
    members = [v for group in mapping.values() for v in group]
    assert sorted(members) == sorted(original), "every original node exactly once"
    assert list(mapping) == list(coarse)
    owner = {v: c for c, group in mapping.items() for v in group}
    for c, group in mapping.items():
        assert group[0] == c and list(group) == sorted(group, key=pos.__getitem__)
        recs = [original.record(v) for v in group]
        r = coarse.record(c)
        assert r.fx_nodes == tuple(n for m in recs for n in m.fx_nodes)
        assert r.param_bytes == sum(m.param_bytes for m in recs)
        assert r.temp_bytes == sum(m.temp_bytes for m in recs)
        assert set(r.times) == set.intersection(*(set(m.times) for m in recs))
        for k, t in r.times.items():
            assert t == pytest.approx(math.fsum(m.times[k] for m in recs))
        labels = {m.colocation for m in recs} - {None}
        assert len(labels) <= 1 and r.colocation == next(iter(labels), None)
        assert {m.backward for m in recs} == {r.backward}
    expected = {(owner[u], owner[v]) for u, v in original.edges if owner[u] != owner[v]}
    assert set(coarse.edges) == expected


def check_no_multi_output_fusion(original: OpGraph, mapping) -> None:
    """MOIRAI Sec. III-B: a multi-output connection is never fused, i.e. a node whose output is read
    inside its group is read only inside it."""
    for group in mapping.values():
        inside = set(group)
        for v in group:
            readers = set(original.successors(v))
            assert not (readers & inside) or readers <= inside, f"{v} is fused with only some of its readers"


# -- graphs ---------------------------------------------------------------------------------------
def chain_graph(ops, times=None) -> OpGraph:
    g = OpGraph()
    for i, op in enumerate(ops):
        g.add_node(f"n{i}", NodeRecord(f"n{i}", op=f"call_function:aten.{op}.default",
                                       times=dict(times or {"cpu": 1.0})))
        if i:
            g.add_edge(f"n{i - 1}", f"n{i}")
    return g


def graph_of(nodes, edges) -> OpGraph:
    """Nodes as ``{id: kind}`` (aten spellings) and edges as pairs."""
    g = OpGraph()
    for v, op in nodes.items():
        g.add_node(v, NodeRecord(v, op=f"call_function:aten.{op}", times={"cpu": 1.0}))
    for u, v in edges:
        g.add_edge(u, v)
    return g


@functools.cache
def traced_model(name: str):
    """(model, inputs, traced, profiled graph) for an example model, once per session."""
    from torchplace.models import build
    from torchplace.profiling import profile, trace

    model, inputs = build(name, batch=4)
    traced = trace(model, inputs)
    graph = profile(traced, inputs, kinds=("cpu", "accel"), warmup=1, repeats=1, progress=False)
    return model, inputs, traced, graph


def cluster(n_accel: int = 2, n_cpu: int = 1, memory: int | None = None) -> Cluster:
    devices = [Device(f"acc{i}", "meta", "accel", memory) for i in range(n_accel)]
    return Cluster(tuple(devices + [Device(f"cpu{i}", "cpu", "cpu", None) for i in range(n_cpu)]))


# -- rules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("op, kind", [
    ("call_function:aten.convolution.default", "conv"),
    ("call_function:aten.conv2d.default", "conv"),
    ("call_module:Conv2d", "conv"),
    ("call_function:aten._native_batch_norm_legit_no_training.default", "batch_norm"),
    ("call_function:aten.batch_norm.default", "batch_norm"),
    ("call_module:BatchNorm2d", "batch_norm"),
    ("call_function:aten.relu.default", "relu"),
    ("call_function:aten.relu_.default", "relu"),
    ("call_method:relu_", "relu"),
    ("call_function:torch.nn.functional.relu", "relu"),
    ("call_function:aten.add.Tensor", "add"),
    ("call_function:_operator.add", "add"),
    ("call_function:torch._C._nn.linear", "linear"),
    ("call_module:Linear", "linear"),
    ("call_module:Conv1D", "linear"),
    ("call_function:aten.addmm.default", "addmm"),
    ("call_function:aten.gelu.default", "gelu"),
    ("call_function:_operator.getitem", "view"),
    ("call_function:aten._unsafe_view.default", "view"),
    ("call_function:aten.scaled_dot_product_attention.default", "sdpa"),
    ("fused:conv+batch_norm", "fused"),
    ("", ""),
])
def test_op_kind_normalises_every_spelling(op, kind):
    assert op_kind(op) == kind


def test_default_rules_contain_moirai_table_i():
    assert {r.steps for r in MOIRAI_TABLE_I} == {
        ("conv", "batch_norm"), ("conv", "batch_norm", "relu"), ("conv", "batch_norm", "add", "relu")}
    assert set(MOIRAI_TABLE_I) <= set(DEFAULT_RULES)
    assert len(set(DEFAULT_RULES)) == len(DEFAULT_RULES)


def test_longest_rule_wins_and_unbound_tail_stays():
    g = chain_graph(["conv2d", "batch_norm", "relu", "conv2d"])
    coarse, mapping = gcof(g)
    assert mapping == {"n0": ("n0", "n1", "n2"), "n3": ("n3",)}
    assert coarse.record("n0").op == "fused:conv+batch_norm+relu"


# -- GCOF (MOIRAI Algorithm 1) ---------------------------------------------------------------------
def fig7_graph() -> OpGraph:
    """MOIRAI Fig. 7: a multi-output add, an add/relu pair that only starts r3, two conv/bn pairs,
    and conv2 o bn meeting the last add/relu through a multi-input add."""
    nodes = {"add0": "add.Tensor", "relu0": "relu.default", "add1": "add.Tensor", "relu1": "relu.default",
             "conv1": "conv2d.default", "bn1": "batch_norm.default", "conv2": "conv2d.default",
             "bn2": "batch_norm.default", "add2": "add.Tensor", "relu2": "relu.default"}
    edges = [("add0", "relu0"), ("add0", "conv1"), ("relu0", "add1"), ("add1", "relu1"), ("relu1", "add2"),
             ("conv1", "bn1"), ("bn1", "conv2"), ("conv2", "bn2"), ("bn2", "add2"), ("add2", "relu2")]
    return graph_of(nodes, edges)


def test_gcof_reproduces_moirai_fig7():
    g = fig7_graph()
    coarse, mapping = gcof(g, MOIRAI_TABLE_I, injective=False)
    check_coarsening(g, coarse, mapping)
    groups = {m for m in mapping.values() if len(m) > 1}
    assert groups == {("conv1", "bn1"), ("conv2", "bn2", "add2", "relu2")}
    assert len(coarse) == 6


def test_gcof_never_fuses_a_multi_output_connection():
    g = fig7_graph()
    for rules in (MOIRAI_TABLE_I, DEFAULT_RULES):
        for injective in (False, True):
            coarse, mapping = gcof(g, rules, injective=injective)
            check_coarsening(g, coarse, mapping)
            check_no_multi_output_fusion(g, mapping)
            assert mapping["add0"] == ("add0",)  # read by relu0 and conv1


def test_a_model_output_read_inside_the_graph_is_a_multi_output_connection():
    g = chain_graph(["linear", "relu"])
    g.replace_record("n0", NodeRecord("n0", op="call_function:aten.linear.default", fx_nodes=("lin",),
                                      times={"cpu": 1.0}))
    assert len(gcof(g)[0]) == 1
    g.meta["outputs"] = ["lin"]  # the linear's result is also returned by the model
    assert len(gcof(g)[0]) == 2
    assert len(coplace(g, max_group_time=math.inf)[0]) == 2


def test_gcof_fuses_conv_bn_relu_on_resnet():
    _, _, _, g = traced_model("resnet")
    coarse, mapping = gcof(g)
    check_coarsening(g, coarse, mapping)
    check_no_multi_output_fusion(g, mapping)
    groups = set(mapping.values())
    assert ("conv2d_1", "batch_norm", "relu_1") in groups  # MOIRAI r2
    assert ("conv2d_2", "batch_norm_1", "add", "relu_2") in groups  # r3, through the multi-input add
    assert coarse.record("conv2d_2").op == "fused:conv+batch_norm+add+relu"
    assert len(coarse) <= len(g) // 2
    assert set(coarsen(g, coplace=False, max_group_time=math.inf).mapping.values()) >= {m for m in groups if len(m) > 1}
    # The stem's relu feeds the block and its 1x1 skip conv: a multi-output node keeps its readers apart.
    stem = next(c for c, m in mapping.items() if "relu" in m)
    assert not {"conv2d_1", "conv2d_3"} & set(mapping[stem])


@pytest.mark.parametrize("name, at_most", [("mlp", 4), ("transformer", 20)])
def test_gcof_on_traced_models(name, at_most):
    _, _, _, g = traced_model(name)
    coarse, mapping = gcof(g)
    check_coarsening(g, coarse, mapping)
    check_no_multi_output_fusion(g, mapping)
    assert len(coarse) <= at_most < len(g)


def test_gcof_respects_colocation_and_kinds():
    g = chain_graph(["conv2d", "batch_norm", "relu"])
    g.replace_record("n1", NodeRecord("n1", op="call_function:aten.batch_norm.default", times={"cpu": 1.0},
                                      colocation="k"))
    assert len(gcof(g)[0]) == 3  # conv would have to join n1's colocation class
    h = chain_graph(["linear", "relu"])
    h.replace_record("n1", NodeRecord("n1", op="call_function:aten.relu.default", times={"cpu": 1.0, "accel": 1.0}))
    assert len(gcof(h)[0]) == 2  # the fused node could no longer run on accel


# -- co-placement (Baechi Sec. 3.2-3.3) -----------------------------------------------------------------
def test_uncapped_coplacement_collapses_a_chain_and_the_cap_keeps_it_splittable():
    g = chain_graph(["mm"] * 16)
    assert len(coplace(g, max_group_time=math.inf)[0]) == 1
    coarse, mapping = coplace(g, devices=2)  # cap 16 / (4 * 2) = 2 nodes' work
    check_coarsening(g, coarse, mapping)
    assert [len(m) for m in mapping.values()] == [2] * 8


def test_colocated_neighbours_merge_but_forward_and_backward_stay_apart():
    g = OpGraph()
    for v, coloc, bwd in [("f1", "k", False), ("f2", "k", False), ("b2", "k", True), ("b1", "k", True)]:
        g.add_node(v, NodeRecord(v, times={"cpu": 1.0}, colocation=coloc, backward=bwd))
    for e in [("f1", "f2"), ("f2", "b2"), ("b2", "b1")]:
        g.add_edge(*e)
    coarse, mapping = coplace(g, single_consumer=False)
    check_coarsening(g, coarse, mapping)
    assert mapping == {"f1": ("f1", "f2"), "b2": ("b2", "b1")}
    assert coarse.record("f1").colocation == coarse.record("b2").colocation == "k"


def test_cycle_safety_follows_baechi_fig5():
    # Fig. 5a: src -> mid -> dst and src -> dst; fusing src and dst would close a cycle through mid.
    g = OpGraph()
    for v, coloc in [("src", "k"), ("mid", None), ("dst", "k"), ("other", None)]:
        g.add_node(v, NodeRecord(v, times={"cpu": 1.0}, colocation=coloc))
    for e in [("src", "mid"), ("mid", "dst"), ("src", "dst"), ("other", "dst")]:
        g.add_edge(*e)
    q = Quotient(g)
    assert not q.cycle_safe("src", "dst")
    assert q.cycle_safe("src", "mid") and q.cycle_safe("other", "dst")
    with pytest.raises(ValueError, match="cycle"):
        q.merge("src", "dst", "test")
    assert len(coplace(g, single_consumer=False)[0]) == 4


# -- merge_nodes ------------------------------------------------------------------------------------------
def test_merge_nodes_refuses_bad_groups():
    g = fig7_graph()
    with pytest.raises(ValueError, match="two groups"):
        merge_nodes(g, [["conv1", "bn1"], ["bn1", "conv2"]])
    with pytest.raises(ValueError, match="not a node"):
        merge_nodes(g, [["conv1", "nope"]])
    with pytest.raises(ValueError, match="cycle"):
        merge_nodes(g, [["relu0", "relu1"]])  # add1 sits between them
    h = chain_graph(["mm", "mm"])
    h.replace_record("n0", NodeRecord("n0", colocation="a"))
    h.replace_record("n1", NodeRecord("n1", colocation="b"))
    with pytest.raises(ValueError, match="colocation"):
        merge_nodes(h, [["n0", "n1"]])


def test_merged_record_counts_leaving_outputs_once():
    g = OpGraph()
    for v, out, tt in [("a", 10, 1.0), ("b", 20, 2.0), ("c", 40, 4.0), ("d", 80, 8.0)]:
        g.add_node(v, NodeRecord(v, output_bytes=out, transfer_time=tt, times={"cpu": 1.0}))
    for e in [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")]:
        g.add_edge(*e)
    coarse, _ = merge_nodes(g, [["a", "b", "c"]])
    r = coarse.record("a")
    assert (r.output_bytes, r.transfer_time, r.name) == (60, 6.0, "a+b+c")  # b and c are read by d


# -- the front door and plans on the original graph ------------------------------------------------------
_OPS = ["conv2d.default", "batch_norm.default", "relu.default", "add.Tensor", "linear.default", "view.default",
        "layer_norm.default", "dropout.default", "mul.Tensor", "gelu.default"]


@st.composite
def fusable_problems(draw, max_nodes: int = 7) -> Problem:
    """tests/graphs.py problems (colocation, CPU-only nodes, memory) with operator kinds on the nodes."""
    problem = draw(problems(max_nodes=max_nodes))
    g = problem.graph
    for v, r in list(g.records()):
        op = f"call_function:aten.{draw(st.sampled_from(_OPS))}"
        g.replace_record(v, NodeRecord(r.name, op=op, fx_nodes=(v,), param_bytes=r.param_bytes,
                                       times=r.times, transfer_time=r.transfer_time, colocation=r.colocation))
    return problem


@settings(max_examples=80, deadline=None)
@given(fusable_problems(), st.sampled_from([None, 0.0, 5.0, math.inf]), st.booleans())
def test_random_coarsenings_are_certified_and_plans_expand(problem, cap, injective):
    g = problem.graph
    c = coarsen(g, injective=injective, max_group_time=cap, devices=len(problem.cluster))
    check_coarsening(g, c.graph, c.mapping)
    if all(r.colocation is None for _, r in g.records()):
        check_no_multi_output_fusion(g, c.mapping)
    try:
        coarse_plan = solvers.solve(c.coarse_problem(problem))
    except InfeasibleError:
        return  # coarsening may rule out the only feasible splits (e.g. tight memory)
    plan = c.expand_plan(coarse_plan, problem, lower_bound=simple_lower_bound(problem))
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.objective >= brute_force_contiguous(problem) * (1 - 1e-9)


@st.composite
def sparse_graphs(draw, max_nodes: int = 30) -> OpGraph:
    """Larger DAGs where most nodes have one or two readers, so rule chains are common."""
    n = draw(st.integers(1, max_nodes))
    g = OpGraph()
    for i in range(n):
        kinds = draw(st.sampled_from([{"cpu": 1.0}, {"cpu": 2.0, "accel": 0.5}]))
        coloc = draw(st.sampled_from([None, None, None, "k1", "k2"]))
        g.add_node(str(i), NodeRecord(str(i), op=f"call_function:aten.{draw(st.sampled_from(_OPS))}",
                                      fx_nodes=(f"fx{i}",), param_bytes=i, temp_bytes=2 * i, times=kinds,
                                      colocation=coloc))
        for j in set(draw(st.lists(st.integers(0, i - 1), max_size=2)) if i else ()):
            g.add_edge(str(j), str(i))
    return g


@settings(max_examples=150, deadline=None)
@given(sparse_graphs(), st.sampled_from([None, 1.0, 4.0, math.inf]), st.booleans(), st.booleans())
def test_random_sparse_coarsenings_are_certified(g, cap, injective, use_coplace):
    c = coarsen(g, injective=injective, coplace=use_coplace, max_group_time=cap)
    check_coarsening(g, c.graph, c.mapping)
    if not use_coplace:
        check_no_multi_output_fusion(g, c.mapping)
    assert c.max_group_time == (cap if cap is not None else sum(map(node_work, dict(g.records()).values())) / 32)
    for group in c.mapping.values():
        if len(group) > 1 and all(g.record(v).colocation is None for v in group):
            assert math.fsum(node_work(g.record(v)) for v in group) <= c.max_group_time * (1 + 1e-12)


def test_expand_maps_assignments_and_stages():
    g = fig7_graph()
    c = coarsen(g, rules=MOIRAI_TABLE_I, injective=False, coplace=False, max_group_time=math.inf)
    assignment = c.expand({v: "acc0" for v in c.graph})
    assert assignment == {v: "acc0" for v in g}
    [stage] = c.expand([Stage("acc0", tuple(c.graph))])
    assert stage.nodes == tuple(g.topological_order())
    with pytest.raises(KeyError, match="not a node of the coarse graph"):
        c.expand({"bn1": "acc0"})


@pytest.mark.parametrize("name", ["mlp", "resnet", "transformer"])
def test_plans_on_coarse_traced_graphs_are_valid_on_the_original(name):
    _, _, _, g = traced_model(name)
    problem = Problem(g, cluster(2, 1))
    c = coarsen(g, devices=len(problem.cluster))
    check_coarsening(g, c.graph, c.mapping)
    if name != "mlp":  # each of the MLP's 4 Linears is ~W/4, over the cap W/12: nothing may merge
        assert len(c.graph) < len(g)
    report = c.report()
    assert (report.nodes_before, report.nodes_after) == (len(g), len(c.graph))
    assert (report.edges_before, report.edges_after) == (g.nx.number_of_edges(), c.graph.nx.number_of_edges())
    coarse_plan = solvers.solve(c.coarse_problem(problem))
    plan = c.expand_plan(coarse_plan, problem, lower_bound=simple_lower_bound(problem))
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert plan.objective >= solvers.solve(problem, method="dp").objective * (1 - 1e-9)


def test_coarsening_is_deterministic():
    _, _, _, g = traced_model("transformer")
    assert coarsen(g, devices=2).mapping == coarsen(g, devices=2).mapping


def test_placed_model_from_a_coarse_plan_gives_the_same_outputs():
    from torchplace.api import PlacedModule
    from torchplace.devices import make_cluster

    model, inputs, traced, g = traced_model("resnet")
    problem = Problem(g, make_cluster(["cpu:0", "cpu:1"]))
    c = coarsen(g, devices=2)
    plan = c.expand_plan(solvers.solve(c.coarse_problem(problem)), problem)
    placed = PlacedModule(traced, problem, plan, microbatches=2)
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))
