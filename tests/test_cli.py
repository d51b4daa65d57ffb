"""The torchplace command."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from torchplace.cli import main

from .conftest import DNN

BERT24 = str(DNN / "LayerGraphs/bert24_inference.json")


def test_solve_json(capsys, workloads_dir):
    assert main(["solve", BERT24, "--method", "dp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == pytest.approx(17.7899, rel=1e-4)
    assert out["lower_bound"] <= out["objective"]
    assert out["status"] == "optimal"
    assert out["seconds"] >= 0
    assert len(out["assignment"]) == 32 and set(out["assignment"].values()) <= {f"acc{i}" for i in range(6)} | {"cpu0"}


def test_solve_table_save_and_show(tmp_path, capsys, workloads_dir):
    path = tmp_path / "plan.json"
    assert main(["solve", BERT24, "-o", str(path)]) == 0
    table = capsys.readouterr().out
    assert "stage" in table and "acc0" in table
    assert main(["show", str(path)]) == 0
    assert capsys.readouterr().out == table


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"nodes": [], "edges": [], "maxFPGAs": "x"}')
    assert main(["solve", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchplace: error:") and "maxFPGAs" in err


def test_plan_example_model(capsys):
    assert main(["plan", "mlp", "--devices", "cpu:0", "cpu:1", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "Plan by dp" in out and "device_map" in out


def test_torchplaces_warnings_print_on_one_line(capsys, monkeypatch):
    """A PlacementWarning printed as `<frozen runpy>:88: PlacementWarning: ...` (its Python location)
    under `python -m torchplace`; the command line prints `torchplace: warning: ...`, and other
    warnings as Python does."""
    import warnings

    import torchplace.cli
    from torchplace.callmodel import KEEP_SPLIT
    from torchplace.errors import PlacementWarning, warn_caller

    def plan(args):
        warn_caller(f"one device is faster; {KEEP_SPLIT} keeps the split")
        warnings.warn("something else", UserWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(torchplace.cli, "_plan", plan)
    with pytest.warns(UserWarning, match="something else") as seen:  # shown as Python shows it
        assert main(["plan", "mlp"]) == 0
    assert [w.category for w in seen] == [UserWarning]
    err = capsys.readouterr().err
    assert err == "torchplace: warning: one device is faster; allow_single_device=False (torchplace plan: " \
                  "--keep-split) keeps the split\n"
    assert PlacementWarning.__name__ not in err


def test_plan_for_latency_runs_each_call_whole(capsys):
    """`plan MODEL --objective latency` passed the pipeline's default of 4 micro-batches, which
    place() now refuses for latency: the default is left to place(), and a given count refused."""
    assert main(["plan", "mlp", "--batch", "4", "--objective", "latency"]) == 0
    assert "lower bound" in capsys.readouterr().out
    assert main(["plan", "mlp", "--batch", "4", "--objective", "latency", "--microbatches", "2"]) == 2
    assert "objective='latency' runs each call whole" in capsys.readouterr().err


def test_python_dash_m(workloads_dir):
    r = subprocess.run([sys.executable, "-m", "torchplace", "solve", BERT24, "--json"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["objective"] == pytest.approx(17.7899, rel=1e-4)


def test_moirai_example_is_proven_optimal_from_the_command_line(capsys, workloads_dir):
    csv = str(workloads_dir / "moirai" / "example-1__instances.csv")
    assert main(["solve", csv, "--method", "moirai", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["objective"], out["lower_bound"], out["status"]) == (30.0, 30.0, "optimal")


def test_methods_lists_every_solver(capsys):
    from torchplace.solvers import METHODS

    assert main(["methods"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert listed == {"auto", *METHODS}


def test_an_option_the_method_does_not_take_is_an_error(capsys, workloads_dir):
    assert main(["solve", BERT24, "--method", "slicegraph", "--ideal-limit", "10"]) == 2
    err = capsys.readouterr().err
    assert "'slicegraph' does not take ['ideal_limit']" in err and "random_orders" in err


def test_throughput_options_on_a_latency_workload_are_errors(capsys, workloads_dir):
    """--ideal-limit and --bounds mip shape the throughput DP and Archer's bounds; on a latency
    workload auto dropped them silently."""
    from torchplace.errors import UsageError
    from torchplace.solvers import solve
    from torchplace.workloads import read_moirai_csv

    csv = str(workloads_dir / "moirai" / "example-1__instances.csv")
    for flags, named in ((["--ideal-limit", "10"], "--ideal-limit"), (["--bounds", "mip"], "--bounds mip"),
                         (["--method", "m-etf", "--ideal-limit", "10"], "--ideal-limit")):
        assert main(["solve", csv, *flags]) == 2
        assert f"on a latency workload {named} would be ignored" in capsys.readouterr().err
    problem = read_moirai_csv(csv)
    for options in ({"ideal_limit": 10}, {"bounds": "mip"}):
        with pytest.raises(UsageError, match="would be ignored: auto solves a latency problem"):
            solve(problem, **options)
    # contiguous=False, which solve() applies to the problem (a latency one is non-contiguous), is not
    # ignored: it was refused as ignored, where it solved before
    assert solve(problem, contiguous=False).objective == solve(problem).objective


_LIGHT_CLI = """
import json, sys
from torchplace.cli import main
workload, plan = sys.argv[1], sys.argv[2]
for argv in (["solve", workload, "--method", "dp", "--json"], ["solve", workload, "-o", plan],
             ["show", plan], ["methods"]):
    assert main(argv) == 0, argv
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "pyomo"))
print(json.dumps(heavy))
"""


def test_solve_show_and_methods_do_not_import_torch(tmp_path):
    """`torchplace solve` / `show` / `methods` start in well under a second: no torch, transformers
    or Pyomo (issue 16, item 3). Run in a fresh process, since this one has imported torch."""
    workload = tmp_path / "w.json"
    nodes = [{"id": i, "supportedOnFpga": 1, "cpuLatency": 5.0, "fpgaLatency": 1.0 + i, "isBackwardNode": 0,
              "size": 1} for i in range(4)]
    edges = [{"sourceId": i, "destId": i + 1, "cost": 0.5} for i in range(3)]
    workload.write_text(json.dumps({"maxSizePerFPGA": 10, "maxFPGAs": 2, "maxCPUs": 1, "nodes": nodes, "edges": edges}))
    r = subprocess.run([sys.executable, "-c", _LIGHT_CLI, str(workload), str(tmp_path / "plan.json")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_solvers_and_readers_import_light():
    code = ("import sys, torchplace.solvers, torchplace.workloads, torchplace.solvers.dp, torchplace.model_names; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'pyomo')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def test_model_names_match_the_builders():
    from torchplace import model_names, models

    assert models.NAMES == model_names.NAMES == tuple(models._BUILDERS)


def test_accelerators_and_cpus_override_the_file(capsys, workloads_dir):
    """--accelerators K --cpus L solve the file's graph on k accelerators and l CPUs (issue 16 item 5)."""
    from torchplace.devices import Cluster, Device
    from torchplace.solvers import dp
    from torchplace.workloads import read_dnn_partitioning

    assert main(["solve", BERT24, "--method", "dp", "--json", "--accelerators", "2", "--cpus", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["assignment"].values()) <= {"acc0", "acc1"}
    base = read_dnn_partitioning(BERT24)
    mem = base.cluster.devices[0].memory_bytes
    manual = dataclasses.replace(base, cluster=Cluster((Device("acc0", "meta", "accel", mem),
                                                        Device("acc1", "meta", "accel", mem))))
    assert out["objective"] == pytest.approx(dp.solve(manual).objective, rel=1e-12)
    assert out["objective"] > 17.7899  # fewer accelerators than the file's 6: a worse optimum
    assert read_dnn_partitioning(BERT24, accelerators=2, cpus=0).cluster == manual.cluster


@pytest.mark.parametrize("argv, message", [
    (["--accelerators", "0", "--cpus", "0"], "0 accelerators + 0 CPUs"),
    (["--accelerators", "-1"], "expected a whole number >= 0, got '-1'"),
    (["--cpus", "1.5"], "expected a whole number >= 0"),
])
def test_bad_device_counts_are_one_line_errors(capsys, workloads_dir, argv, message):
    assert main(["solve", BERT24, "--method", "dp", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchplace: error:") and message in err and err.count("\n") == 1


def test_run_compares_every_output_of_a_model_output_object_with_the_joined_micro_batches():
    """`torchplace run` on GPT-2 failed after running: its output is a model-output object, and the
    check called `out.tensor_split`."""
    import torch

    from torchplace.cli import _equals_joined

    logits, hidden = torch.randn(4, 3), torch.randn(4, 2)
    parts = [{"logits": logits[:2], "hidden": hidden[:2]}, {"logits": logits[2:], "hidden": hidden[2:]}]
    assert _equals_joined({"logits": logits, "hidden": hidden}, parts)
    assert _equals_joined(logits, [logits[:1], logits[1:]])
    changed = hidden.clone()
    changed[3, 1] += 1e-6
    assert not _equals_joined({"logits": logits, "hidden": changed}, parts)
    assert not _equals_joined({"logits": logits}, parts)  # an output missing


def test_plan_options_of_the_other_path_are_refused_not_ignored(capsys, tmp_path):
    """plan MODEL --max-memory ... planned without the cap, and --hf ignored --devices, silently
    (found by fuzzing)."""
    assert main(["plan", "mlp", "--max-memory", "cpu=1KiB"]) == 2
    assert "--max-memory applies with --hf only" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text("{}")
    assert main(["plan", "--hf", str(config), "--devices", "cpu:0", "cpu:1", "cpu:2", "--mode", "training"]) == 2
    assert "--devices, --mode apply to a built-in MODEL, not with --hf" in capsys.readouterr().err


def test_output_piped_into_a_reader_that_leaves_ends_quietly(workloads_dir):
    """`torchplace solve W --json | head -1` printed 'error: [Errno 32] Broken pipe' (found by fuzzing)."""
    process = subprocess.Popen([sys.executable, "-m", "torchplace", "solve", BERT24, "--method", "dp", "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # the reader left before the solve ended
    _, err = process.communicate(timeout=120)
    assert b"error" not in err and process.returncode == 141


def test_options_a_piper_solve_would_ignore_are_refused(capsys, workloads_dir):
    """solve PIPER.json --objective latency / --noncontiguous / --bounds mip, piper-equi --knapsack,
    and plan MODEL --parallelism piper --noncontiguous / --objective latency / --keep-split printed
    a Piper plan as if asked for nothing (found by fuzzing)."""
    bert = str(workloads_dir / "piper" / "bert32a100.json")
    for extra, words in ((["--objective", "latency"], "--objective latency"), (["--noncontiguous"], "--noncontiguous"),
                         (["--bounds", "mip"], "--bounds mip"),
                         (["--method", "piper-equi", "--knapsack", "exact"], "--knapsack")):
        assert main(["solve", bert, "--devices", "4", *extra]) == 2
        assert words in capsys.readouterr().err
    plan = ["plan", "mlp", "--mode", "training", "--parallelism", "piper", "--devices", "cpu:0", "cpu:1",
            "--microbatches", "2", "--batch", "4"]
    for extra, words in ((["--noncontiguous"], "contiguous"), (["--objective", "latency"], "throughput"),
                         (["--keep-split"], "--keep-split")):
        assert main([*plan, *extra]) == 2
        assert words in capsys.readouterr().err
