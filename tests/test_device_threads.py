"""Devices own their cores: each CPU device's worker computes with its own intra-op threads."""
from __future__ import annotations

import dataclasses
import json
from functools import partial

import pytest
import torch
from torch import fx

import torchplace
from torchplace import machine
from torchplace.clusterfile import load_cluster
from torchplace.devices import Cluster, Device, check_attached, kind_threads, make_cluster
from torchplace.errors import UsageError, WorkloadFormatError
from torchplace.machine import intra_op_threads
from torchplace.models import MLP
from torchplace.runtime import LatencyExecutor, PipelineExecutor
from torchplace.runtime.graph_io import GraphIO
from torchplace.runtime.split import compute_nodes, split_stages


def test_the_cores_are_split_among_the_cpu_devices(monkeypatch) -> None:
    monkeypatch.setattr(machine, "cpu_cores", lambda: 8)
    assert [d.threads for d in make_cluster(["cpu:0", "cpu:1"]).devices] == [None, None]  # off by default
    share = partial(make_cluster, share_cores=True)
    assert [d.threads for d in share(["cpu:0", "cpu:1"]).devices] == [4, 4]
    assert [d.threads for d in share(["cpu:0", "cpu:1", "cpu:2"]).devices] == [2, 2, 2]
    assert [d.threads for d in share(["cpu"]).devices] == [8]
    monkeypatch.setattr(machine, "cpu_cores", lambda: 2)
    assert [d.threads for d in share(["cpu:0", "cpu:1", "cpu:2"]).devices] == [1, 1, 1]  # at least one
    mine = Device("cpu:9", "cpu", "cpu", None, threads=2)
    cluster = share([mine, "cpu:0"])
    assert [d.threads for d in cluster.devices] == [2, 2]  # a Device keeps its own; strings share the rest
    assert kind_threads(cluster) == {"cpu": 2}


def test_bad_thread_counts_are_refused(tmp_path) -> None:
    with pytest.raises(UsageError, match="threads must be a positive whole number"):
        make_cluster([Device("cpu:0", "cpu", "cpu", None, threads=0)])
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": "torchplace.cluster/1", "devices": [{"name": "c0", "kind": "cpu", "torch_device": "cpu", "threads": 3}]}))
    assert load_cluster(path).devices[0].threads == 3
    path.write_text(json.dumps({"format": "torchplace.cluster/1", "devices": [{"name": "c0", "kind": "cpu", "threads": "many"}]}))
    with pytest.raises(WorkloadFormatError, match="threads"):
        load_cluster(path)


@pytest.mark.parametrize("devices", [
    Cluster((Device("cpu:0", "cpu", "cpu"), Device("cpu:1", "cpu", "cpu"))),
    [Device("cpu:0", "cpu", "cpu"), Device("cpu:1", "cpu", "cpu")],
])
def test_share_cores_with_only_device_objects_is_refused(devices) -> None:
    model = MLP(8, 8, 2)
    with pytest.raises(UsageError, match=r"share_cores=True .* Device objects.*threads=n"):  # it did nothing
        torchplace.place(model, devices, (torch.randn(2, 8),), objective="latency", share_cores=True, progress=False)


def test_more_threads_than_cores_are_refused_for_devices_run_here(monkeypatch) -> None:
    monkeypatch.setattr(machine, "cpu_cores", lambda: 4)
    many = Device("cpu:0", "cpu", "cpu", None, threads=5)
    with pytest.raises(UsageError, match=r"threads=5, but this process may run on 4 core\(s\).*at most 4"):
        make_cluster([many])
    with pytest.raises(UsageError, match="threads=5"):
        check_attached(Cluster((many,)))
    Cluster((dataclasses.replace(many, torch_device="meta"),))  # a plan for other hardware may have them


def _record_threads(stages, seen: dict[int, int]) -> None:
    """Record, per stage, the intra-op threads its forward runs with (executors call ``forward``)."""
    for stage in stages:
        def forward(*args, _stage=stage, _forward=stage.forward):
            seen[_stage.index] = torch.get_num_threads()
            return _forward(*args)
        stage.forward = forward


def _recording(gm: fx.GraphModule, seen: dict[int, int]):
    nodes = compute_nodes(gm.graph)
    stages = split_stages(gm, {n.name: 2 * i // len(nodes) for i, n in enumerate(nodes)}, 2)
    _record_threads(stages, seen)
    return stages


@pytest.mark.parametrize("executor", ["pipeline", "latency"])
def test_each_worker_computes_with_its_devices_threads(executor) -> None:
    gm = fx.symbolic_trace(MLP())
    seen: dict[int, int] = {}
    stages = _recording(gm, seen)
    before = torch.get_num_threads()
    if executor == "pipeline":
        ex = PipelineExecutor(stages, ["cpu", "cpu"], ["a", "b"], GraphIO(gm), stage_threads=[1, 3])
        ex.run((torch.randn(4, 32),), {}, 2)
    else:
        ex = LatencyExecutor(stages, ["cpu", "cpu"], ["a", "b"], GraphIO(gm), stage_threads=[1, 3])
        ex.run((torch.randn(4, 32),), {})
    assert seen == {0: 1, 1: 3}
    assert torch.get_num_threads() == before  # the caller's setting is its own again


def test_place_runs_logical_cpus_on_their_share_of_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(machine, "cpu_cores", lambda: 4)
    model = MLP()
    x = torch.randn(8, 32)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, share_cores=True, progress=False,
                              repeats=1, warmup=0)
    seen: dict[int, int] = {}
    _record_threads(placed.stage_modules, seen)
    with torch.no_grad():
        out = placed(x)
        with intra_op_threads(2):
            reference = model(x)
    assert set(seen.values()) == {2}
    assert torch.equal(out, reference)  # bitwise: the model run with the same threads


def test_training_workers_and_profiling_use_the_devices_threads(monkeypatch) -> None:
    import importlib

    profile_module = importlib.import_module("torchplace.profiling.profile")

    monkeypatch.setattr(machine, "cpu_cores", lambda: 4)
    measured_with: list[int] = []
    for name in ("_measure", "_measure_shared"):  # exhaustive and by-signature timing
        def recording(*args, _measure=getattr(profile_module, name), **kwargs):
            measured_with.append(torch.get_num_threads())
            return _measure(*args, **kwargs)

        monkeypatch.setattr(profile_module, name, recording)
    model = MLP()
    x, y = torch.randn(8, 32), torch.randn(8, 10)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=2, share_cores=True,
                              progress=False, repeats=1, warmup=0)
    # the forward pass (of the batch, then of one micro-batch for the call's prediction) was timed
    # with a device's share of the cores
    assert measured_with == [2, 2]
    seen: dict[int, int] = {}
    _record_threads(placed.stage_modules, seen)
    placed.step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    assert set(seen.values()) == {2}
