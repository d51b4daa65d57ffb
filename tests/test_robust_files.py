"""Issue 9, items 7 and 8: workload, graph and plan files are checked field by field; writes are atomic.

Every malformed file is a WorkloadFormatError that names the file and the field: never a
KeyError/TypeError/OverflowError/RecursionError/UnicodeDecodeError, never a silently truncated
count or size.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchplace import files
from torchplace.devices import Cluster, Device
from torchplace.errors import UsageError, WorkloadFormatError
from torchplace.graph import NodeRecord, OpGraph
from torchplace.plan import Plan
from torchplace.problem import Problem
from torchplace.solvers import dp
from torchplace.workloads import read_dnn_partitioning, read_expert_split, read_moirai_csv

from .conftest import WORKLOADS

MOIRAI = WORKLOADS / "moirai" / "example-1__instances.csv"
TASK_2 = '2,4,5,"4,5",7,6,8,0,1,3,1,0,2,3,2,0,2'  # the row of task 2 (line 4) of MOIRAI's example-1


# -- dnn-partitioning JSON --------------------------------------------------------------------------
_VALID = ('{"maxSizePerFPGA": 100, "maxFPGAs": 1, "maxCPUs": 1, "nodes": ['
          '{"id": 1, "supportedOnFpga": 1, "cpuLatency": 2, "fpgaLatency": 1, "isBackwardNode": 0, "size": 4},'
          '{"id": 2, "supportedOnFpga": 0, "cpuLatency": 2, "fpgaLatency": 1, "isBackwardNode": 0}],'
          ' "edges": [{"sourceId": 1, "destId": 2, "cost": 0.5, "size": 3.5}]}')


def _dnn(tmp_path: Path, old: str = "", new: str = "") -> Path:
    assert old in _VALID
    path = tmp_path / "w.json"
    path.write_text(_VALID.replace(old, new, 1))
    return path


def test_dnn_whole_floats_are_counts(tmp_path):
    p = read_dnn_partitioning(_dnn(tmp_path, '"maxFPGAs": 1', '"maxFPGAs": 2.0'))
    assert [d.name for d in p.cluster.devices] == ["acc0", "acc1", "cpu0"]
    assert p.graph.record("1").param_bytes == 4


@pytest.mark.parametrize(("old", "new", "field"), [
    ('"maxFPGAs": 1', '"maxFPGAs": 2.7', "top level.maxFPGAs: expected a non-negative whole number, got 2.7"),
    ('"maxCPUs": 1', '"maxCPUs": 1' + "0" * 400, "top level.maxCPUs: expected a non-negative whole number"),
    ('"maxCPUs": 1', '"maxCPUs": true', "top level.maxCPUs"),
    ('"maxSizePerFPGA": 100', '"maxSizePerFPGA": 1e400', "top level.maxSizePerFPGA"),
    ('"maxSizePerFPGA": 100', '"maxSizePerFPGA": Infinity', "top level.maxSizePerFPGA"),
    ('"maxFPGAs": 1, "maxCPUs": 1', '"maxFPGAs": 0, "maxCPUs": 0', "between 1 and 4096 devices"),
    ('"maxFPGAs": 1', '"maxFPGAs": 1e9', "between 1 and 4096 devices"),
    ('"size": 4', '"size": 1.7', "nodes[0].size: expected a non-negative whole number of bytes, got 1.7"),
    # int64 arrays overflowed (slicegraph: OverflowError) and MILPs crashed on such sizes
    ('"maxSizePerFPGA": 100', '"maxSizePerFPGA": 9223372036854775808',
     "top level.maxSizePerFPGA: expected a whole number of bytes below 2**53 (9.0e15), got 9223372036854775808"),
    ('"size": 4', '"size": 4611686018427387904', "nodes[0].size: expected a whole number of bytes below 2**53"),
    ('"cpuLatency": 2, "fpgaLatency": 1, "isBackwardNode": 0}', '"cpuLatency": NaN, "fpgaLatency": 1, "isBackwardNode": 0}',
     "nodes[1].cpuLatency: expected a non-negative finite number, got nan"),
    ('"fpgaLatency": 1,', '"fpgaLatency": -Infinity,', "nodes[0].fpgaLatency"),
    # sums of such times overflowed: OverflowError in fsum, dp's "raise max_memory to at least 0 bytes"
    ('"fpgaLatency": 1,', '"fpgaLatency": 1.7e308,', "nodes[0].fpgaLatency: expected a number of seconds up to 1e+100, got 1.7e+308"),
    ('"cost": 0.5', '"cost": 1e200', "edges[0].cost: expected a number of seconds up to 1e+100"),
    ('"cost": 0.5', '"cost": 1e400', "edges[0].cost"),
    ('"size": 3.5', '"size": NaN', "edges[0].size"),
    ('"sourceId": 1', '"sourceId": [1]', "edges[0].sourceId: [1] is not the id of any node"),
    ('"destId": 2', '"destId": 1', "edges[0]: edge 1 -> 1 is a self-loop"),
    ('"nodes": [', '"nodes": [], "x": [', "field 'nodes' is empty"),
])
def test_dnn_reader_names_file_and_field(tmp_path, old, new, field):
    path = _dnn(tmp_path, old, new)
    with pytest.raises(WorkloadFormatError) as e:
        read_dnn_partitioning(path)
    assert field in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("record", [NodeRecord("a", times={"cpu": 1.7e308}), NodeRecord("a", transfer_time=1e101),
                                    NodeRecord("a", times={"cpu": 1.0}, link_times={"c->d": 1e300})])
def test_a_problem_refuses_times_whose_sums_overflow_naming_the_node(record):
    g = OpGraph()
    g.add_node("a", record)
    with pytest.raises(UsageError, match=r"node 'a': .* s, more than 1e\+100 s, so large that sums of times overflow"):
        Problem(g, Cluster((Device("c", "cpu", "cpu"), Device("d", "cpu", "cpu"))))
    g.replace_record("a", NodeRecord("a", times={"cpu": 1e100}, transfer_time=1e100))
    assert dp.solve(Problem(g, Cluster((Device("c", "cpu", "cpu"),)))).objective == 1e100


def test_dnn_reader_refuses_sizes_that_add_up_past_exact_counting(tmp_path):
    # each size is fine, together they pass 2**53 bytes, beyond which sums of bytes are not exact
    path = _dnn(tmp_path, '"size": 4', '"size": 5000000000000000')
    path.write_text(path.read_text().replace('"isBackwardNode": 0}]', '"isBackwardNode": 0, "size": 5000000000000000}]'))
    with pytest.raises(WorkloadFormatError, match=r"nodes hold 10000000000000000 bytes together .*below 2\*\*53"):
        read_dnn_partitioning(path)


@pytest.mark.parametrize(("text", "fragment"), [
    ("", "the file is empty"),
    ("[1, 2]", r"expected a JSON object at the top level, got \[1, 2\]"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"maxFPGAs": 1' + "0" * 5000 + "}", "not valid JSON"),  # beyond Python's int digit limit
    ('{"nodes": [], "edges": []', "not valid JSON"),
])
def test_dnn_reader_unreadable_json(tmp_path, text, fragment):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(WorkloadFormatError, match=fragment):
        read_dnn_partitioning(path)


def test_unreadable_paths_name_the_file(tmp_path):
    with pytest.raises(WorkloadFormatError, match=f"cannot read workload file {tmp_path}: it is a directory"):
        read_dnn_partitioning(tmp_path)
    with pytest.raises(WorkloadFormatError, match="No such file"):
        read_dnn_partitioning(tmp_path / "missing.json")
    (tmp_path / "latin.json").write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(WorkloadFormatError, match=r"latin\.json: not UTF-8 text \(line 1: byte 0xe9 at offset 13\)"):
        read_dnn_partitioning(tmp_path / "latin.json")


@pytest.mark.parametrize(("expert", "fragment"), [
    ({"fpgas": [{"nodes": [1, 99]}]}, r"fpgas\[0\]\.nodes\[1\]: 99 is not the id of a node"),
    ({"fpgas": [{"nodes": []}, {"nodes": [1]}]}, r"fpgas\[1\]: the workload has no device acc1"),
    ({"fpgas": [{"nodes": [1]}], "cpus": [{"nodes": [1, 2]}]}, r"cpus\[0\]: node 1 is also on acc0"),
    ({"cpus": {"nodes": [1]}}, "cpus: expected a list of machines"),
    ({"cpus": [[1, 2]]}, r"cpus\[0\]: expected an object with a list 'nodes'"),
    ([1, 2], "expected a JSON object"),
])
def test_expert_split_errors(tmp_path, expert, fragment):
    problem = read_dnn_partitioning(_dnn(tmp_path))
    path = tmp_path / "expert.json"
    path.write_text(json.dumps(expert))
    with pytest.raises(WorkloadFormatError, match=fragment):
        read_expert_split(path, problem)


# -- MOIRAI CSV -------------------------------------------------------------------------------------------
def _moirai(tmp_path: Path, row: str) -> Path:
    text = MOIRAI.read_text(encoding="utf-8")
    assert TASK_2 in text
    path = tmp_path / "m.csv"
    path.write_text(text.replace(TASK_2, row))
    return path


@pytest.mark.parametrize(("row", "fragment"), [
    ('2,4,5,"4,5",1e400,6,8,0,1,3,1,0,2,3,2,0,2', "column 'p0': expected non-negative finite numbers"),
    ('2,4,5,"4,5",nan,6,8,0,1,3,1,0,2,3,2,0,2', "column 'p0'"),
    ('2,4,5,"4,5",7,6,8,0,inf,3,1,0,2,3,2,0,2', "column 'pc01': expected non-negative finite numbers, got 'inf'"),
    ('2,4,5,"4,5",7,6,8,0,1,3,1,0,2,3,2,0,1.7', "column 'mi': expected a non-negative whole number of bytes, got 1.7"),
    ('2,4,5,"4,5",7,6,8,0,1,3,1,0,2,3,2,0,1' + "0" * 400, "column 'mi'"),
    ('2,4,5,"4,5",inf,inf,Infinity,0,1,3,1,0,2,3,2,0,2', r"column 'p0': the task cannot run on any device \(every"),
])
def test_moirai_numbers(tmp_path, row, fragment):
    path = _moirai(tmp_path, row)
    with pytest.raises(WorkloadFormatError, match=fr"m\.csv: line 4 \(task 2\), {fragment}"):
        read_moirai_csv(path)


def test_moirai_written_inf_marks_a_device_the_task_cannot_use(tmp_path):
    p = read_moirai_csv(_moirai(tmp_path, '2,4,5,"4,5",inf,6,8,0,1,3,1,0,2,3,2,0,2'))
    assert dict(p.graph.record("2").times) == {"dev1": 6.0, "dev2": 8.0}


@pytest.mark.parametrize(("content", "fragment"), [
    (b"", "the file is empty"),
    (MOIRAI.read_bytes().replace(b",7,6,8,", b",7,\xe9,8,"), r"not UTF-8 text \(line 4"),
    ("task," + ",".join(f"p{i}" for i in range(100)) + "\n", r"header lacks column\(s\) \[.*\] and \d+ more"),
])
def test_moirai_unreadable_files(tmp_path, content, fragment):
    path = tmp_path / "m.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(WorkloadFormatError, match=fragment) as e:
        read_moirai_csv(path)
    assert str(path) in str(e.value) and len(str(e.value)) < 400


# -- OpGraph JSON ----------------------------------------------------------------------------------------
def _graph_json() -> dict:
    g = OpGraph()
    g.add_node("a", NodeRecord("a", times={"cpu": 1.0}, output_bytes=8, saved_bytes=12,
                               saved_parts={"x#0": 8, "a~": 4}, resident_parts={"x": 6, "y": 2}))
    g.add_node("b", NodeRecord("b", times={"cpu": 2.0}, transfer_time=0.5, reads=("x",)))
    g.add_edge("a", "b")
    return g.to_json()


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda d: d["nodes"][0]["times"].update(cpu=float("nan")), r"nodes\[0\]\.times\['cpu'\]: expected a non-negative finite"),
    (lambda d: d["nodes"][0].update(param_bytes=-1), r"nodes\[0\]\.param_bytes"),
    (lambda d: d["nodes"][0].update(output_bytes=1.5), r"nodes\[0\]\.output_bytes: expected a non-negative whole"),
    (lambda d: d["nodes"][1].update(transfer_time=float("inf")), r"nodes\[1\]\.transfer_time"),
    (lambda d: d["nodes"][0].update(backward="no"), r"nodes\[0\]\.backward: expected true or false"),
    (lambda d: d["nodes"][0]["saved_parts"].update({"x#0": -8}), r"nodes\[0\]\.saved_parts\['x#0'\]: expected a non-negative whole"),
    (lambda d: d["nodes"][0].update(saved_parts=[8]), r"nodes\[0\]\.saved_parts: expected an object of byte counts"),
    (lambda d: d["nodes"][0]["resident_parts"].update(y="2"), r"nodes\[0\]\.resident_parts\['y'\]: expected a non-negative whole"),
    (lambda d: d["nodes"][1].update(reads="x"), r"nodes\[1\]\.reads: expected a list of strings"),
    (lambda d: d["nodes"][0].update(colour="red"), r"nodes\[0\]: unknown field 'colour'"),
    (lambda d: d["nodes"][0].pop("name"), r"nodes\[0\]: missing field 'name'"),
    (lambda d: d["nodes"][0].pop("id"), r"nodes\[0\]: expected an object with an 'id'"),
    (lambda d: d["nodes"].append(dict(d["nodes"][0])), r"nodes\[2\]\.id: duplicate id 'a'"),
    (lambda d: d["edges"].append(["a", "z"]), r"edges\[1\]: 'z' is not the id of any node"),
    (lambda d: d["edges"].append(["a"]), r"edges\[1\]: expected a \[source, destination\] pair"),
    (lambda d: d["edges"].append(["b", "a"]), "not a DAG"),
    (lambda d: d.update(nodes={}), "field 'nodes' must be a list"),
])
def test_opgraph_from_json_checks_every_field(tmp_path, mutate, fragment):
    data = _graph_json()
    mutate(data)
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=fragment) as e:
        OpGraph.load(path)
    assert str(path) in str(e.value)


def test_opgraph_round_trip_is_unchanged(tmp_path):
    g = OpGraph.from_json(_graph_json())
    g.save(tmp_path / "g.json")
    assert OpGraph.load(tmp_path / "g.json") == g
    assert g.record("a").saved_parts == {"x#0": 8, "a~": 4} and "saved_parts" not in g.record("b").to_dict()
    assert g.record("a").resident_parts == {"x": 6, "y": 2} and g.record("b").reads == ("x",)
    assert "reads" not in g.record("a").to_dict() and "resident_parts" not in g.record("b").to_dict()


# -- plan files -------------------------------------------------------------------------------------------
def _plan_json() -> dict:
    g = OpGraph()
    for v, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        g.add_node(v, NodeRecord(v, times={"accel": t, "cpu": 4 * t}, transfer_time=0.25))
    g.add_edge("a", "b")
    g.add_edge("b", "c")
    cluster = Cluster((Device("acc0", "meta", "accel"), Device("acc1", "meta", "accel")))
    return dp.solve(Problem(g, cluster)).to_json()


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda d: d.update(objective=float("nan")), "objective: expected a non-negative finite number, got nan"),
    (lambda d: d.update(objective=float("inf"), gap=1.0), "objective"),
    (lambda d: d.update(objective=-1.0), "objective"),
    (lambda d: d.update(lower_bound=float("nan")), "lower_bound"),
    (lambda d: d.update(lower_bound=-0.5), "lower_bound"),
    (lambda d: d.update(lower_bound=d["objective"] * 2), "exceeds the objective"),
    (lambda d: d.update(gap=0.5), "gap 0.5 is not"),
    (lambda d: d.update(seconds=float("nan")), "seconds"),
    (lambda d: d.update(stages=[]), "stages: expected a non-empty list"),
    (lambda d: d["stages"].append({"device": "acc1", "nodes": []}), r"stages\[\d\]\.nodes: expected a non-empty list"),
    (lambda d: d["stages"].append({"device": "acc1", "nodes": ["a"]}), r"stages\[\d\]\.nodes\[0\]: node 'a' is also in stages\[0\]"),
    (lambda d: d["stages"][0].update(nodes=[1]), r"stages\[0\]\.nodes\[0\]: expected a non-empty string"),
    (lambda d: d["stages"][0].pop("device"), r"stages\[0\]: expected an object with 'device' and 'nodes'"),
    (lambda d: d.update(status="great"), "status: expected one of"),
    (lambda d: d.update(solver=""), "solver"),
    (lambda d: d["assignment"].update(a="acc9"), "assignment: does not match the stages"),
    (lambda d: d["costs"][0].update(compute=float("nan")), r"costs\[0\]\.compute"),
    (lambda d: d["costs"][0].update(memory=1.5), r"costs\[0\]\.memory"),
    (lambda d: d.pop("objective"), "missing field 'objective'"),
    (lambda d: d.update(meta=[]), "meta: expected an object"),
    # found by fuzzing: a degree of 0 asked torchrun for 0 processes, a partial cost table was shown
    # against other devices' stages, and a malformed meta.call made `show` fail with a traceback
    (lambda d: d["stages"][0].update(data_parallel=0), r"stages\[0\]\.data_parallel"),
    (lambda d: d["costs"].pop(), "costs: no row for device"),
    (lambda d: d.update(meta={"call": "fast"}), "meta.call: expected an object"),
    (lambda d: d.update(meta={"call": {"seconds": 1.0}}), "meta.call: missing field"),
    (lambda d: d.update(meta={"single_device": {"device": "acc0"}}), "meta.single_device"),
    (lambda d: d.update(meta={"single_device": {"device": "acc0", "seconds": 1.0, "plan_seconds": 0.5,
                                                "margin": 5.0}}), "margin: expected a fraction below 1"),
    (lambda d: d.update(meta={"single_device": {"device": "acc0", "seconds": 1.0, "plan_seconds": 0.5,
                                                "margin": -0.1}}), "margin"),
    # found by fuzzing: place(plan=) said "place it with mode='banana'", and ran an unknown schedule as 1F1B
    (lambda d: d["meta"].update(mode="banana"),
     r"meta\.mode: expected one of \['inference', 'training'\], got 'banana'"),
    (lambda d: d["meta"].update(objective=7), r"meta\.objective: expected one of \['throughput', 'latency'\], got 7"),
    (lambda d: d["meta"].update(schedule=None), r"meta\.schedule: expected one of \['gpipe', '1f1b'\], got None"),
])
def test_plan_files_are_checked_on_load(tmp_path, mutate, fragment):
    data = _plan_json()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=fragment) as e:
        Plan.load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("data", [[], [_graph_json()], "plan", None, 3])
def test_a_file_that_is_not_an_object_is_neither_plan_nor_graph(data):
    with pytest.raises(WorkloadFormatError, match=r"^p\.json: not a plan file: expected 'format': 'torchplace\.plan/1', got a JSON"):
        Plan.from_json(data, "p.json")
    with pytest.raises(WorkloadFormatError, match=r"^g\.json: not an OpGraph file: expected 'format'"):
        OpGraph.from_json(data, "g.json")


def test_a_valid_plan_file_loads_unchanged(tmp_path):
    data = _plan_json()
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "plan.json").to_json() == data


# -- atomic writes -----------------------------------------------------------------------------------------
def _savers() -> dict:
    plan = Plan.from_json(_plan_json())
    graph = OpGraph.from_json(_graph_json())
    cluster = Cluster((Device("a", "cpu", "cpu"),))
    return {"plan": plan.save, "graph": graph.save, "cluster": cluster.save, "cluster-yaml": cluster.save}


@pytest.mark.parametrize("kind", ["plan", "graph", "cluster", "cluster-yaml"])
def test_an_interrupted_save_leaves_the_old_file(tmp_path, monkeypatch, kind):
    if kind == "cluster-yaml":
        pytest.importorskip("yaml")
    path = tmp_path / ("out.yaml" if kind == "cluster-yaml" else "out.json")
    path.write_text("old")
    save = _savers()[kind]

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save(path)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    monkeypatch.undo()
    save(path)
    assert path.read_text() != "old" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_write_json_keeps_the_old_file_when_data_is_not_json(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        files.write_json(path, {"x": object()})
    assert path.read_text() == "old" and len(list(tmp_path.iterdir())) == 1


def test_written_files_have_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        files.write_json(tmp_path / "out.json", [1])
    finally:
        os.umask(old)
    assert (tmp_path / "out.json").stat().st_mode & 0o777 == 0o644


def test_writing_to_a_directory_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="is a directory; give a file name"):
        files.write_json(tmp_path, [1])


def test_writing_into_a_missing_directory_is_a_usage_error(tmp_path):
    """It raised FileNotFoundError naming a temporary file the user never gave (found by fuzzing)."""
    with pytest.raises(UsageError, match="does not exist; create it first"):
        files.write_text(tmp_path / "missing" / "plan.json", "{}")


def test_writing_through_a_symbolic_link_replaces_the_file_it_names_and_keeps_the_link(tmp_path):
    """The rename put a regular file where the link was, and left the linked file as it was (found by fuzzing)."""
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    files.write_json(tmp_path / "link.json", [1])
    assert (tmp_path / "link.json").is_symlink() and json.loads((tmp_path / "real.json").read_text()) == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_target_that_is_no_regular_file_is_written_in_place(tmp_path):
    """A FIFO (as /dev/stdout, or as root /dev/null) was replaced by a regular file and its reader
    got nothing (found by fuzzing)."""
    import threading

    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    files.write_json(fifo, [1])
    reader.join(5)
    assert got == ["[\n 1\n]\n"] and not fifo.is_file()
