"""Piper (Tarnawski, Narayanan, Phanishayee 2021): reader, cost model, knapsack, DP vs brute force."""
from __future__ import annotations

import copy
import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import WORKLOADS
from torchplace import costmodel, solvers
from torchplace.cli import main
from torchplace.errors import InfeasibleError, InvalidPlanError, UsageError, WorkloadFormatError
from torchplace.graph import TMPC, NodeRecord, OpGraph
from torchplace.plan import Stage
from torchplace.problem import Parallel
from torchplace.solvers import piper, piper_equi, piper_knapsack
from torchplace.workloads import read_piper
from torchplace.workloads.piper import piper_problem

BERT = WORKLOADS / "piper" / "bert32a100.json"
GIB = 2**30


def _bert(**kw):
    return read_piper(BERT, bandwidth=25 * GIB, **kw)


# -- reader ---------------------------------------------------------------------------------------
def test_reads_bert32a100():
    p = read_piper(BERT)
    assert len(p.graph) == 37 and len(list(p.graph.edges)) == 67
    assert p.parallel == Parallel(devices=10, memory_bytes=80e9, bandwidth=25e9, microbatches=1920)
    layer = p.graph.record("3")
    assert sorted(layer.tmpcs) == [1, 2, 4, 8]
    recomp = layer.tmpcs[8][1]
    assert recomp.id == "activation recomp" and recomp.recompute and not layer.tmpcs[8][0].recompute
    assert recomp.sync_in == {"1": 31457280.0, "4": 16777216.0} and recomp.sync_out == {"5": 31457280.0}
    assert p.graph.edge_bytes("1", "3") == 31457280.0


def test_opgraph_json_keeps_tmpcs_and_edge_bytes():
    g = read_piper(BERT).graph
    assert OpGraph.from_json(json.loads(json.dumps(g.to_json()))) == g


def _broken(tmp_path, change):
    data = json.loads(BERT.read_text())
    change(data)
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("mbsInBatch"), "missing field 'mbsInBatch'"),
    (lambda d: d.update(maxDevices=2.5), "maxDevices"),
    (lambda d: d.update(bandwidth=0), "bandwidth"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0].update(timePerSample=-1), "nodes[3] (id 3).TMPCs['1'][0].timePerSample"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0].pop("memoryUsageA"), "missing field 'memoryUsageA'"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0]["syncTimeFw"].update({"7": 1.0}), "'7' is not an incoming neighbour"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0]["syncTimeBw"].pop("5"), "missing the outgoing edge with node '5'"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][1].update(id="vanilla"), "TMPC ids repeat"),
    (lambda d: d["nodes"][3]["TMPCs"].pop("1"), "no TMPC for t=1"),
    (lambda d: d["nodes"][3]["TMPCs"].update({"x": []}), "tensor-parallel degree"),
    (lambda d: d["edges"].append({"sourceId": 0, "destId": 99, "communicationCost": 1}), "edges[67].destId"),
    (lambda d: d["edges"].append(dict(d["edges"][0])), "listed twice"),
    (lambda d: d["edges"][0].update(communicationCost="big"), "edges[0].communicationCost"),
    # numbers whose sums overflow, or whose inf transfer times turned the DP's differences NaN (a plan came back)
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0].update(timePerSample=1e200), "timePerSample: expected a number of seconds up to 1e+100"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0].update(parameterSize=1e30), "parameterSize: expected a number of bytes below 2**53"),
    (lambda d: d["nodes"][3]["TMPCs"]["1"][0]["syncTimeBw"].update({"5": 1e30}), "syncTimeBw['5']: expected a number of bytes"),
    (lambda d: d["edges"][3].update(communicationCost=1e30), "edges[3].communicationCost: expected a number of bytes"),
    (lambda d: d.update(bandwidth=1e-300), "a bandwidth of 1e-300 bytes/s moves"),
])
def test_malformed_file_names_the_field(tmp_path, change, words):
    with pytest.raises(WorkloadFormatError, match=None) as e:
        read_piper(_broken(tmp_path, change))
    assert words in str(e.value)


def test_cycle_is_a_format_error(tmp_path):
    def cycle(d):
        d["edges"].append({"sourceId": 36, "destId": 3, "communicationCost": 1})
        for n in d["nodes"]:
            for xs in n["TMPCs"].values():
                for x in xs:
                    if n["id"] == 36:
                        x["syncTimeBw"]["3"] = 0
                    if n["id"] == 3:
                        x["syncTimeFw"]["36"] = 0
    with pytest.raises(WorkloadFormatError, match="not a DAG"):
        read_piper(_broken(tmp_path, cycle))


# -- tiny problems --------------------------------------------------------------------------------
def _tiny(n_nodes, edges, tmpcs, *, devices, memory, microbatches, bandwidth=10.0):
    g = OpGraph()
    for v in range(n_nodes):
        g.add_node(str(v), NodeRecord(str(v), tmpcs=tmpcs[v]))
    for u, v, c in edges:
        g.add_edge(str(u), str(v), c)
    return piper_problem(g, Parallel(devices, float(memory), bandwidth, microbatches))


def test_stage_cost_by_hand():
    x = TMPC("v", time=4.0, param_bytes=10.0, mem_a=3.0, mem_b=5.0, sync_in={"0": 1.0}, sync_out={})
    x0 = TMPC("v", time=1.0, param_bytes=0.0, mem_a=1.0, mem_b=0.0, sync_in={}, sync_out={"1": 2.0})
    p = _tiny(2, [(0, 1, 6.0)], [{1: (x0,)}, {2: (x,)}], devices=8, memory=100, microbatches=4)
    c = costmodel.piper_stage(p, ["1"], t=2, d=2, s=3, tmpcs={"1": "v"})
    assert c.compute == pytest.approx(2.0)                       # 4 / d
    assert c.transfer_in == pytest.approx(2 * (6 + 1) / 2 / 10)  # 2 (c + c^fw) / d / B
    assert c.allreduce == pytest.approx(4 * 1 * 10 / 2 / 4 / 10)  # 4 (d-1)/d w / N / B
    assert c.memory == 3 * 2 + 5                                  # a ceil(s/d) + b
    assert c.load == pytest.approx(c.compute + c.transfer_in + c.allreduce)


def _tmpc_lists(draw, n_nodes, edges):
    preds = {v: [u for u, w, _ in edges if w == v] for v in range(n_nodes)}
    succs = {v: [w for u, w, _ in edges if u == v] for v in range(n_nodes)}
    num = st.integers(0, 6).map(float)
    out = []
    for v in range(n_nodes):
        by_t = {}
        for t in draw(st.sampled_from([(1,), (1, 2)])):
            k = draw(st.integers(1, 2))
            by_t[t] = tuple(
                TMPC(f"x{i}", time=draw(st.integers(1, 9)) / t, param_bytes=draw(num), mem_a=draw(num),
                     mem_b=draw(num), sync_in={str(u): draw(num) for u in preds[v]},
                     sync_out={str(w): draw(num) for w in succs[v]}, recompute=i == 1)
                for i in range(k))
        out.append(by_t)
    return out


@st.composite
def tiny_problems(draw):
    n = draw(st.integers(1, 3))
    pairs = [(u, v) for u in range(n) for v in range(u + 1, n)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=4)) if pairs else []
    edges = [(u, v, float(draw(st.integers(0, 5)))) for u, v in chosen]
    return _tiny(n, edges, _tmpc_lists(draw, n, edges), devices=draw(st.integers(1, 4)),
                 memory=draw(st.integers(4, 40)), microbatches=draw(st.sampled_from([1, 2, 3, 4])))


def brute_force(problem):
    """Every ordered split into stages with data flowing forward, every d | N, t and TMPC per node,
    each costed by the cost model; the least max load, or inf."""
    par, g = problem.parallel, problem.graph
    nodes = g.topological_order()
    best = math.inf
    for m in range(1, len(nodes) + 1):
        for labels in itertools.product(range(m), repeat=len(nodes)):
            stage_of = dict(zip(nodes, labels))
            if set(labels) != set(range(m)) or any(stage_of[u] > stage_of[v] for u, v in g.edges):
                continue
            groups = [tuple(v for v in nodes if stage_of[v] == i) for i in range(m)]
            degs = [(t, d) for t in (1, 2) for d in range(1, par.microbatches + 1) if par.microbatches % d == 0]
            for choice in itertools.product(degs, repeat=m):
                if sum(t * d for t, d in choice) > par.devices or sum(d for _, d in choice) > par.microbatches:
                    continue
                options = [[x.id for x in g.record(v).tmpcs.get(t, ())] for grp, (t, _) in zip(groups, choice)
                           for v in grp]
                for ids in itertools.product(*options):
                    it = iter(ids)
                    stages = [Stage(f"s{i}", grp, data_parallel=d, tensor_parallel=t,
                                    tmpcs={v: next(it) for v in grp}) for i, (grp, (t, d)) in enumerate(zip(groups, choice))]
                    load, costs = costmodel.evaluate_stages(problem, stages)
                    if all(c.memory <= par.memory_bytes for c in costs):
                        best = min(best, load)
    return best


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiny_problems())
def test_dp_with_an_exact_knapsack_equals_brute_force(problem):
    expected = brute_force(problem)
    for prune in (False, True):
        if math.isinf(expected):
            with pytest.raises(InfeasibleError):
                piper.solve(problem, knapsack="brute-force", prune=prune)
            continue
        plan = piper.solve(problem, knapsack="brute-force", prune=prune)
        assert plan.objective == pytest.approx(expected, rel=1e-9)
        assert plan.objective == costmodel.evaluate(problem, plan)
        heuristic = piper.solve(problem)  # never better than the optimum
        assert heuristic.objective >= expected * (1 - 1e-9)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(0, 10**6), st.integers(1, 3))
def test_knapsack_heuristic_is_feasible_and_exact_agrees_with_brute_force(n, seed, slots):
    rng = np.random.default_rng(seed)
    cost = rng.integers(1, 20, size=(n, slots, 1)).astype(float)
    a, b = rng.integers(0, 10, size=(n, slots)).astype(float), rng.integers(0, 10, size=(n, slots)).astype(float)
    ys, limit = np.array([1.0, 2.0, 3.0]), float(rng.integers(5, 60))
    cost = np.repeat(cost, 3, axis=2)
    brute, _ = piper_knapsack.brute_force(cost, a, b, limit, ys)
    exact, _ = piper_knapsack.exact(cost, a, b, limit, ys)
    heur, picks = piper_knapsack.heuristic(cost, a, b, limit, ys)
    np.testing.assert_allclose(exact, brute)
    assert np.all(heur >= brute - 1e-9) and np.array_equal(np.isinf(heur), np.isinf(brute)) or slots > 2
    rows = np.arange(n)
    for j, y in enumerate(ys):
        if np.isfinite(heur[j]):
            assert (a[rows, picks[:, j]] * y + b[rows, picks[:, j]]).sum() <= limit
            assert cost[rows, picks[:, j], j].sum() == pytest.approx(heur[j])


# -- bert32a100 -----------------------------------------------------------------------------------
def test_bert_plan_is_valid_and_beats_the_baselines():
    p = _bert(devices=16, memory_bytes=8 * GIB)
    plan = solvers.solve(p)  # auto = piper on a Piper problem
    assert plan.solver == "piper" and plan.objective == costmodel.evaluate(p, plan)
    assert plan.objective == pytest.approx(plan.meta["dp_value"], rel=1e-12)
    assert sum(s.data_parallel * s.tensor_parallel for s in plan.stages) <= 16
    assert plan.lower_bound <= plan.objective
    equi = piper_equi.solve(p)
    assert plan.objective <= equi.objective
    for opts in ({"data_parallel": False}, {"tensor_parallel": False}, {"recompute": False}):
        assert plan.objective <= piper.solve(p, **opts).objective * (1 + 1e-12)
    unpruned = piper.solve(p, prune=False)
    assert unpruned.objective == plan.objective


@pytest.mark.slow
def test_bert_one_gib_needs_tensor_parallelism_and_recomputation():
    p = _bert(devices=512, memory_bytes=1 * GIB)  # Fig. 1d: about 45 s here
    plan = piper.solve(p)
    assert all(s.tensor_parallel > 1 for s in plan.stages if any(v for v in s.nodes if p.graph.record(v).name
                                                                   == "ParallelTransformerLayer"))
    for opts in ({"tensor_parallel": False}, {"recompute": False}):
        with pytest.raises(InfeasibleError):
            piper.solve(p, **opts)


def test_plan_checks_catch_broken_piper_plans():
    p = _bert(devices=8, memory_bytes=8 * GIB)
    plan = piper.solve(p)
    too_many = [Stage(s.device, s.nodes, data_parallel=s.data_parallel * 4, tensor_parallel=s.tensor_parallel,
                      tmpcs=s.tmpcs) for s in plan.stages]
    with pytest.raises(InvalidPlanError, match="devices"):
        type(plan).build(p, too_many, solver="x", seconds=0, lower_bound=0)
    vanilla = [Stage(s.device, s.nodes, data_parallel=s.data_parallel, tensor_parallel=s.tensor_parallel,
                     tmpcs={v: "vanilla" for v in s.nodes}) for s in plan.stages]
    with pytest.raises(InvalidPlanError, match="bytes per device"):
        type(plan).build(p, vanilla, solver="x", seconds=0, lower_bound=0)
    no_tmpc = [Stage(s.device, s.nodes, data_parallel=s.data_parallel) for s in plan.stages]
    with pytest.raises(InvalidPlanError, match="no TMPC"):
        type(plan).build(p, no_tmpc, solver="x", seconds=0, lower_bound=0)


def test_methods_and_problems_must_match():
    p = _bert(devices=8)
    with pytest.raises(UsageError, match="Piper problem"):
        solvers.solve(p, method="dp")
    other = copy.copy(p)
    object.__setattr__(other, "parallel", None)
    with pytest.raises(UsageError, match="needs a Piper problem") as refused:
        solvers.solve(other, method="piper")
    assert "'dp'" in str(refused.value) and "piper-equi" not in str(refused.value)  # the methods for this problem
    with pytest.raises(UsageError, match="optimises latency") as refused:
        solvers.solve(other, method="moirai")
    assert "'dp'" in str(refused.value) and "piper" not in str(refused.value)  # the list was every throughput method


def test_cli_solves_a_piper_workload(capsys):
    assert main(["solve", str(BERT), "--method", "piper", "--devices", "8", "--memory-gb", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["solver"] == "piper" and len(out["stages"]) >= 2 and "tmpcs" in out["stages"][0]
    assert main(["solve", str(BERT), "--devices", "2", "--memory-gb", "0.5"]) == 2
    assert "no Piper configuration fits" in capsys.readouterr().err


def test_piper_plan_file_round_trip(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["solve", str(BERT), "--devices", "4", "--memory-gb", "80", "-o", str(out)]) == 0
    capsys.readouterr()
    from torchplace.plan import Plan

    plan = Plan.load(out)
    assert plan.stages[0].tmpcs and plan.stages[0].tensor_parallel >= 1
    assert main(["show", str(out)]) == 0
    assert "TPS" in capsys.readouterr().out


def test_report_of_a_piper_plan_shows_its_degrees_and_draws_no_made_up_schedule(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["solve", str(BERT), "--devices", "16", "--memory-gb", "8", "--microbatches", "16", "-o", str(out)]) == 0
    from torchplace.errors import UnsupportedError
    from torchplace.plan import Plan
    from torchplace.report import plot_schedule

    plan = Plan.load(out)
    with pytest.raises(UnsupportedError, match="Piper plan's schedule is not drawn"):
        plot_schedule(plan)  # an inference fill-drain of its TPS would be a made-up picture
    assert main(["report", str(out), "-o", str(tmp_path / "plan.html")]) == 0
    page = (tmp_path / "plan.html").read_text()
    assert "Piper plan&#x27;s schedule is not drawn" in page and "Predicted schedule (" not in page
    for column in ("<th>d</th>", "<th>t</th>", "<th>all-reduce s</th>", "<th>TPS s</th>", "<th>recomputed nodes</th>"):
        assert column in page
    for s, c in zip(plan.stages, plan.costs):  # each stage's degrees, recomputed nodes and TPS as the plan has them
        cells = f"<td>{s.data_parallel}</td><td>{s.tensor_parallel}</td><td>{len(s.nodes)}</td>" \
                f"<td>{sum('recomp' in x for x in s.tmpcs.values())}/{len(s.nodes)}</td>"
        assert cells in page and f"<td>{c.allreduce:.4g}</td><td>{c.load:.4g}</td>" in page


def test_exact_knapsack_takes_an_optimum_that_fills_memory_exactly():
    cost = np.array([[[1.0], [5.0]], [[1.0], [5.0]]])
    a, b = np.zeros((2, 2)), np.array([[10.0, 5.0], [10.0, 5.0]])
    values, picks = piper_knapsack.exact(cost, a, b, 15.0, np.array([1.0]))
    assert values[0] == 6.0 and sorted(picks[:, 0]) == [0, 1]


def test_the_exact_knapsack_prints_nothing():
    """The first highspy.Highs of a process writes HiGHS's banner to stdout from C++: it opened
    `torchplace solve --method piper --knapsack exact --json`'s output, which no JSON reader took.
    Run in a fresh process, where that first Highs is the knapsack's."""
    import subprocess
    import sys

    script = ("import numpy as np\n"
              "from torchplace.solvers import piper_knapsack\n"
              "cost = np.array([[[1.0], [5.0]], [[1.0], [5.0]]])\n"
              "a, b = np.zeros((2, 2)), np.array([[10.0, 5.0], [10.0, 5.0]])\n"
              "values, _ = piper_knapsack.exact(cost, a, b, 15.0, np.array([1.0]))\n"
              "print(values[0])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "6.0\n"


def test_equi_keeps_a_node_among_the_layers_with_the_layer_before_it():
    """A non-layer node between layers (a dropout named apart) went to the first stage: a plan
    with data flowing backward, refused by its own validation, and piper.solve (which prunes with
    equi) failed with it (found by fuzzing)."""
    names = {"0": "Layer", "1": "Layer", "2": "Dropout", "3": "Layer"}
    edges = [("0", "1"), ("1", "2"), ("2", "3")]
    g = OpGraph()
    for v, name in names.items():
        x = TMPC("vanilla", time=0.0 if name == "Dropout" else 1.0, sync_in={u: 0.0 for u, w in edges if w == v},
                 sync_out={w: 0.0 for u, w in edges if u == v})
        g.add_node(v, NodeRecord(name, tmpcs={1: (x,)}))
    for u, v in edges:
        g.add_edge(u, v, 0.0)
    p = piper_problem(g, Parallel(4, 100.0, 1.0, 4))
    equi = piper_equi.solve(p, data_parallel=False)  # three stages of one layer each
    assert [set(s.nodes) for s in equi.stages] == [{"0"}, {"1", "2"}, {"3"}]
    assert piper.solve(p, data_parallel=False).objective == equi.objective == 1.0


def _three_tmpc_nodes(rows, chain_edges=()):
    """Nodes with TMPCs x0, x1 recomp, x2 for t=1 from (time, mem_a, mem_b) rows."""
    g = OpGraph()
    for v, xs in rows.items():
        near = {"sync_in": {u: 0.0 for u, w in chain_edges if w == v},
                "sync_out": {w: 0.0 for u, w in chain_edges if u == v}}
        g.add_node(v, NodeRecord(v, tmpcs={1: tuple(
            TMPC(["x0", "x1 recomp", "x2"][i], time=float(p), mem_a=float(a), mem_b=float(b), recompute=i == 1, **near)
            for i, (p, a, b) in enumerate(xs))}))
    return g


def test_pruning_by_the_equi_plan_never_loses_the_heuristics_plan():
    """Here the equi plan (27, all recompute) beats every plan the heuristic knapsack finds (28):
    the equi bound pruned the whole table and piper.solve said nothing fits (found by fuzzing)."""
    g = _three_tmpc_nodes({"0": [(8, 0, 3), (7, 3, 2), (11, 8, 4)], "1": [(9, 6, 8), (10, 1, 2), (4, 7, 8)],
                           "2": [(12, 7, 1), (9, 0, 3), (2, 7, 7)], "3": [(1, 3, 6), (1, 8, 5), (3, 8, 5)]})
    p = piper_problem(g, Parallel(devices=1, memory_bytes=28.0, bandwidth=1.0, microbatches=3))
    assert piper_equi.solve(p).objective == 27.0
    assert piper.solve(p).objective == piper.solve(p, prune=False).objective == 28.0


def test_a_bound_keeps_entries_of_heuristic_values_that_do_not_grow_with_y():
    """The heuristic's TPS of the p stage is 32, 32, 31 for y = 1, 2, 3; a binary search for the
    last y within a bound of 31.5 stopped at y = 0 and the 31 plan (p's first, y = 3) was lost."""
    rows = {"p0": [(7, 0, 1), (6, 0, 3), (1, 5, 9)], "p1": [(18, 7, 8), (7, 3, 9), (14, 0, 1)],
            "p2": [(17, 6, 1), (11, 2, 1), (6, 8, 9)]}
    chain = ["p0", "p1", "p2", "z1", "z2"]
    edges = list(zip(chain, chain[1:]))
    g = _three_tmpc_nodes(rows, edges)
    for i, v in enumerate(("z1", "z2")):
        g.add_node(v, NodeRecord(v, tmpcs={1: (TMPC("x", time=1.0, param_bytes=100.0, sync_in={chain[i + 2]: 0.0},
                                                     sync_out={"z2": 0.0} if v == "z1" else {}),)}))
    for u, w in edges:
        g.add_edge(u, w, 100.0 if w.startswith("p") else 0.0)  # the p's stay together
    p = piper_problem(g, Parallel(devices=3, memory_bytes=15.0, bandwidth=1.0, microbatches=3))
    order = p.graph.topological_order()
    stages = piper._Stages(p, order, data_parallel=True, tensor_parallel=True, recompute=True,
                           knapsack=piper.KNAPSACKS["heuristic"])
    first = np.array([v.startswith("p") for v in order])
    np.testing.assert_array_equal(stages.table(first)[1, 1], [32.0, 32.0, 31.0])
    assert piper.run_dp(p, stages, order).dp[-1][3, 3] == 31.0
    assert piper.run_dp(p, stages, order, upper_bound=31.5).dp[-1][3, 3] == 31.0


def test_a_plans_tps_is_the_value_the_dp_found_when_degrees_have_different_numbers_of_tmpcs():
    """Two TMPCs per node for t=1, three for t=2: the table padded t=1 to three slots and so ran
    the loop greedy, the picks did not and ran the sorted one, which can choose otherwise; the plan
    came out at 24 where the DP had found 23 (found by fuzzing)."""
    rows = [{1: [(16, 1, 1, 2), (12, 1, 8, 2)], 2: [(8, 9, 9, 5), (9.5, 5, 1, 4), (6.5, 5, 2, 2)]},
            {1: [(6, 2, 1, 1), (1, 5, 5, 1)], 2: [(8.5, 8, 8, 2), (5, 4, 3, 5), (1, 4, 8, 2)]},
            {1: [(3, 1, 5, 2), (12, 1, 5, 4)], 2: [(2.5, 4, 7, 1), (8, 3, 0, 0), (0.5, 6, 9, 5)]},
            {1: [(6, 9, 3, 0), (13, 7, 5, 0)], 2: [(0.5, 7, 8, 3), (2, 7, 7, 3), (1.5, 5, 9, 1)]}]
    g = OpGraph()
    for i, by_t in enumerate(rows):
        near = {"sync_in": {str(i - 1): 1.0} if i else {}, "sync_out": {str(i + 1): 1.0} if i < 3 else {}}
        g.add_node(str(i), NodeRecord(str(i), tmpcs={t: tuple(
            TMPC(f"x{j}", time=p, mem_a=a, mem_b=b, param_bytes=w, **near) for j, (p, a, b, w) in enumerate(xs))
            for t, xs in by_t.items()}))
    for i, c in enumerate([4.0, 2.0, 2.0]):
        g.add_edge(str(i), str(i + 1), c)
    p = piper_problem(g, Parallel(2, 19.0, 1.0, 4))
    plan = piper.solve(p, prune=False)
    assert plan.objective == plan.meta["dp_value"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(0, 10**6))
def test_knapsack_heuristic_does_not_depend_on_padding(n, seed):
    """Padding two-TMPC nodes with a third, unusable slot (cost inf) changes no answer."""
    rng = np.random.default_rng(seed)
    ys = np.arange(1.0, 5.0)
    cost = np.repeat(rng.integers(1, 20, size=(n, 2, 1)).astype(float), len(ys), axis=2)
    a, b = rng.integers(0, 10, size=(n, 2)).astype(float), rng.integers(0, 10, size=(n, 2)).astype(float)
    limit = float(rng.integers(5, 80))
    padded = (np.concatenate([cost, np.full((n, 1, len(ys)), np.inf)], axis=1),
              np.concatenate([a, np.zeros((n, 1))], axis=1), np.concatenate([b, np.zeros((n, 1))], axis=1))
    values, picks = piper_knapsack.heuristic(cost, a, b, limit, ys)
    values3, picks3 = piper_knapsack.heuristic(*padded[:1], *padded[1:], limit, ys)
    np.testing.assert_array_equal(values, values3)
    np.testing.assert_array_equal(picks[:, np.isfinite(values)], picks3[:, np.isfinite(values)])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 10**6))
def test_knapsack_greedy_for_many_tmpcs_takes_the_two_tmpc_greedys_swaps(n, seed):
    """The one-swap-at-a-time greedy (nodes with 3+ TMPCs) and the sorted greedy (2 TMPCs) are one
    rule, the paper's: on two-TMPC nodes they pick alike. The loop ranked swaps by the bytes still
    over the limit, not all the bytes saved, and picked otherwise."""
    rng = np.random.default_rng(seed)
    ys = np.arange(1.0, 4.0)
    cost = np.repeat(rng.integers(1, 20, size=(n, 2, 1)).astype(float), len(ys), axis=2)
    a, b = rng.integers(0, 10, size=(n, 2)).astype(float), rng.integers(0, 10, size=(n, 2)).astype(float)
    limit = float(rng.integers(5, 80))
    values, picks = piper_knapsack.heuristic(cost, a, b, limit, ys)
    fastest = np.argmin(cost, axis=1)
    looped, loop_picks = piper_knapsack._heuristic_loop(cost, a, b, limit, ys, fastest)
    np.testing.assert_array_equal(values, looped)
    np.testing.assert_array_equal(picks[:, np.isfinite(values)], loop_picks[:, np.isfinite(values)])


def test_knapsack_greedy_takes_the_most_bytes_saved_per_second_added():
    """Sec. 4: the swap with the highest ratio of memory saved to time added, whatever the excess:
    1 byte over, a TMPC saving 10 bytes for 3 s beats one saving 1 byte for 1 s."""
    cost = np.array([[[0.0], [1.0], [3.0]]])
    a, b = np.zeros((1, 3)), np.array([[10.0, 9.0, 0.0]])
    values, picks = piper_knapsack.heuristic(cost, a, b, 9.0, np.array([1.0]))
    assert values.tolist() == [3.0] and picks.tolist() == [[2]]


@pytest.mark.parametrize("need, fits", [(10.5, False), (10.0, True)])
def test_fractional_memory_fits_as_the_cost_model_rounds_it(need, fits):
    """10.5 bytes of TMPC memory on devices of 10.7 bytes (a fraction of a GiB): the solvers kept
    it (10.5 <= 10.7), the cost model rounds the stage up to 11 whole bytes and Plan.build refused
    the solvers' own plan with InvalidPlanError (found by fuzzing)."""
    g = OpGraph()
    g.add_node("0", NodeRecord("0", tmpcs={1: (TMPC("vanilla", time=1.0, mem_a=0.25, mem_b=need - 0.25),)}))
    p = piper_problem(g, Parallel(devices=2, memory_bytes=10.7, bandwidth=1.0, microbatches=2))
    for solve in (piper.solve, piper_equi.solve):
        if fits:
            assert solve(p).costs[0].memory == 10
        else:
            with pytest.raises(InfeasibleError):
                solve(p)


def test_every_knapsack_fits_a_device_of_less_than_one_byte():
    """Less than one whole byte of memory leaves a limit of 0: the exact knapsack divided by it."""
    g = OpGraph()
    g.add_node("0", NodeRecord("0", tmpcs={1: (TMPC("fast", time=1.0, mem_b=1.0), TMPC("small", time=2.0))}))
    p = piper_problem(g, Parallel(devices=1, memory_bytes=0.5, bandwidth=1.0, microbatches=1))
    for knapsack in ("heuristic", "exact", "brute-force"):
        assert piper.solve(p, knapsack=knapsack).stages[0].tmpcs == {"0": "small"}


def test_a_piper_plan_file_is_refused_before_torchrun_is_asked_for(tmp_path, monkeypatch):
    """`torchplace run PIPER_PLAN.json --model mlp` said 'start the script with torchrun'; under
    torchrun every process then failed with 'is a Piper plan' (found by fuzzing)."""
    import torch

    import torchplace.distributed as tpd
    from torchplace.errors import UnsupportedError

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "piper.json"
    piper.solve(_bert(devices=4, memory_bytes=80 * GIB)).save(path)
    with pytest.raises(UnsupportedError, match="is a Piper plan"):
        tpd.place(torch.nn.Linear(2, 2), (torch.randn(2, 2),), plan=path, mode="training")


def test_too_many_downsets_points_to_what_a_piper_problem_takes():
    """The ideals DP's advice ('use method slicegraph or auto') names methods that refuse a Piper
    problem ('auto' is Piper again)."""
    from torchplace.errors import TooManyIdealsError

    with pytest.raises(TooManyIdealsError, match="piper-equi") as e:
        piper.solve(_bert(devices=4), ideal_limit=5)
    assert "slicegraph" not in str(e.value) and e.value.limit == 5


def test_tables_too_large_for_memory_are_refused_before_they_are_made(monkeypatch):
    """One (K+1) x (S+1) table per downset: K = N = 65536 (the reader allows it) is 32 GiB a table,
    allocated (and the process killed) before the memory check after each downset ran."""
    from torchplace.errors import ModelTooLargeError
    from torchplace.solvers import limits

    monkeypatch.setattr(limits, "MEMORY_BUDGET", 64 * 2**20)
    p = _bert(devices=2048, memory_bytes=80 * GIB, microbatches=2048)  # 44 tables of 32 MiB
    with pytest.raises(ModelTooLargeError, match="would take about 1.4 GiB"):
        piper.solve(p, prune=False)
