"""OpGraph JSON round trip and the dnn-partitioning reader's errors."""
from __future__ import annotations

import json

import pytest

from torchplace.errors import WorkloadFormatError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.workloads import read_dnn_partitioning

from .conftest import DNN


def test_json_round_trip_is_exact(tmp_path, workloads_dir):
    g = read_dnn_partitioning(DNN / "OperatorGraphs/bert_l-3_training.json").graph
    g.nx.nodes[next(iter(g))]["record"] = NodeRecord(
        "x", op="call_function:aten.mm", fx_nodes=("mm", "add"), module="layer.0", param_bytes=3,
        output_bytes=1 << 40, temp_bytes=7, times={"cpu": 0.1 + 0.2, "cuda": 1e-300}, transfer_time=None,
        colocation="c", backward=True,
    )
    g.save(tmp_path / "g.json")
    h = OpGraph.load(tmp_path / "g.json")
    assert h == g
    assert list(h) == list(g)
    assert h.record(next(iter(h))).times["cpu"] == 0.1 + 0.2


def test_reader_builds_cluster_and_mode(workloads_dir):
    p = read_dnn_partitioning(DNN / "LayerGraphs/bert24_training.json")
    assert p.mode == "training"
    assert [d.kind for d in p.cluster.devices] == ["accel"] * 6 + ["cpu"]
    assert p.cluster.devices[0].memory_bytes == 17185374208
    assert p.cluster.devices[-1].memory_bytes is None


def _write(tmp_path, data):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    return path


def _valid():
    return {
        "maxSizePerFPGA": 100, "maxFPGAs": 1, "maxCPUs": 1,
        "nodes": [
            {"id": 1, "supportedOnFpga": True, "cpuLatency": 2, "fpgaLatency": 1, "isBackwardNode": 0},
            {"id": 2, "supportedOnFpga": 0, "cpuLatency": 2, "fpgaLatency": 1, "isBackwardNode": False},
        ],
        "edges": [{"sourceId": 1, "destId": 2, "cost": 0.5}],
    }


def test_reader_accepts_bools_and_ints(tmp_path):
    p = read_dnn_partitioning(_write(tmp_path, _valid()))
    assert p.graph.record("1").times == {"cpu": 2.0, "accel": 1.0}
    assert p.graph.record("2").times == {"cpu": 2.0}  # not supported on the accelerator
    assert p.transfer_time("1") == 0.5


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["nodes"][0].pop("cpuLatency"), "nodes[0]: missing field 'cpuLatency'"),
        (lambda d: d["nodes"][1].update(fpgaLatency="fast"), "nodes[1].fpgaLatency"),
        (lambda d: d["nodes"][0].update(supportedOnFpga=2), "nodes[0].supportedOnFpga"),
        (lambda d: d["nodes"][1].update(isBackwardNode="no"), "nodes[1].isBackwardNode"),
        (lambda d: d["edges"][0].update(destId=9), "edges[0].destId"),
        (lambda d: d["edges"][0].update(cost=-1), "edges[0].cost"),
        (lambda d: d.pop("maxFPGAs"), "maxFPGAs"),
        (lambda d: d["edges"].append({"sourceId": 1, "destId": 2, "cost": 3}), "edges[1].cost"),
        (lambda d: d["edges"].append({"sourceId": 2, "destId": 1, "cost": 1}), "not a DAG"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate id"),
    ],
)
def test_reader_errors_name_the_field(tmp_path, mutate, field):
    data = _valid()
    mutate(data)
    with pytest.raises(WorkloadFormatError) as e:
        read_dnn_partitioning(_write(tmp_path, data))
    assert field in str(e.value)


def test_reader_rejects_non_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{nodes:")
    with pytest.raises(WorkloadFormatError, match="not valid JSON"):
        read_dnn_partitioning(path)


def test_cycle_is_reported():
    g = OpGraph()
    for n in "ab":
        g.add_node(n, NodeRecord(n))
    g.add_edge("a", "b")
    g.add_edge("b", "a")
    with pytest.raises(ValueError, match="not a DAG"):
        g.check_dag()


def test_expert_split_costs_what_the_paper_says(workloads_dir):
    """An independent check of the cost model: the human expert split of BERT-24 has max-load
    20.084 (Tarnawski et al. 2020, Sec. 6 / shared workloads README)."""
    from torchplace import costmodel
    from torchplace.plan import Stage
    from torchplace.workloads import read_expert_split

    problem = read_dnn_partitioning(DNN / "LayerGraphs/bert24_inference.json")
    assignment = read_expert_split(DNN.parent / "bert24_inference_expert.json", problem)
    assert set(assignment) == set(problem.graph)
    stages = [Stage(d, tuple(v for v in problem.graph if assignment[v] == d)) for d in sorted(set(assignment.values()))]
    assert costmodel.evaluate_stages(problem, stages)[0] == pytest.approx(20.084, rel=1e-4)
