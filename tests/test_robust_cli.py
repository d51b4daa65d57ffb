"""Issue 9, item 8: the CLI never shows a traceback for a user error.

Every case ends with exactly one line on stderr starting ``torchplace: error:``, exit status 2,
and nothing on stdout (so no plan, and never "proven optimal", is printed for a bad plan file).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchplace.cli import main

from .conftest import DNN, WORKLOADS

BERT24 = str(DNN / "LayerGraphs/bert24_inference.json")


def _files(tmp: Path) -> dict[str, str]:
    """Bad inputs, written to ``tmp``; keys are used in the cases below."""
    plan = {"format": "torchplace.plan/1", "objective": 1.0, "lower_bound": 1.0, "solver": "dp", "seconds": 0.1,
            "status": "optimal", "stages": [{"device": "acc0", "nodes": ["1"]}]}
    texts = {
        "list.json": "[1, 2]",
        "deep.json": "[" * 100_000 + "]" * 100_000,
        "empty.json": "",
        "nan-plan.json": json.dumps({**plan, "objective": float("nan")}),
        "no-stages.json": json.dumps({**plan, "stages": []}),
        "twice.json": json.dumps({**plan, "stages": [{"device": "a", "nodes": ["1"]}, {"device": "b", "nodes": ["1"]}]}),
        "fraction.json": json.dumps({"maxSizePerFPGA": 1, "maxFPGAs": 2.7, "maxCPUs": 1, "nodes": [], "edges": []}),
        "config.json": json.dumps({"model_type": "gpt2", "n_layer": 1}),
        "cluster.json": json.dumps({"format": "torchplace.cluster/1", "devices": [{"name": "cpu", "kind": "cpu"}]}),
    }
    for name, text in texts.items():
        (tmp / name).write_text(text)
    moirai = (WORKLOADS / "moirai" / "example-1__instances.csv").read_bytes()
    (tmp / "latin.csv").write_bytes(moirai.replace(b",7,6,8,", b",7,\xe9,8,"))
    (tmp / "dir").mkdir()
    return {name: str(tmp / name) for name in [*texts, "latin.csv", "dir"]}


def _sub(text: str, paths: dict[str, str]) -> str:
    """``text`` with each ``{name}`` replaced by the path of that file."""
    for name, path in paths.items():
        text = text.replace("{" + name + "}", path)
    return text


CASES = [
    (["solve", BERT24, "--time-limit", "nan"], "argument --time-limit: expected a positive finite number of seconds, got nan"),
    (["solve", BERT24, "--time-limit", "-1"], "argument --time-limit: expected a positive"),
    (["solve", BERT24, "--time-limit", "0"], "argument --time-limit"),
    (["solve", BERT24, "--time-limit", "inf"], "argument --time-limit"),
    (["solve", BERT24, "--time-limit", "soon"], "argument --time-limit: expected a positive number of seconds, got 'soon'"),
    (["solve", BERT24, "--ideal-limit", "-5"], "argument --ideal-limit: expected a positive whole number, got -5"),
    (["solve", BERT24, "--ideal-limit", "2.5"], "argument --ideal-limit: expected a positive whole number, got 2.5"),
    (["plan", "mlp", "--batch", "-2"], "argument --batch: expected a positive whole number, got -2"),
    (["plan", "mlp", "--microbatches", "0"], "argument --microbatches: expected a positive whole number, got 0"),
    # a learning rate beyond float32 was SGD's RuntimeError traceback on every rank (found by fuzzing)
    (["run", "{nan-plan.json}", "--model", "mlp", "--lr", "1e300"], "argument --lr: expected a learning rate of at most"),
    # a batch torch cannot size was a TypeError traceback (found by fuzzing)
    (["plan", "mlp", "--batch", "1e30"], "the example inputs of 'mlp' cannot be made"),
    (["plan", "mlp", "--microbatches", "2.5"], "argument --microbatches"),
    (["plan", "mlp", "--microbatches", "1" + "0" * 5000], "argument --microbatches"),
    (["plan", "mlp", "--devices", "potato"], "unknown device 'potato' (not a torch device string)"),
    (["plan", "mlp", "--devices", "cpu:0", "cuda:99"], "unknown device 'cuda:99'"),
    (["solve", "{dir}"], "argument workload: '{dir}' is a directory; give a file"),
    (["solve", BERT24, "-o", "{dir}"], "argument -o/--output: '{dir}' is a directory"),
    (["solve", BERT24, "-o", "{dir}/missing/plan.json"], "does not exist"),
    (["solve", "{dir}/missing.json"], "no such file"),
    (["show", "{list.json}"], "not a plan file: expected 'format': 'torchplace.plan/1', got a JSON list"),
    (["show", "{deep.json}"], "nested too deeply"),
    (["solve", "{deep.json}"], "nested too deeply"),
    (["solve", "{latin.csv}"], "latin.csv: not UTF-8 text (line 4"),
    (["solve", "{empty.json}"], "empty.json: the file is empty"),
    (["show", "{empty.json}"], "empty.json: the file is empty"),
    (["show", "{nan-plan.json}"], "nan-plan.json: objective: expected a non-negative finite number, got nan"),
    (["show", "{no-stages.json}"], "no-stages.json: stages: expected a non-empty list"),
    (["show", "{twice.json}"], "stages[1].nodes[0]: node '1' is also in stages[0]"),
    (["solve", "{fraction.json}"], "top level.maxFPGAs: expected a non-negative whole number, got 2.7"),
    # a file of another kind where a workload, plan or cluster belongs was "field 'nodes' must be a list"
    # or "unknown field 'assignment'" (found by fuzzing)
    (["solve", "{nan-plan.json}"], "nan-plan.json is a torchplace plan, not a dnn-partitioning workload"),
    (["solve", "{config.json}"], "config.json is a Hugging Face config.json, not a dnn-partitioning workload"),
    (["solve", "{cluster.json}"], "cluster.json is a torchplace cluster file, not a dnn-partitioning workload"),
    (["show", "{config.json}"], "not a plan file: expected 'format': 'torchplace.plan/1', got None (the file is a "
                                "Hugging Face config.json)"),
    (["solve", BERT24, "--method", "simplex"], "argument --method: invalid choice: 'simplex'"),
    (["solve", str(WORKLOADS / "piper" / "bert32a100.json"), "--memory-gb", "1e300"],  # was Parallel.memory_bytes ... inf
     "--memory-gb 1e+300: too large to count in bytes"),
    (["solve", BERT24, "--method", "dp", "--bounds", "mip"], "--bounds mip applies with --method auto only"),
    (["solve", BERT24, "--method", "moirai"], "ask for objective='latency' (command line: --objective latency)"),
    (["solve"], "the following arguments are required: workload"),
    ([], "the following arguments are required: command"),
]


@pytest.mark.parametrize(("argv", "fragment"), CASES, ids=[" ".join(a)[-40:] or "no-args" for a, _ in CASES])
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, workloads_dir, argv, fragment):
    paths = _files(tmp_path)
    code = main([_sub(a, paths) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("torchplace: error:") and err.endswith("\n") and err.count("\n") == 1, err
    assert _sub(fragment, paths) in err
    assert "optimal" not in out and "Traceback" not in err


def test_help_still_exits_0(capsys):
    assert main(["solve", "--help"]) == 0
    assert "--time-limit" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["solve", "plan", "methods", "run", "show", "report", "demo"])
def test_every_commands_help_prints(capsys, command):
    """argparse expands %-formats in help texts: a bare '%' breaks that command's --help."""
    assert main([command, "--help"]) == 0
    assert "usage: torchplace " + command in capsys.readouterr().out


def test_valid_options_still_work(tmp_path, capsys, workloads_dir):
    path = tmp_path / "plan.json"
    assert main(["solve", BERT24, "--method", "dp", "--time-limit", "30", "--ideal-limit", "1000.0", "-o", str(path)]) == 0
    assert "proven optimal" in capsys.readouterr().out
    assert main(["show", str(path)]) == 0 and "proven optimal" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left behind


def test_no_traceback_from_python_dash_m(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    r = subprocess.run([sys.executable, "-m", "torchplace", "show", str(deep)], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"torchplace: error: {deep}: JSON nested too deeply to read (arrays or objects inside each other)\n"


def test_output_that_is_an_input_file_is_refused_and_the_input_kept(tmp_path, capsys):
    """`solve W -o W` wrote the plan over the workload, `report P -o P` the HTML over the plan (found by fuzzing)."""
    import shutil

    workload = tmp_path / "w.json"
    shutil.copy(BERT24, workload)
    original = workload.read_text()
    (tmp_path / "link.json").symlink_to("w.json")
    for target in (str(workload), str(tmp_path / "link.json")):
        assert main(["solve", str(workload), "-o", target]) == 2
        assert "is the workload file this command reads" in capsys.readouterr().err
    assert workload.read_text() == original
    plan = tmp_path / "plan.json"
    assert main(["solve", str(workload), "-o", str(plan)]) == 0
    saved = plan.read_text()
    assert main(["report", str(plan), "-o", str(plan)]) == 2
    assert "is the plan file this command reads" in capsys.readouterr().err
    assert plan.read_text() == saved
