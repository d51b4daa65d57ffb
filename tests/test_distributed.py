"""torchplace plans run by torch.distributed.pipelining: one process per device, gloo over 127.0.0.1.

The multi-process tests start one process per rank as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT on a free port) running tests/dist_worker.py; every wait is bounded
(the process group's timeout, subprocess timeouts). Each rank checks its own part against the
single-process model (inference outputs bitwise; parameters after 5 SGD steps allclose).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchplace.errors import DistributedError, InvalidPlanError, UnsupportedError, UsageError
from torchplace.plan import Plan, Stage
from torchplace.runtime.dist_faults import GRACE_S, SETTLE_S
from torchplace.runtime.distributed import EngineSlot, EngineStage, engine_layout, live_values
from torchplace.runtime.split import split_stages

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
sys.path.insert(0, str(ROOT / "tests"))
import dist_worker  # noqa: E402

LAUNCH_S = 240  # the longest a whole launch may take on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenarios: str, world: int, tmp: Path, plans: list[str] = (), timeout_s: float = 30,
           env: dict[str, str] | None = None) -> list[tuple[int, dict, str]]:
    """Start ``world`` ranks of dist_worker.py; return (exit status, results, stderr) per rank; the
    time rank 0 ended is in ``results["ended"]``."""
    port = free_port()
    procs = []
    for rank in range(world):
        child = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                     PYTHONPATH=str(ROOT), TP_TIMEOUT=str(timeout_s), **(env or {}))
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenarios, str(tmp), *plans], env=child,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = []
    try:
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=LAUNCH_S)
            ended = time.time()
            path = tmp / f"rank{rank}.json"
            out.append((p.returncode, json.loads(path.read_text()) if path.exists() else {}, err))
            out[-1][1]["ended"] = ended
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return out


# -- the layout, without processes ---------------------------------------------------------------------
@pytest.mark.parametrize("ranks, world, expected", [
    ([0, 1], 2, [(0, (0,)), (1, (1,))]),
    ([0, 1, 0, 1], 2, [(0, (0,)), (1, (1,)), (0, (2,)), (1, (3,))]),
    ([0, 1, 1, 0], 2, [(0, (0,)), (1, (1, 2)), (0, (3,)), (1, ())]),
    ([1, 0], 2, [(0, ()), (1, (0,)), (0, (1,)), (1, ())]),
    ([0, 0], 2, [(0, (0, 1)), (1, ())]),
    ([0, 2, 1], 3, [(0, (0,)), (1, ()), (2, (1,)), (0, ()), (1, (2,)), (2, ())]),
])
def test_engine_layout_loops_over_ranks_with_pass_through_stages(ranks, world, expected):
    layout = engine_layout(ranks, world)
    assert layout == expected
    assert all(r == k % world for k, (r, _) in enumerate(layout))
    assert [p for _, pieces in layout for p in pieces] == list(range(len(ranks)))


def test_values_that_skip_stages_cross_every_boundary_between():
    model, x, _ = dist_worker.build()
    gm = torch.fx.symbolic_trace(model)
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_module" or n.op == "call_function"]
    stage_of = {n: (0 if i < 2 else 1 if i < len(nodes) - 3 else 2) for i, n in enumerate(nodes)}
    stages = split_stages(gm, stage_of, 3)
    from torchplace.runtime import GraphIO

    io = GraphIO(gm)
    slots = live_values(engine_layout([0, 1, 0], 2), stages, io.placeholder_names, io.output_names,
                        [n.name for n in gm.graph.nodes])
    assert slots[0].inputs == ("x",)
    assert "relu" in slots[1].inputs and "relu" in slots[1].outputs  # the skip value rides through stage 1
    assert slots[-1].pieces == () and slots[-1].inputs == slots[-1].outputs == io.output_names
    flat: tuple = (x,)
    for slot in slots:
        flat = EngineStage(slot, [stages[p] for p in slot.pieces])(*flat)
    with torch.no_grad():
        assert torch.equal(flat[0], model(x))


def test_a_non_tensor_value_crossing_a_boundary_is_refused_by_name():
    slot = EngineSlot(0, 0, (), ("n",), ("n",))
    with pytest.raises(UnsupportedError, match="value 'n' leaves engine stage 0 but is a int"):
        EngineStage(slot, [])(3)


class ReadsItsBatch(nn.Module):
    """Its later operators read the batch size ``n`` and ``2 * n``, Python numbers of the exported
    graph; ``expand`` reads ``n`` beside a tensor without a batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 12), nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        h = torch.tanh(self.a(x))
        return self.b(h).reshape(n * 2, 6) + self.b.bias.new_ones(n * 2, 1), self.a(x).sum(0).expand(n, 12)


def _engine_stages_split_before(second: str, method: str = "export"):
    """ReadsItsBatch traced as place() traces it (exported, or with ``method``), split into two
    engine stages before compute node ``second``: the stages, the GraphIO, the slots and each
    value's example as torchplace.distributed.place passes them."""
    from torchplace.profiling import trace
    from torchplace.runtime import GraphIO
    from torchplace.runtime.dist_numbers import example_of
    from torchplace.runtime.split import compute_nodes

    traced = trace(ReadsItsBatch().eval(), (torch.randn(4, 8),), {}, method=method)
    names = [n.name for n in compute_nodes(traced.gm.graph)]
    stages = split_stages(traced.gm, {n: int(i >= names.index(second)) for i, n in enumerate(names)}, 2)
    io = GraphIO(traced.gm)
    slots = live_values(engine_layout([0, 1], 2), stages, io.placeholder_names, io.output_names,
                        [n.name for n in traced.gm.graph.nodes])
    return traced.model, stages, io, slots, {n.name: example_of(n) for n in traced.gm.graph.nodes}


@pytest.mark.parametrize("second, numbers", [("linear_1", {"sym_size_int_1"}),
                                             ("reshape", {"sym_size_int_1", "mul"})])
def test_a_python_number_crossing_engine_stages_is_computed_from_the_tensors_received(second, numbers):
    """GPT-2 stopped with `value 'sym_size_int_2' leaves engine stage 0 but is a int`: the engine
    sends only tensors. The reader now computes the number (``n``, ``2 * n``) from the sizes it
    receives, at each call: a batch of 6 through a trace of 4 too."""
    from torchplace.runtime.distributed import computed_numbers

    torch.manual_seed(0)
    model, stages, io, slots, examples = _engine_stages_split_before(second)
    assert numbers <= set(slots[0].outputs)  # what the engine could not send
    slots = computed_numbers(slots, stages, examples)
    assert numbers.isdisjoint(slots[0].outputs + slots[1].inputs)
    assert {r.name for r in slots[1].numbers} == numbers
    for batch in (4, 6):
        flat = inputs = (torch.randn(batch, 8),)
        with torch.no_grad():
            for slot in slots:
                flat = EngineStage(slot, [stages[p] for p in slot.pieces])(*flat)
            got, expected = io(dict(zip(slots[-1].outputs, flat))), model(*inputs)
        assert len(got) == 2 and all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_python_number_the_model_returns_is_refused_before_communication():
    """The engine returns only tensors: it failed in the last stage's forward, telling to keep the
    value inside a stage, which cannot be done with an output (found by fuzzing)."""
    from torchplace.profiling import trace
    from torchplace.runtime import GraphIO
    from torchplace.runtime.distributed import computed_numbers
    from torchplace.runtime.split import compute_nodes

    class ReturnsItsLength(nn.Module):
        def forward(self, x):
            return torch.tanh(x), x.shape[1]

    traced = trace(ReturnsItsLength(), (torch.randn(4, 6),), {}, method="export", dynamic_dims={"x": [1]})
    names = [n.name for n in compute_nodes(traced.gm.graph)]
    stages = split_stages(traced.gm, {n: int(i >= len(names) // 2) for i, n in enumerate(names)}, 2)
    io = GraphIO(traced.gm)
    slots = live_values(engine_layout([0, 1], 2), stages, io.placeholder_names, io.output_names,
                        [n.name for n in traced.gm.graph.nodes])
    with pytest.raises(UnsupportedError, match=r"the model returns .*, a Python number.*return it as a tensor"):
        computed_numbers(slots, stages, {n.name: n.meta.get("val") for n in traced.gm.graph.nodes})


def test_a_python_number_no_received_tensor_determines_is_refused_by_name():
    """Split before ``expand``: its stage receives the column sums, of shape (12,), and ``n``,
    which no size it receives holds."""
    from torchplace.runtime.distributed import computed_numbers

    _, stages, _, slots, examples = _engine_stages_split_before("expand")
    with pytest.raises(UnsupportedError, match="value 'sym_size_int_1' .* is read by engine stage 1.* no tensor"):
        computed_numbers(slots, stages, examples)


def test_a_python_number_of_an_fx_graph_crossing_engine_stages_is_refused_by_name():
    """fx (tried first) holds no symbolic sizes: ``n = x.shape[0]`` is the traced call's plain int.
    It was not seen as a number, and the run failed in the engine's first forward, after
    communication started (`value 'getitem' leaves engine stage 0 but is a int`; found by fuzzing).
    Its trace-time value (the whole batch's 4) must not be taken for a micro-batch's either."""
    from torchplace.runtime.distributed import computed_numbers

    _, stages, _, slots, examples = _engine_stages_split_before("linear_1", method="fx")
    assert "getitem" in slots[0].outputs  # the number stage 1 reads
    with pytest.raises(UnsupportedError, match=r"value 'getitem' \(a Python number of an fx-traced graph.*is read by "
                                               r"engine stage 1.*trace_method='export'.*producer and its readers"):
        computed_numbers(slots, stages, examples)


# -- launch errors, before any communication --------------------------------------------------------
def _env(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # any attempt to communicate would fail differently
    monkeypatch.delenv("MASTER_PORT", raising=False)


def test_not_launched_by_torchrun_says_how_to_launch(monkeypatch):
    import torchplace.distributed as tpd

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, x, _ = dist_worker.build()
    with pytest.raises(DistributedError, match="torchrun --nproc-per-node"):
        tpd.place(model, (x,))


def test_every_engine_schedule_is_priced_as_a_schedule_of_the_cost_model():
    from torchplace.problem import SCHEDULES as PRICED
    from torchplace.runtime.distributed import PRICED_AS, SCHEDULES

    assert set(PRICED_AS) == set(SCHEDULES) and set(PRICED_AS.values()) <= set(PRICED)
    assert PRICED_AS["zero-bubble"] == "gpipe"  # its deferred weight passes keep activations longer than 1F1B


def test_the_gpipe_fallback_counts_its_memory_and_is_refused_where_it_does_not_fit():
    """The engine refuses 1F1B with fewer micro-batches than engine stages and runs GPipe, which
    keeps every micro-batch's activations on every stage: the plan is counted again for it (it
    counted 1F1B's fewer), the warning names what grew, and a device too small for it is refused."""
    import warnings

    from torchplace import api, costmodel
    from torchplace.distributed import _priced_for_fallback
    from torchplace.errors import InfeasibleError, PlacementWarning
    from torchplace.units import format_bytes

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)]).train()
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    placement = api.prepare(model, devices, (torch.randn(32, 64),), mode="training", microbatches=2,
                            contiguous=True, allow_single_device=False, progress=False, warmup=0, repeats=1)
    problem, plan = placement.problem, placement.plan
    assert problem.pipeline.schedule == "1f1b" and len({s.device for s in plan.stages}) == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ran, repriced = _priced_for_fallback(problem, plan, "the engine refuses 1F1B")
    before, after = costmodel.device_memory(problem, plan.stages), costmodel.device_memory(ran, plan.stages)
    grown = [d for d in after if after[d] > before[d]]
    assert grown and all(after[d] >= before[d] for d in after)  # a later stage held 1 of 2 under 1F1B
    assert ran.pipeline.schedule == "gpipe" and repriced.meta["schedule"] == "gpipe"
    assert {c.device: c.memory for c in repriced.costs} == after
    assert repriced.objective == plan.objective and repriced.stages == plan.stages
    (warning,) = [w for w in caught if issubclass(w.category, PlacementWarning)]
    assert str(warning.message).startswith("the engine refuses 1F1B; running 'gpipe' instead, which keeps every "
                                           "micro-batch's activations in flight: memory ")
    assert f"{grown[0]} {format_bytes(before[grown[0]])} -> {format_bytes(after[grown[0]])}" in str(warning.message)
    tight = (before[grown[0]] + after[grown[0]]) // 2  # holds the plan under 1F1B, not under GPipe
    capped = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, devices=tuple(
        dataclasses.replace(d, memory_bytes=tight) if d.name == grown[0] else d for d in problem.cluster.devices)))
    Plan.build(capped, plan.stages, solver="check", seconds=0.0, lower_bound=0.0)  # fits as planned
    with pytest.raises(InfeasibleError, match=rf"GPipe, which would run instead, .* does not fit: {grown[0]} needs "
                                              rf"{re.escape(format_bytes(after[grown[0]]))} where it has "):
        _priced_for_fallback(capped, plan, "the engine refuses 1F1B")


@pytest.fixture(scope="module")
def nc_plans(tmp_path_factory) -> tuple[Path, Path]:
    """Plan files of SkipNet in 4 pieces on cpu:0, cpu:1, cpu:0, cpu:1: inference and training."""
    tmp = tmp_path_factory.mktemp("plans")
    infer, train = tmp / "nc-infer.json", tmp / "nc-train.json"
    assert dist_worker.noncontiguous_plan(str(infer), "inference") == ["cpu:0", "cpu:1", "cpu:0", "cpu:1"]
    dist_worker.noncontiguous_plan(str(train), "training")
    return infer, train


def test_world_size_other_than_the_plan_is_refused_before_communication(monkeypatch, nc_plans):
    import torch.distributed as dist

    import torchplace.distributed as tpd

    _env(monkeypatch, 0, 3)
    model, x, _ = dist_worker.build()
    with pytest.raises(DistributedError, match=r"2 device\(s\) \(cpu:0, cpu:1\) but 3 process\(es\).*"
                                               "--nproc-per-node 2"):
        tpd.place(model, (x,), plan=nc_plans[0])
    with pytest.raises(DistributedError, match="3 device.*2 process.*--nproc-per-node 3"):
        _env(monkeypatch, 0, 2)
        tpd.place(model, (x,), devices=["cpu:0", "cpu:1", "cpu:2"])
    assert not dist.is_initialized()


def test_allow_single_device_is_refused_where_each_device_has_its_process(monkeypatch):
    """README says torchplace.distributed.place keeps the split; allow_single_device=True was
    passed on to place(), which may choose one device for a launch of one process per device."""
    import torch.distributed as dist

    import torchplace.distributed as tpd

    _env(monkeypatch, 0, 2)
    model, x, _ = dist_worker.build()
    with pytest.raises(UsageError, match="allow_single_device=True: 2 processes were launched"):
        tpd.place(model, (x,), devices=["cpu:0", "cpu:1"], allow_single_device=True)
    assert not dist.is_initialized()


@pytest.mark.parametrize("option, message", [
    (dict(timeout=-1), r"timeout: expected a positive finite number of seconds, got -1"),
    # 1e10 s timed out at once (int64 nanoseconds overflow), 1e300 was an OverflowError (found by fuzzing)
    (dict(timeout=1e10), r"timeout: at most 1e\+09 seconds .*got 1e\+10"),
    (dict(plan_timeout=float("nan")), r"plan_timeout: expected a positive finite number of seconds, got nan"),
    (dict(schedule="pipedream"), r"schedule must be one of \['gpipe', '1f1b'.*got 'pipedream'"),
    (dict(backend="nccl"), r"backend 'nccl' runs on GPUs only.*use backend='gloo'"),
])
def test_bad_launch_options_are_refused_before_communication(monkeypatch, option, message):
    """timeout=-1 reached init_process_group; backend='nccl' on the CPU failed inside torch (found
    by fuzzing)."""
    import torch.distributed as dist

    import torchplace.distributed as tpd

    _env(monkeypatch, 0, 2)
    model, x, _ = dist_worker.build()
    with pytest.raises(UsageError, match=message):
        tpd.place(model, (x,), devices=["cpu:0", "cpu:1"], **option)
    assert not dist.is_initialized()


def test_a_plan_of_another_model_is_refused_before_communication(monkeypatch, nc_plans):
    import torch.distributed as dist

    import torchplace.distributed as tpd

    plan = nc_plans[0]
    _env(monkeypatch, 1, 2)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(InvalidPlanError, match="does not fit this model's graph"):
        tpd.place(other, (torch.randn(8, 8),), plan=plan, progress=False)
    assert not dist.is_initialized()


def test_a_random_stream_is_its_stage_and_copys_and_leaves_the_callers_generator():
    from torchplace.runtime.dist_random import RandomStream

    def masks(stream: RandomStream, seed: int, n: int = 2) -> list[torch.Tensor]:
        stream.start(seed)
        out = []
        for _ in range(n):  # two micro-batches: the stream goes on between them
            with stream.drawing():
                out.append(torch.rand(64))
        return out

    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    a = masks(RandomStream(0, 0), 11)
    assert torch.equal(torch.rand(4), expected)  # the caller's sequence, as if nothing was drawn
    assert not torch.equal(a[0], a[1])
    assert all(torch.equal(x, y) for x, y in zip(a, masks(RandomStream(0, 0), 11)))  # tensor-parallel ranks
    for other in (masks(RandomStream(1, 0), 11), masks(RandomStream(0, 1), 11), masks(RandomStream(0, 0), 12)):
        assert not any(torch.equal(x, y) for x in a for y in other)
    with pytest.raises(RuntimeError, match="before start"):
        with RandomStream(0, 0).drawing():
            pass


# -- processes ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, nc_plans):
    """One launch of 2 ranks: a plan solved on rank 0 (inference, training), then a non-contiguous
    plan file with 2 pieces per rank (inference; training by three schedules), a checkpoint, a
    cluster file, an input that requires grad, a hook on a tied weight, a solve that fails on rank 0
    (then a placement that works), an optional input left None, a returned reduction with one
    micro-batch, outputs the loss ignores (by two schedules), ranks that built the model with other
    weights, a rank that refuses rank 0's plan, a reduction returned by a model trained with
    micro-batches, a restart from a saved plan, and last a stage that raises (every rank then ends
    with an error)."""
    tmp = tmp_path_factory.mktemp("two")
    infer, train = nc_plans
    torch.save(dist_worker.build(seed=1)[0].state_dict(), tmp / "seed1.pt")
    tied = tmp / "tied.json"
    dist_worker.noncontiguous_plan(str(tied), "training", tied=True, devices=("cpu:0", "cpu:1"))
    tied_one_rank = tmp / "tied-one-rank.json"  # the tied weight's two readers both on rank 0
    dist_worker.noncontiguous_plan(str(tied_one_rank), "training", tied=True, devices=("cpu:0", "cpu:1", "cpu:0"))
    aux = tmp / "aux.json"
    dist_worker.aux_plan(str(aux))
    scenarios = ("infer,train,infer,train,train@zero-bubble,train@looped-bfs,checkpoint,cluster,train-tied,meta,"
                 "accumulate,train-tied-one-rank,input-grad,tied-hook,solve-fails,none-input,scalar-output,"
                 "refused-on-one-rank,one-microbatch,raise-then-place,aux-output,aux-output@zero-bubble,"
                 "different-calls,unseeded,plan-refused,scalar-output-train,restart,raise")
    return launch(scenarios, 2, tmp, ["-", "-", str(infer), str(train), str(train), str(train), str(tmp / "seed1.pt"),
                                      str(ROOT / "examples" / "clusters" / "two-hosts.json"), str(tied),
                                      str(tmp / "seed1.pt"), "-", str(tied_one_rank), "-", str(tied), "-", "-", "-",
                                      "-", "-", str(infer), str(aux), str(aux), "-", "-", "-", "-", "-", str(infer)],
                  timeout_s=120)


def _check(ranks: list[tuple[int, dict, str]], key: str, world: int) -> None:
    for status, results, err in ranks:
        assert key in results and "error" not in results[key], (results.get(key), err[-3000:])
    if any(k in key for k in ("infer", "checkpoint", "cluster", "meta")):
        outputs = [r[1][key] for r in ranks if "equal" in r[1][key]]  # on the rank of the last stage only
        assert len(outputs) == 1 and outputs[0]["equal"], outputs
        assert ranks[world - 1][1][key] is outputs[0]
    else:
        assert all(r[1][key]["allclose"] for r in ranks)
        held = sorted(n for r in ranks for n in r[1][key]["params"])
        model, _, _ = dist_worker.build()
        assert held == sorted(n for n, _ in model.named_parameters())  # each parameter on exactly one rank


def test_two_ranks_inference_is_bitwise_the_model(two_ranks):
    _check(two_ranks, "0:infer", 2)


def test_each_rank_frees_the_other_ranks_tensors_in_the_model_itself(two_ranks):
    """They went to the meta device in the traced graph's modules only; the model kept them all."""
    assert all(r[1]["0:infer"]["others_real"] == [] for r in two_ranks)
    assert all(r[1]["0:infer"]["layout"] for r in two_ranks)


def test_two_ranks_training_matches_single_process_after_5_steps(two_ranks):
    _check(two_ranks, "1:train", 2)


def test_noncontiguous_plan_runs_two_looped_stages_per_rank(two_ranks):
    for key in ("2:infer", "3:train"):
        _check(two_ranks, key, 2)
        assert two_ranks[0][1][key]["layout"] == [[0, [0]], [1, [1]], [0, [2]], [1, [3]]]


@pytest.mark.parametrize("key", ["4:train@zero-bubble", "5:train@looped-bfs"])
def test_noncontiguous_plan_trains_with_the_other_looped_schedules(two_ranks, key):
    _check(two_ranks, key, 2)


def test_each_rank_loads_its_slice_of_a_checkpoint(two_ranks):
    _check(two_ranks, "6:checkpoint", 2)  # outputs of the checkpoint's weights, not the model's own


def test_a_weight_read_on_two_ranks_gets_the_gradient_of_both_uses(two_ranks):
    key = "8:train-tied"
    for _, results, err in two_ranks:
        assert "error" not in results[key] and results[key]["allclose"], (results[key], err[-2000:])
        assert "inp.weight" in results[key]["params"]  # both ranks hold and step a copy


def test_gradients_accumulate_over_steps_as_the_models_do(two_ranks):
    """The engine divided each stage's whole .grad by m after every step, the earlier steps' sum
    included: two steps without zero_grad gave 0.625 of the model's gradients (found by fuzzing)."""
    _check(two_ranks, "10:accumulate", 2)


def test_a_weight_two_engine_stages_of_one_rank_read_is_scaled_once(two_ranks):
    """The engine scales each engine stage's parameters: a weight read by two of them on one rank
    (a non-contiguous plan) was divided by m twice, 0.29 of its gradient (found by fuzzing)."""
    key = "11:train-tied-one-rank"
    for _, results, err in two_ranks:
        assert "error" not in results[key] and results[key]["allclose"], (results[key], err[-2000:])
    assert two_ranks[0][1][key]["layout"] == [[0, [0]], [1, [1]], [0, [2]], [1, []]]
    assert "inp.weight" in two_ranks[0][1][key]["params"] and "inp.weight" not in two_ranks[1][1][key]["params"]


def test_an_input_that_requires_grad_gets_the_mean_micro_batch_losss_gradient(two_ranks):
    """x.grad was m times the model's: the engine back-propagates each micro-batch's loss unscaled
    and step() scaled only the parameters (found by fuzzing). A gradient x had is kept."""
    results = [r[1]["12:input-grad"] for r in two_ranks]
    assert all("error" not in r and r["allclose"] for r in results), results
    assert results[0]["has_grad"]  # on the rank of the first stage, which reads x


def test_a_gradient_hook_on_a_weight_two_ranks_read_is_refused_on_every_rank(two_ranks):
    """The hook ran on each rank's part of the tied weight's gradient before the parts were summed
    (inp.weight.grad 1.5 off with torch.sign; found by fuzzing); torchplace.place refuses it too."""
    for _, results, err in two_ranks:
        refused = results["13:tied-hook"].get("refused", "")
        assert refused.startswith("UnsupportedError: inp.weight has a gradient hook"), (results["13:tied-hook"], err[-2000:])
        assert "apply what it did to p.grad after step()" in refused


def test_a_failed_solve_on_rank_0_ends_the_others_wait_and_a_later_placement_works(two_ranks):
    """Rank 1 waited for the plan for the whole plan_timeout (default 1800 s) while rank 0, whose
    solve had raised, lived on; and the fault, never cleared, failed every later placement of the
    launch at once (found by fuzzing)."""
    results = [r[1]["14:solve-fails"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    assert results[0]["failed"].startswith("UsageError") and "no-such-solver" in results[0]["failed"], results[0]
    assert results[1]["failed"].startswith("DistributedError: rank 0 failed while placing: UsageError"), results[1]
    assert results[1]["took"] < GRACE_S + SETTLE_S + 15, results[1]  # not the plan_timeout of 120 s
    assert results[1]["equal"] and "equal" not in results[0]


def test_an_optional_input_left_none_is_not_sent_and_a_call_as_the_example_runs(two_ranks):
    """forward(x, mask=None) placed with (x,): run(x) was refused as "model input 'mask_1' is
    NoneType ... pass batched tensors only" (found by fuzzing). A mask given later is refused by name."""
    assert [r[1]["15:none-input"].get("equal") for r in two_ranks] == [None, True], [r[2][-2000:] for r in two_ranks]
    for _, results, _ in two_ranks:
        assert results["15:none-input"]["refused"].startswith("UsageError: input 'mask' is a tensor of shape (8, 16), "
                                                              "but the placed model was traced with None there")


def test_a_reduction_the_model_returns_runs_with_one_micro_batch(two_ranks):
    """(out.sum(), out) with microbatches=1 failed in the engine: "zero-dimensional tensor cannot be
    concatenated", its default joining of the micro-batches' outputs (found by fuzzing)."""
    assert [r[1]["16:scalar-output"].get("equal") for r in two_ranks] == [None, True], [r[2][-2000:] for r in two_ranks]


def test_ranks_that_built_the_model_with_other_weights_are_refused(two_ranks):
    """Each rank runs its stages with its own copy of the model: ranks that built it without seeding
    alike ran a pipeline of parts of two models, whose outputs matched neither, silently (found by
    fuzzing). The next placement (scalar-output-train) runs."""
    results = [r[1]["23:unseeded"] for r in two_ranks]
    assert all(r.get("refused", "").startswith("UsageError: the ranks' models differ in 16 of 16 tensors, the first "
                                               "'inp.weight'") and "torch.manual_seed(0)" in r["refused"]
               for r in results), results


def test_a_rank_that_refuses_rank_0s_plan_ends_rank_0s_wait_naming_it(two_ranks):
    """Rank 1 (placing for training) refused rank 0's inference plan, and rank 0 waited in the
    creation of the process groups for the group's timeout, then raised the store's
    'DistStoreError: wait timeout', naming no cause (found by fuzzing)."""
    results = [r[1]["24:plan-refused"] for r in two_ranks]
    assert results[1]["refused"].startswith("InvalidPlanError: the plan was solved for mode='inference'"), results
    assert results[0]["refused"].startswith("DistributedError: rank 1 failed while placing: InvalidPlanError: the "
                                            "plan was solved for mode='inference'"), results
    assert results[0]["took"] < 20, results  # not the group's timeout of 120 s


def test_a_reduction_the_model_returns_trains_with_micro_batches_and_a_run_is_refused(two_ranks):
    """A training step of a model returning out.sum() beside out (as a Hugging Face model given
    labels= returns its loss) failed after its backward: "zero-dimensional tensor cannot be
    concatenated", the engine joining the micro-batches' outputs that step() does not return. A
    run() of it split into micro-batches is refused, as torchplace.place's call is."""
    results = [r[1]["25:scalar-output-train"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    assert all(r["allclose"] for r in results), results
    held = sorted(n for r in results for n in r["params"])
    assert held == sorted(n for n, _ in dist_worker.SumsToo().named_parameters())  # each parameter on one rank
    assert all(r["refused"].startswith("MicrobatchError: model output [0] is a scalar") for r in results), results


def test_a_plan_saved_from_a_placement_runs_again_without_profiling(two_ranks):
    """placed.plan of torchplace.distributed.place held no profile (torchplace.place's does), so a job
    restarted from it timed the model again on every rank (found by fuzzing)."""
    results = [r[1]["26:restart"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    assert [r["profiled"] for r in results] == [[], []], results
    assert [r.get("equal") for r in results] == [None, True], results


def test_a_call_one_rank_refuses_is_refused_on_every_rank_and_the_next_runs(two_ranks):
    """Rank 1's target had 4 rows: it raised UsageError before any communication, and rank 0 waited
    in the engine for the process group's timeout, then blamed a lost peer (found by fuzzing)."""
    results = [r[1]["17:refused-on-one-rank"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    assert results[1]["refused"].startswith("UsageError: target has 4 rows where the inputs have 8"), results[1]
    assert results[0]["refused"].startswith("DistributedError: rank 1 refused this call before any rank ran it: "
                                            "UsageError: target has 4 rows"), results[0]
    assert all(r["took"] < 10 for r in results), results  # not the group's timeout of 120 s
    assert all(r["allclose"] for r in results), results  # the next step ran as one process's


def test_the_default_schedule_runs_one_micro_batch_and_a_refused_one_is_refused_when_placing(two_ranks):
    """microbatches=1 on 2 ranks was placed with the default 1F1B, which the engine refuses for fewer
    micro-batches than stages, at the first step (found by fuzzing). Now GPipe runs it; 1F1B asked
    for is refused by place()."""
    results = [r[1]["18:one-microbatch"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    assert all(r["schedule"] == "gpipe" and r["allclose"] for r in results), results
    assert all(r["plan_schedule"] == "gpipe" for r in results), results  # placed.plan counts what runs
    assert all(len(r["warned"]) == 1 and "running 'gpipe' instead (it keeps no more activations in flight than the "
               "plan counted)" in r["warned"][0] for r in results), results  # one micro-batch: as many as 1F1B's
    for r in results:
        assert r["refused"].startswith("UnsupportedError: torch.distributed.pipelining refuses schedule '1f1b' "
                                       "(Schedule1F1B) for 2 engine stages on 2 ranks and 1 micro-batches"), r


def test_after_a_failed_call_every_rank_is_freed_and_a_new_placement_runs(two_ranks):
    """After a stage raised and every rank caught the error, a new placement's first run waited for
    the group's timeout and failed with 'lost a peer': the failed run's pending sends and receives
    were still posted on the default group (found by fuzzing). Each placement now has groups of
    its own, a failed one refuses later calls, and closing it frees a peer blocked on it at once."""
    results = [r[1]["19:raise-then-place"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    for r in results:
        assert r["failed"].startswith("DistributedError: rank 1 failed in stage 3"), r
        assert r["again"].startswith("DistributedError: an earlier call of this placement failed (rank 1 failed"), r
        assert "place the model again" in r["again"], r
    assert results[0]["took"] < GRACE_S, results  # freed by rank 1's close(), not by its own watchdog
    assert [r.get("equal") for r in results] == [None, True], results


@pytest.mark.parametrize("key", ["20:aux-output", "21:aux-output@zero-bubble"])
def test_parameters_no_gradient_reaches_keep_grad_none_as_the_models_do(two_ranks, key):
    """An auxiliary head on rank 0 whose output the loss ignores, a gate a later stage detaches, a
    weight two ranks read only for ignored outputs: the engine sends zeros where the next stage's
    input has no gradient, and step() summed the tied weight's zeros, so their parameters got
    .grad zeros where the model's stay None, and AdamW's weight decay moved them (1e-4 off after 3
    steps; found by fuzzing). Now each micro-batch's gradients cross only where they exist: the
    same None, and the parameters after 3 AdamW steps within 1e-6 of one process's, an output
    the loss reads in one micro-batch of four included."""
    results = [r[1][key] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-3000:] for r in two_ranks])
    for r in results:
        assert r["none"] == r["expected_none"] and r["allclose"] and r["max_diff"] <= 1e-6, r
    assert results[0]["none"][-1] == ["aux.bias", "aux.weight", "gate.bias", "gate.weight"]  # on the first stage
    assert results[1]["none"][-1] == ["aux.weight"]  # read on rank 1 too
    held = {n for r in results for n in r["params"]}
    assert held == {n for n, _ in dist_worker.AuxHeads().named_parameters()}


def test_ranks_that_make_different_calls_are_refused_at_once(two_ranks):
    """Rank 0 calling run() while rank 1 called step() passed the vote, then both waited for the
    group's timeout and blamed a lost peer (found by review). Ranks passing batches of different
    shapes failed in the engine with a size mismatch that broke the placement."""
    results = [r[1]["22:different-calls"] for r in two_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-2000:] for r in two_ranks])
    for r in results:
        assert r["refused"].startswith("DistributedError: the ranks made different calls (rank 0 run(), rank 1 "
                                       "step())"), r
        assert r["took"] < 10, r
        assert r["refused_shapes"].startswith("DistributedError: the ranks passed batches of different shapes or "
                                              "dtypes (rank 0: inputs of shapes [(8, 8)]"), r
        assert "rank 1: inputs of shapes [(16, 8)]" in r["refused_shapes"], r
        assert r["took_shapes"] < 10, r
    assert [r.get("equal") for r in results] == [None, True], results


def test_a_model_built_on_the_meta_device_runs_from_the_ranks_slices(two_ranks):
    _check(two_ranks, "9:meta", 2)


def test_a_cluster_file_names_the_ranks_devices(two_ranks):
    _check(two_ranks, "7:cluster", 2)
    assert set(two_ranks[0][1]["7:cluster"]["devices"]) <= {"host0", "host1"}


def _check_fault(ranks: list[tuple[int, dict, str]], failing: int, what: str, stage: int | None = None) -> None:
    """Every rank ended with an error naming rank ``failing`` and its engine ``stage`` (default:
    ``failing``, one stage per rank), all within a few seconds of each other."""
    key = [k for k in ranks[0][1] if k != "ended"][-1]  # the last scenario of the launch
    for rank, (status, results, err) in enumerate(ranks):
        assert status != 0
        if status == -9:  # the killed rank reports nothing
            continue
        message = results[key]["error"]
        assert message.startswith("DistributedError: "), message
        assert f"rank {failing} {what} in stage {failing if stage is None else stage}" in message, message
    ends = [r[1][key]["at"] for r in ranks if "at" in r[1].get(key, {})]
    assert max(ends) - min(ends) < GRACE_S + SETTLE_S + 15, ends  # well inside the 120 s group timeout


def test_a_rank_that_raises_ends_every_rank_naming_it(two_ranks):
    _check_fault(two_ranks, 1, "failed", stage=3)  # the non-contiguous plan's last piece
    assert "ValueError: bomb went off" in two_ranks[0][1]["27:raise"]["error"]


# -- data x tensor x pipeline: a (stage, copy, tensor rank) grid of ranks -----------------------------
@pytest.fixture(scope="module")
def grid_plans(tmp_path_factory) -> dict[str, Path]:
    """Plan files of SkipNet in 2 pieces on cpu:0, cpu:1, every stage with data_parallel=2
    (``dp-*``), or with tensor_parallel=2, traced with Linear modules as leaves (``tp-*``); and
    ``dp-aux``: :func:`dist_worker.aux_plan`'s 4 pieces with data_parallel=2."""
    tmp = tmp_path_factory.mktemp("grid")
    plans = {}
    for kind, degrees in (("dp", dict(data_parallel=2)), ("tp", dict(tensor_parallel=2))):
        for mode in ("inference", "training"):
            plans[f"{kind}-{mode}"] = tmp / f"{kind}-{mode}.json"
            dist_worker.noncontiguous_plan(str(plans[f"{kind}-{mode}"]), mode, devices=("cpu:0", "cpu:1"), **degrees)
    plans["dp-normed"] = tmp / "dp-normed.json"
    dist_worker.noncontiguous_plan(str(plans["dp-normed"]), "training", devices=("cpu:0", "cpu:1"), data_parallel=2,
                                   normed=True)
    plans["dp-dropped"] = tmp / "dp-dropped.json"
    dist_worker.noncontiguous_plan(str(plans["dp-dropped"]), "training", devices=("cpu:0", "cpu:1"), data_parallel=2,
                                   dropped=True)
    plans["dp-aux"] = tmp / "dp-aux.json"
    dist_worker.aux_plan(str(plans["dp-aux"]), data_parallel=2)
    return plans


def test_a_hand_built_plan_file_keeps_its_degrees(grid_plans):
    from torchplace.plan import Plan

    plan = Plan.load(grid_plans["dp-training"])
    assert [s.data_parallel for s in plan.stages] == [2, 2, 2, 2] and not any(s.tmpcs for s in plan.stages)
    assert [s.tensor_parallel for s in Plan.load(grid_plans["tp-inference"]).stages] == [2, 2]


def _changed(plan: Any, stage: int = 0, **change) -> Any:
    """The plan (or plan file) ``plan`` with one stage changed (``dataclasses.replace``)."""
    from torchplace.plan import Plan

    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    plan.stages[stage] = dataclasses.replace(plan.stages[stage], **change)
    return plan


def test_grid_launch_checks_come_before_communication(monkeypatch, grid_plans):
    import torch.distributed as dist

    import torchplace.distributed as tpd

    model, x, _ = dist_worker.build()
    dp = grid_plans["dp-inference"]
    _env(monkeypatch, 0, 3)
    with pytest.raises(DistributedError, match=r"2 data-parallel copies of a pipeline on 2 device\(s\) \(cpu:0, cpu:1\), "
                                               r"1 tensor-parallel rank\(s\) per stage: it needs 4 processes .* but 3 "
                                               "were launched.*--nproc-per-node 4"):
        tpd.place(model, (x,), plan=dp)
    with pytest.raises(DistributedError, match=r"it needs 8 processes .*--nproc-per-node 8"):
        tpd.place(model, (x,), plan=_changed(_changed(dp, tensor_parallel=2), 1, tensor_parallel=2))
    _env(monkeypatch, 0, 4)
    with pytest.raises(UsageError, match="3 micro-batches do not split among the plan's 2 data-parallel copies"):
        tpd.place(model, (x,), plan=dp, microbatches=3)
    made_for_3 = Plan.load(dp)
    made_for_3.meta["call"] = {"microbatches": 3}
    with pytest.raises(UsageError, match="3 micro-batches do not split"):  # no microbatches=: the plan's
        tpd.place(model, (x,), plan=made_for_3)
    with pytest.raises(UsageError, match="microbatches: expected a positive whole number, got .8."):
        tpd.place(model, (x,), plan=dp, microbatches="8")
    with pytest.raises(UnsupportedError, match=r"degrees differ between devices \(\{'cpu:0': \(1, 1\), 'cpu:1': \(2, 1\)\}\)"
                                               ".*data_parallel=2, tensor_parallel=1 on every stage"):
        tpd.place(model, (x,), plan=_changed(dp, data_parallel=1))
    with pytest.raises(InvalidPlanError, match=r"stage 2 runs on cpu:1 with \(data_parallel, tensor_parallel\)=\(2, 1\), "
                                               r"but an earlier stage of cpu:1 has \(1, 1\)"):
        tpd.place(model, (x,), plan=_changed(grid_plans["dp-training"], 1, data_parallel=1), mode="training")
    with pytest.raises(UnsupportedError, match="state_dict= with tensor_parallel > 1"):
        tpd.place(model, (x,), plan=grid_plans["tp-inference"], state_dict={})
    assert not dist.is_initialized()


def test_a_given_plans_schedule_is_the_one_priced_and_run(monkeypatch):
    """A training plan solved for GPipe, given to place() without schedule=, is checked with GPipe's
    activations in flight (the engine then runs GPipe, problem.pipeline.schedule); an explicit
    schedule= is priced as the cost model's schedule it keeps as many activations as
    (runtime.distributed.PRICED_AS). Stops before any communication."""
    import torch.distributed as dist

    import torchplace.api
    import torchplace.distributed as tpd
    from torchplace.runtime.distributed import PRICED_AS

    model, x, y = dist_worker.build()
    gpipe, _ = torchplace.plan_model(model.train(), ["cpu:0", "cpu:1"], (x,), mode="training", schedule="gpipe",
                                     microbatches=4, allow_single_device=False, contiguous=True, solver="dp",
                                     progress=False, repeats=1, warmup=0)
    assert gpipe.meta["schedule"] == "gpipe"
    _env(monkeypatch, 0, 2)
    prepared, original = [], torchplace.api.prepare

    def prepare(*args, **kwargs):
        prepared.append(placement := original(*args, **kwargs))
        return placement

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(torchplace.api, "prepare", prepare)
    monkeypatch.setattr(dist, "init_process_group", stop)
    for schedule, priced in ((None, "gpipe"), *PRICED_AS.items()):
        with pytest.raises(Stop):
            tpd.place(model, (x,), plan=gpipe, mode="training", microbatches=4, schedule=schedule)
        assert prepared.pop().problem.pipeline.schedule == priced, schedule


def test_replicas_share_equal_rows_of_a_batch():
    from torchplace.runtime.dist_replicas import Replicas

    batch = torch.arange(12).reshape(6, 2)
    assert torch.equal(Replicas(3, 1, None).share(batch), batch[2:4])
    with pytest.raises(UsageError, match=r"a batch of shape \(6, 2\) does not split into 4 equal parts"):
        Replicas(4, 0, None).share(batch)


def test_tensor_parallel_splits_linear_pairs_the_graph_calls_as_modules():
    from torchplace.runtime.dist_tensor import linear_pairs, refuse_unsplit

    model, x, _ = dist_worker.build()
    gm = torch.fx.symbolic_trace(model)  # calls the Linear modules: inp's output also skips, out follows an add
    assert linear_pairs(gm, 2) == [("layers.0", "layers.1"), ("layers.2", "layers.3"), ("layers.4", "layers.5")]
    assert linear_pairs(gm, 3) == []  # 16 out-features do not split in 3
    from torchplace import api

    traced = api.prepare(model, ["cpu:0", "cpu:1"], (x,), leaf_modules=[dist_worker.Bomb], progress=False, warmup=0,
                         repeats=1).traced.gm  # the default trace calls F.linear on the weights
    assert linear_pairs(traced, 2) == []
    with pytest.raises(UnsupportedError, match=r"engine stage 1 has tensor_parallel=2 but no pair of nn.Linear modules.*"
                                               r"leaf_modules=\[torch.nn.Linear\]"):
        refuse_unsplit(1, [traced], 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, grid_plans):
    """One launch of 4 ranks: 2 stages x 2 copies (rank r runs stage r // 2 of copy r % 2):
    inference, 5 training steps, a batch that does not split among the copies; then 2 stages x 2
    tensor-parallel ranks: inference and 5 training steps; batch norms and dropout masks in 2 x 2
    copies; outputs the loss reads in one copy only, in 2 x 2 copies of a 4-piece plan; last, 2 x 2
    copies again, where the last stage of both copies raises (every rank then ends with an error)."""
    tmp = tmp_path_factory.mktemp("four")
    plans = [grid_plans[k] for k in ("dp-inference", "dp-training", "dp-training", "tp-inference", "tp-training",
                                     "dp-normed", "dp-dropped", "dp-aux", "dp-inference")]
    return launch("infer,train,odd-batch,infer-tp,train-tp,dp-buffers,dropout,aux-output,raise", 4, tmp,
                  [str(p) for p in plans], timeout_s=60)


def test_data_x_pipeline_inference_is_bitwise_the_model(four_ranks):
    for status, results, err in four_ranks:
        assert "error" not in results["0:infer"], (results, err[-3000:])
    assert [r[1]["0:infer"].get("equal") for r in four_ranks] == [None, None, True, True]  # each copy's last rank
    assert all(r[1]["0:infer"]["layout"] == [[0, [0]], [1, [1]]] for r in four_ranks)


def _check_grid_training(ranks: list[tuple[int, dict, str]], key: str) -> list[dict]:
    """Parameters after 5 SGD steps (momentum 0.9) on every rank: allclose to one process training
    on the whole batch, atol 1e-6 (float32; copies' gradients and slices' products are summed in
    another order); ranks 0, 1 hold the first stage's parameters, ranks 2, 3 the second's."""
    train = [r[1][key] for r in ranks]
    assert all("error" not in t and t["allclose"] for t in train), (train, [r[2][-3000:] for r in ranks])
    assert max(t["max_diff"] for t in train) <= 1e-6
    assert train[0]["params"] == train[1]["params"] and train[2]["params"] == train[3]["params"]
    model, _, _ = dist_worker.build()
    assert sorted(train[0]["params"] + train[2]["params"]) == sorted(n for n, _ in model.named_parameters())
    assert len(train[2]["losses"]) == 4 and train[2]["losses"] == train[3]["losses"]  # every micro-batch's, in order
    assert train[0]["losses"] == train[1]["losses"] == []
    return train


def test_data_x_pipeline_training_matches_single_process_after_5_steps(four_ranks):
    train = _check_grid_training(four_ranks, "1:train")
    assert [t["replica"] for t in train] == [0, 1, 0, 1] and not any(t["sliced"] for t in train)


def test_a_batch_that_does_not_split_among_the_copies_is_refused(four_ranks):
    for _, results, _ in four_ranks:
        assert results["2:odd-batch"]["refused"] == ("UsageError: a batch of 6 does not split into 2 replicas x 2 "
                                                     "equal micro-batches; use a batch size that is a multiple of 4")


def test_tensor_x_pipeline_inference_is_close_to_the_model(four_ranks):
    results = [r[1]["3:infer-tp"] for r in four_ranks]
    assert all("error" not in r for r in results), results
    assert [r.get("max_diff") is not None for r in results] == [False, False, True, True]  # on each last rank
    assert max(r.get("max_diff", 0.0) for r in results) <= 1e-6  # atol 1e-6, not bitwise: a sum of slices


def test_tensor_x_pipeline_training_matches_single_process_after_5_steps(four_ranks):
    train = _check_grid_training(four_ranks, "4:train-tp")
    assert train[0]["sliced"] == [f"layers.{i}.{w}" for i in range(4) for w in ("bias", "weight")]
    assert train[2]["sliced"] == [f"layers.{i}.{w}" for i in (4, 5) for w in ("bias", "weight")]


def test_stages_and_copies_draw_their_own_dropout_masks(four_ranks):
    """Every rank seeds alike (to build the same model), and each process draws from its own
    generator: the second stage drew the first stage's masks, and copy 1 drew copy 0's. Now each
    engine stage of each copy draws from its own stream, seeded from the caller's generator at
    every call, so the same seeding still gives the same masks."""
    last = [r[1]["6:dropout"] for r in four_ranks[2:]]  # the last stage of copy 0 and of copy 1
    assert all("error" not in r for r in (r[1]["6:dropout"] for r in four_ranks)), four_ranks
    for r in last:
        assert r["values"] == [0.0, 2.0]
        assert not r["stages_alike"] and not r["copies_alike"] and not r["calls_alike"]
        assert r["reseeded_alike"]
    assert last[0]["values"] == last[1]["values"]


def test_data_parallel_copies_agree_on_their_buffers_after_every_step(four_ranks):
    """Each copy's batch norms updated their statistics on their own half of the batch, so the
    copies of a stage held different models after training, and num_batches_tracked was half the
    unsplit model's (found by fuzzing). Now floating buffers are the copies' mean (allclose to one
    process's simulation of that) and counters count every micro-batch, as the unsplit model's."""
    results = [r[1]["5:dp-buffers"] for r in four_ranks]
    assert all("error" not in r and r["allclose"] for r in results), results
    assert results[0]["buffers"] == results[1]["buffers"] and results[2]["buffers"] == results[3]["buffers"]
    held = sorted(n for r in (results[0], results[2]) for n in r["buffers"])
    assert held == sorted(n for n, _ in dist_worker.Normed().named_buffers())  # each position's, every one once
    counted = {n: c for r in results for n, c in r["counted"].items()}
    assert sorted(counted) == ["bn_a.num_batches_tracked", "bn_c.num_batches_tracked"]
    assert all(mine == unsplit for mine, unsplit in counted.values()), counted


def test_data_parallel_copies_agree_on_which_parameters_have_a_gradient(four_ranks):
    """An output the loss reads in the first copy's micro-batches only: the second copy has no
    gradient for its head, which then takes the first copy's halved, as the model's mean over
    all micro-batches; what no copy has a gradient for keeps None (AdamW, 3 steps, within 1e-6
    of one process)."""
    results = [r[1]["7:aux-output"] for r in four_ranks]
    assert all("error" not in r for r in results), (results, [r[2][-3000:] for r in four_ranks])
    for r in results:
        assert r["none"] == r["expected_none"] and r["allclose"] and r["max_diff"] <= 1e-6, r
    assert results[0]["none"] == results[1]["none"] and results[2]["none"] == results[3]["none"]
    assert results[2]["none"][-1] == ["aux.weight"] and "aux2.weight" in results[2]["params"]


def test_a_raise_in_one_copy_ends_every_rank_of_every_copy(four_ranks):
    messages = [r[1]["8:raise"].get("error", "") for r in four_ranks]
    assert all(r[0] != 0 for r in four_ranks), messages
    assert all(m.startswith("DistributedError: ") and "failed in stage 1" in m for m in messages), messages
    failing = {m.split("DistributedError: rank ")[1].split(" ")[0] for m in messages}
    assert len(failing) == 1 and failing <= {"2", "3"}, messages  # one copy's last rank published first
    ends = [r[1]["8:raise"]["at"] for r in four_ranks]
    assert max(ends) - min(ends) < GRACE_S + SETTLE_S + 15, ends  # well inside the 60 s group timeout


@pytest.mark.slow
def test_data_x_tensor_x_pipeline_on_8_ranks_trains_like_one_process(tmp_path):
    plans = []
    for mode in ("inference", "training"):
        plans.append(tmp_path / f"{mode}.json")
        dist_worker.noncontiguous_plan(str(plans[-1]), mode, devices=("cpu:0", "cpu:1"), data_parallel=2,
                                       tensor_parallel=2)
    ranks = launch("infer-tp,train-tp", 8, tmp_path, [str(p) for p in plans], timeout_s=120)
    infer = [r[1]["0:infer-tp"] for r in ranks]
    assert [r.get("max_diff") is not None for r in infer] == [False] * 4 + [True] * 4, ranks
    assert max(r.get("max_diff", 0.0) for r in infer) <= 1e-6
    train = [r[1]["1:train-tp"] for r in ranks]
    assert all("error" not in t and t["allclose"] and t["max_diff"] <= 1e-6 for t in train), train
    assert [t["replica"] for t in train] == [0, 0, 1, 1] * 2


@pytest.mark.slow
def test_three_ranks_inference_and_training(tmp_path):
    ranks = launch("infer,train", 3, tmp_path)
    _check(ranks, "0:infer", 3)
    _check(ranks, "1:train", 3)


def test_gpt2_and_models_that_tried_the_engine_run_and_train_on_two_ranks(tmp_path):
    """GPT-2's later stages read the batch size, which the engine cannot send (it stopped with
    UnsupportedError); they compute it from the hidden states they receive. Outputs bitwise,
    parameters after 3 SGD steps within 1e-6 of one process's. And the buffers a model writes
    in forward end as one process's do; the models below found by fuzzing train as one process; an
    fx-traced transformer whose blocks read their sizes runs on a solved plan, outputs bitwise."""
    pytest.importorskip("transformers")
    ranks = launch("gpt2,gpt2-train,stateful,transposed,zero-bubble-output,fx-transformer", 2, tmp_path,
                   timeout_s=120)
    for key in ("0:gpt2", "1:gpt2-train"):
        for _, results, err in ranks:
            assert key in results and "error" not in results[key], (results.get(key), err[-3000:])
        assert any(r[1][key]["numbers"] for r in ranks), "no number crossed: the test no longer tests anything"
    assert [r[1]["0:gpt2"].get("equal") for r in ranks] == [None, True]  # on the last rank
    assert all(r[1]["1:gpt2-train"]["max_diff"] < 1e-6 for r in ranks)
    held = {n for r in ranks for n in r[1]["1:gpt2-train"]["params"]}
    assert held == set(ranks[0][1]["1:gpt2-train"]["all"])  # every parameter stepped on some rank
    # the engine's shape inference runs every stage once more, on uninitialised tensors: a counter
    # was one ahead and batch norm's statistics NaN; garbage token ids failed an embedding
    for _, results, err in ranks:
        assert "error" not in results["2:stateful"] and results["2:stateful"]["allclose"], (results["2:stateful"],
                                                                                           err[-2000:])
    assert {n for r in ranks for n in r[1]["2:stateful"]["buffers"]} >= {"bn_a.running_mean", "bn_b.running_var",
                                                                        "calls"}
    # a gradient that goes back transposed (gloo: "input tensor has to be contiguous"), and a sent
    # output the zero-bubble backward detached while the stage's weight pass still needed it
    for key in ("3:transposed", "4:zero-bubble-output"):
        for _, results, err in ranks:
            assert "error" not in results[key] and results[key]["allclose"], (key, results[key], err[-2000:])
    # the plan counts the activations in flight of the schedule that runs: zero-bubble's as GPipe's
    assert [r[1][k]["plan_schedule"] for r in ranks for k in ("3:transposed", "4:zero-bubble-output")] == [
        "1f1b", "gpipe"] * 2
    # an fx graph's blocks read B, T, C = x.shape, plain ints the engine cannot send: solved plans cut
    # between them and their readers, and the first forward failed (found by fuzzing)
    for _, results, err in ranks:
        assert "error" not in results["5:fx-transformer"], (results["5:fx-transformer"], err[-3000:])
    fx = ranks[0][1]["5:fx-transformer"]
    assert fx["method"] == "fx" and all(pieces for _, pieces in fx["layout"]), fx  # both ranks compute
    assert [r[1]["5:fx-transformer"].get("equal") for r in ranks] == [None, True]


@pytest.mark.slow
def test_three_ranks_a_raise_in_the_last_stage_ends_the_ranks_before_it(tmp_path):
    _check_fault(launch("raise", 3, tmp_path, timeout_s=120), 2, "failed")


@pytest.mark.slow
def test_ranks_blocked_on_a_failed_rank_that_lingers_exit_within_the_grace(tmp_path):
    ranks = launch("raise-and-stay", 2, tmp_path, timeout_s=300)
    status, results, err = ranks[0]
    assert status == 1 and "torchplace: error: rank 1 failed in stage 1 (forward" in err, err
    failed = ranks[1][1]["0:raise-and-stay"]["stayed"]  # rank 1 raised, then sleeps 30 s
    assert results["ended"] - failed < GRACE_S + 10, results["ended"] - failed
    assert ranks[1][0] != 0


@pytest.mark.slow
def test_a_killed_rank_ends_every_rank_naming_it(tmp_path):
    plan = tmp_path / "plan.json"
    dist_worker.noncontiguous_plan(str(plan), "inference")
    ranks = launch("kill", 2, tmp_path, [str(plan)], timeout_s=120)
    assert ranks[1][0] == -9
    _check_fault(ranks, 1, "stopped (killed or crashed)", stage=3)


@pytest.mark.slow
def test_the_readme_torchrun_recipe_runs_as_shown(tmp_path):
    """README's "Many processes" commands: torchplace plan, then torchrun ... -m torchplace run."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torchplace", "plan", "mlp", "--devices", "cpu:0", "cpu:1", "--keep-split",
                    "-o", "plan.json"],
                   cwd=tmp_path, env=env, check=True, timeout=LAUNCH_S, capture_output=True)
    for extra in ([], ["--mode", "training"]):
        if extra:
            subprocess.run([sys.executable, "-m", "torchplace", "plan", "mlp", "--mode", "training", "--devices",
                            "cpu:0", "cpu:1", "--keep-split", "-o", "plan.json"], cwd=tmp_path, env=env, check=True, timeout=LAUNCH_S,
                           capture_output=True)
        done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "torchplace", "run",
                               "plan.json", "--model", "mlp"], cwd=tmp_path, env=env, timeout=LAUNCH_S,
                              capture_output=True, text=True)  # a training plan trains without --mode training
        assert done.returncode == 0, done.stderr[-2000:]
        expected = "rank 1: step 4: loss" if extra else "rank 1: outputs equal to the unsplit model: True"
        assert expected in done.stdout, done.stdout
    example = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2",
                              str(ROOT / "examples" / "distributed_mlp.py")], cwd=tmp_path, env=env, timeout=LAUNCH_S,
                             capture_output=True, text=True)
    assert example.returncode == 0 and "outputs equal to the unsplit model: True" in example.stdout, example.stderr[-2000:]
    assert "rank 1: step 4: mean loss" in example.stdout
    wrong = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "3", "-m", "torchplace", "run",
                            "plan.json", "--model", "mlp", "--mode", "training"], cwd=tmp_path, env=env,
                           timeout=LAUNCH_S, capture_output=True, text=True)
    assert wrong.returncode != 0
    assert "torchplace: error: the plan runs on 2 device(s) (cpu:0, cpu:1) but 3 process(es)" in wrong.stderr


@pytest.mark.slow
def test_the_readme_data_parallel_recipe_runs_as_shown(tmp_path):
    """README's "Data x tensor x pipeline" commands: a training plan made data parallel by hand and
    run on 4 processes gives the losses of the 2-process run of the plan it came from."""
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torchplace", "plan", "mlp", "--mode", "training", "--devices", "cpu:0",
                    "cpu:1", "--keep-split", "-o", "train.json"], cwd=tmp_path, env=env, check=True, timeout=LAUNCH_S,
                   capture_output=True)
    subprocess.run([sys.executable, "-c", "import dataclasses; from torchplace.plan import Plan; p = Plan.load('train.json'); "
                    "p.stages = [dataclasses.replace(s, data_parallel=2) for s in p.stages]; p.save('train-dp2.json')"],
                   cwd=tmp_path, env=env, check=True, timeout=60)
    losses = {}
    for plan, n in (("train.json", 2), ("train-dp2.json", 4)):
        done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(n), "-m", "torchplace", "run", plan,
                               "--model", "mlp", "--mode", "training"], cwd=tmp_path, env=env, timeout=LAUNCH_S,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        # found anywhere in the output: the ranks' lines reach torchrun's stdout together, and were once glued
        losses[n] = sorted(re.findall(rf"rank {n - 1}: (step \d+: loss [\d.]+)", done.stdout))
    assert len(losses[2]) == 5 and losses[4] == losses[2], (losses, done.stdout)  # "step 4: loss 0.004703" alike



def test_a_rank_refuses_micro_batches_smaller_than_the_trace_holds_for():
    """A model that branches on a batch of one (placement.sizes.rows = 2) was run by the engine on
    micro-batches of one, computing the other branch."""
    from torchplace.batchdim import CallSizes
    from torchplace.distributed import DistributedPlaced
    from torchplace.errors import MicrobatchError

    placed = DistributedPlaced.__new__(DistributedPlaced)
    placed._sizes, placed._microbatches, placed.pipeline = CallSizes(rows=2), 4, _Ran()
    placed.pipeline.check_call = placed._check_call
    placed._record_model(None)
    assert placed.run(torch.zeros(8, 3)) == "ran"
    with pytest.raises(MicrobatchError, match="4 micro-batches of 4 samples would hold one each; set "
                                              "placed.microbatches to 2 or fewer"):
        placed.run(torch.zeros(4, 3))
    placed._dtype_guards = ("_assert_tensor_metadata",)  # an exported graph's dtype check: refused under autocast
    assert placed.run(torch.zeros(8, 3)) == "ran"
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match="dtype conversions"):
        placed.run(torch.zeros(8, 3))


# -- checks of a rank's inputs, without processes (found by fuzzing) ---------------------------------
class _Rank:
    """A rank's engine stand-in: its modules hold the whole model."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [model]


def test_step_on_a_model_placed_for_inference_is_refused():
    """It trained the eval-mode graph (batch norm on its running statistics), silently."""
    from torchplace.distributed import DistributedPlaced
    from torchplace.problem import Problem

    placed = DistributedPlaced.__new__(DistributedPlaced)
    placed.problem = Problem.__new__(Problem)
    object.__setattr__(placed.problem, "mode", "inference")
    placed.pipeline = _Ran()
    placed.pipeline.check_call = placed._check_call
    with pytest.raises(UnsupportedError, match="placed for inference.*mode='training'"):
        placed.step(torch.zeros(8, 3), target=torch.zeros(8), loss_fn=nn.functional.mse_loss)


class _Ran:
    """A rank's engine stand-in, without a process group: runs the caller's checks of a call
    (as :class:`DistributedPipeline` does before its vote), then says that it ran."""

    read_by_several: list = []
    check_call: Any = None

    def run(self, *args, **kwargs):
        self.check_call(args, kwargs, False)
        return "ran"

    def step(self, *args, target, loss_fn, **kwargs):
        self.check_call(args, kwargs, True)
        return "ran"


def _placed_without_processes(model: nn.Module, mode: str, joined: Any = None) -> Any:
    """A :class:`DistributedPlaced` of ``model`` (placed in ``mode``, ``joined`` as
    :attr:`torchplace.api.Placement.joined`) whose engine only says that it ran."""
    from torchplace.batchdim import CallSizes
    from torchplace.distributed import DistributedPlaced
    from torchplace.problem import Problem

    placed = DistributedPlaced.__new__(DistributedPlaced)
    placed.problem = Problem.__new__(Problem)
    object.__setattr__(placed.problem, "mode", mode)
    placed._sizes, placed._microbatches, placed._joined, placed.pipeline = CallSizes(), 4, joined, _Ran()
    placed.pipeline.check_call = placed._check_call
    placed._record_model(model)
    return placed


class MeanToo(nn.Module):
    """Returns the batch's mean hidden state (one row) beside its output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        return self.b(h), h.mean(0, keepdim=True)


def test_a_run_of_a_training_placement_whose_outputs_micro_batches_cannot_join_is_refused():
    """run() of a model placed for training returned the engine's torch.cat of the micro-batches'
    batch means, (4, 8) where the model returns (1, 8), silently (found by fuzzing); torchplace.place's
    call refuses it. A step gives each micro-batch's outputs to the loss, and runs."""
    from torchplace import api
    from torchplace.errors import MicrobatchError

    model, x = MeanToo().train(), torch.randn(8, 3)
    placement = api.prepare(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=4, progress=False, warmup=0,
                            repeats=1, sends_tensors_only=True, recompute=False, allow_single_device=False)
    placed = _placed_without_processes(model, "training", placement.joined)
    with pytest.raises(MicrobatchError, match=r"model output \[1\] has shape \(1, 8\).*place it with microbatches=1"):
        placed.run(x)
    assert placed.step(x, target=torch.zeros(8, 2), loss_fn=lambda out, t: nn.functional.mse_loss(out[0], t)) == "ran"


def test_a_mode_switched_after_placing_is_refused():
    """A training placement then model.eval() ran the training graph (batch statistics, 0.4 off,
    running statistics moved); an inference placement then model.train() ran the eval graph,
    silently (found by fuzzing). The engine runs the graph traced in the modes of placing."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    placed = _placed_without_processes(model, "training")
    x = torch.zeros(8, 3)
    assert placed.run(x) == "ran"
    model.eval()
    with pytest.raises(UnsupportedError, match=r"eval mode \(model.eval\(\) was called after placing\?\).*model.train\(\) "
                                               r"again, or place the model in eval mode"):
        placed.run(x)
    with pytest.raises(UnsupportedError, match="eval mode"):
        placed.step(x, target=torch.zeros(8, 4), loss_fn=nn.functional.mse_loss)
    model[1].train()
    with pytest.raises(UnsupportedError, match=r"modules the model, '0' are not in the training modes"):
        placed.run(x)
    model.train()
    assert placed.step(x, target=torch.zeros(8, 4), loss_fn=nn.functional.mse_loss) == "ran"
    placed = _placed_without_processes(model.eval(), "inference")
    model.train()
    with pytest.raises(UnsupportedError, match=r"in training mode \(model.train\(\) was called after placing\?\).*"
                                               r"call model.eval\(\)"):
        placed.run(x)


@pytest.mark.parametrize("change", ["parameter", "hook", "attribute"])
def test_a_model_changed_after_placing_is_refused(change):
    """A new Parameter assigned, or a forward hook added, after placing was ignored: the stages
    ran what was placed (outputs 1.2 and 2.2 off; found by fuzzing)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).eval()
    placed = _placed_without_processes(model, "inference")
    assert placed.run(torch.zeros(8, 3)) == "ran"
    if change == "parameter":
        model[2].weight = nn.Parameter(torch.ones(2, 4))
    elif change == "hook":
        model[2].register_forward_hook(lambda module, args, out: out * 2)
    else:
        model[1].p = 0.0
    what = {"parameter": "2.weight was replaced after placing", "hook": "a forward hook of 2 was added or removed",
            "attribute": r"1.p was changed after placing \(0.5 -> 0.0\)"}[change]
    with pytest.raises(UnsupportedError, match=what):
        placed.run(torch.zeros(8, 3))


def test_a_call_of_other_dtypes_or_autocast_than_the_first_is_refused_before_communication():
    """The engine sizes its receive buffers on the first call, dtypes included: a bool mask after
    an int64 one was received as int64 bytes (outputs 9e15 off), a call under autocast after a
    float32 one received bfloat16 values as float32 (0.35 off; found by fuzzing). Only shapes
    were compared. A first call under autocast is fine (tests of the engine's own sizes)."""
    from torchplace.runtime import GraphIO
    from torchplace.runtime.distributed import DistributedPipeline

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x * mask

    pipeline = DistributedPipeline.__new__(DistributedPipeline)  # the checks of _inputs, without processes
    pipeline.graph_io, pipeline.replicas, pipeline.microbatches = GraphIO(torch.fx.symbolic_trace(Masked())), None, 2
    pipeline._shape, pipeline._first_kinds, pipeline.device, pipeline.rank = None, None, torch.device("cpu"), 0
    pipeline.fed = ("x", "mask")
    pipeline.slots = [EngineSlot(0, 0, (), ("x", "mask"), ())]
    x, mask = torch.randn(4, 3), torch.ones(4, 3, dtype=torch.int64)
    pipeline._inputs((x, mask), {})
    with pytest.raises(UsageError, match=r"inputs of dtypes \['float32', 'bool'\] without autocast, but this pipeline "
                                         r"first ran with \['float32', 'int64'\] without autocast.*place the model again"):
        pipeline._inputs((x, mask.bool()), {})
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UsageError, match="under autocast to bfloat16"):
        pipeline._inputs((x, mask), {})
    pipeline._inputs((x, mask), {})  # as the first call: runs


def test_a_checkpoint_of_other_shapes_is_refused_and_unsaved_buffers_are_not_asked_for():
    """A (1,) bias was broadcast into an (8,) one; a buffer registered with persistent=False
    (a rotary embedding's inv_freq) was asked for in model.state_dict(), which never holds it."""
    from torchplace.distributed import DistributedPlaced

    model = nn.Linear(3, 8)
    model.register_buffer("scale", torch.ones(8), persistent=False)
    placed = DistributedPlaced.__new__(DistributedPlaced)
    placed.pipeline = _Rank(model)
    checkpoint = {k: v + 1 for k, v in model.state_dict().items()}
    placed._load(model, checkpoint)
    assert torch.equal(model.bias, checkpoint["bias"]) and torch.equal(model.scale, torch.ones(8))
    with pytest.raises(UsageError, match=r"state_dict\['bias'\] has shape \(1,\), but the model's 'bias' has \(8,\)"):
        placed._load(model, {**checkpoint, "bias": torch.ones(1)})
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))  # a checkpoint saving a tied weight once
    tied[1].weight = tied[0].weight
    placed.pipeline = _Rank(tied)
    placed._load(tied, {"0.weight": torch.ones(10, 4)})
    assert torch.equal(tied[1].weight, torch.ones(10, 4))
    with pytest.raises(UsageError, match=r"state_dict has no '0.weight'"):
        placed._load(tied, {})


def test_a_meta_model_keeps_its_tied_weights_and_refuses_buffers_no_checkpoint_holds():
    """``to_empty`` gave each module its own copy of a tied weight: the copies then trained apart."""
    from torchplace.distributed import _materialize_lazily

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    _materialize_lazily(model, state_dict={})
    assert model[1].weight is model[0].weight and not model[0].weight.is_meta
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    model.register_buffer("inv_freq", torch.ones(2, device="meta"), persistent=False)
    with pytest.raises(UsageError, match=r"buffer 'inv_freq' .* not saved in a state_dict"):
        _materialize_lazily(model, state_dict={})


def test_placing_a_model_again_after_its_other_ranks_tensors_were_freed_says_so():
    """It blamed the meta device and asked for state_dict= (found by fuzzing)."""
    from torchplace.distributed import _FREED, _materialize_lazily

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = nn.Parameter(model[1].weight.to("meta"))  # as the first placement left it
    _FREED.add(model)
    with pytest.raises(UsageError, match=r"placed before in this process.*copy.deepcopy\(model\)"):
        _materialize_lazily(model, state_dict=None)
    _materialize_lazily(model, state_dict={})  # with a checkpoint it is loaded again
    assert not model[1].weight.is_meta


def test_a_model_input_without_the_batch_rows_is_refused_by_name():
    """A (1, 8) bias beside an (8, 8) batch failed inside the engine with 'Expecting 2 arg_mbs but got 1'."""
    from torchplace.runtime import GraphIO
    from torchplace.runtime.distributed import DistributedPipeline

    class AddsABias(nn.Module):
        def forward(self, x, bias):
            return x + bias

    pipeline = DistributedPipeline.__new__(DistributedPipeline)
    pipeline.graph_io, pipeline.fed, pipeline._first_kinds = GraphIO(torch.fx.symbolic_trace(AddsABias())), ("x", "bias"), None
    with pytest.raises(UnsupportedError, match=r"model input 'bias' is a tensor of 1 rows where 'x' has 8"):
        pipeline._inputs((torch.zeros(8, 8), torch.zeros(1, 8)), {})
    # a target of other rows failed inside the loss, labelled as the forward pass
    pipeline.replicas, pipeline.microbatches, pipeline._shape = None, 2, None
    pipeline.slots, pipeline.rank, pipeline.device = [EngineSlot(0, 1, (), ("x", "bias"), ())], 0, torch.device("cpu")
    pipeline.faults, pipeline.check_call, pipeline.broken = None, None, None  # one process: no vote
    with pytest.raises(UsageError, match=r"target has 4 rows where the inputs have 8"):
        pipeline.step(torch.zeros(8, 8), torch.zeros(8, 8), target=torch.zeros(4), loss_fn=nn.functional.mse_loss)


class SplitsInTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p, q = self.a(x).chunk(2, dim=1)
        return self.b(p) * q


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_plan_for_the_engine_keeps_a_container_with_the_nodes_that_take_its_items(mode):
    """A solved training plan cut between `chunk` and its `getitem`s; the engine cannot send the
    tuple, and the first step failed (found by fuzzing). Placed for the engine, they share a
    device (backward nodes too); placed for threads, they need not."""
    from torchplace import api

    def labels(**options) -> set:
        placement = api.prepare(SplitsInTwo().train(mode == "training"), ["cpu:0", "cpu:1"], (torch.randn(4, 8),),
                                mode=mode, progress=False, warmup=0, repeats=1, allow_single_device=False,
                                time_limit=2, **options)
        graph = placement.problem.graph
        return {graph.record(v).colocation for v in graph if v.split(":")[0] in ("chunk", "getitem", "getitem_1")}

    together = labels(sends_tensors_only=True)
    assert len(together) == 1 and None not in together
    assert labels() != together
    if mode == "inference":  # a plan given by hand that splits them is refused, saying why
        placement = api.prepare(SplitsInTwo().eval(), ["cpu:0", "cpu:1"], (torch.randn(4, 8),), progress=False,
                                warmup=0, repeats=1, allow_single_device=False, sends_tensors_only=True)
        order = list(placement.problem.graph.topological_order())
        cut = next(i for i, v in enumerate(order) if v.startswith("chunk")) + 1
        with pytest.raises(InvalidPlanError, match=r"colocation group 'items:chunk.*is split.*sends only tensors "
                                                   r"between stages.*put them on one device"):
            Plan.build(placement.problem, [Stage("cpu:0", tuple(order[:cut])), Stage("cpu:1", tuple(order[cut:]))],
                       solver="by hand", seconds=0.0, lower_bound=0.0, status="feasible")


@pytest.mark.parametrize("mode, devices, solver", [("inference", 2, "auto"), ("inference", 3, "dpl"),
                                                  ("training", 2, "auto"), ("training", 3, "auto")])
def test_a_plan_for_the_engine_keeps_an_fx_number_with_the_nodes_that_read_it(mode, devices, solver):
    """An fx graph's ``B, T, C = x.shape`` are plain ints, which the engine cannot send and no later
    stage can compute: solved plans cut between them and the reshapes that read them, and 4 of 6
    failed in their first forward (found by fuzzing). Placed for the engine, every node that makes
    a number shares a colocation group (backward nodes too) and a stage with its readers; placed
    for threads, where numbers cross stages freely, it need not."""
    from torchplace import api

    model, ids = dist_worker.build_transformer()

    def prepared(**options) -> Any:
        return api.prepare(model.train(mode == "training"), [f"cpu:{i}" for i in range(devices)], (ids,), mode=mode,
                           solver=solver, progress=False, warmup=0, repeats=1, allow_single_device=False,
                           time_limit=2, **options)

    def read(placement) -> set[tuple[str, str]]:
        """(maker, reader) graph nodes of every value that is no tensor (a number, a torch.Size)."""
        graph, gm = placement.problem.graph, placement.traced.gm
        node_of = {f: v for v, r in graph.records() if not r.backward for f in r.fx_nodes}
        made = [n for n in gm.graph.nodes if n.name in node_of and not n.meta["torchplace"].shapes]
        return {(node_of[n.name], node_of[u.name]) for n in made for u in n.users
                if node_of.get(u.name, node_of[n.name]) != node_of[n.name]}

    placement = prepared(sends_tensors_only=True)
    graph, plan = placement.problem.graph, placement.plan
    pairs = read(placement)
    assert placement.traced.method == "fx" and len(pairs) >= 9, pairs  # B, T and C read in each of three blocks
    label = {v: r.colocation for v, r in graph.records()}
    assert all(label[a] is not None and label[a] == label[b] for a, b in pairs), \
        [(a, b) for a, b in pairs if label[a] is None or label[a] != label[b]]
    stage = {v: i for i, s in enumerate(plan.stages) for v in s.nodes}
    assert all(stage[a] == stage[b] for a, b in pairs), [(a, b) for a, b in pairs if stage[a] != stage[b]]
    assert len({s.device for s in plan.stages}) >= 2  # the plan is split: the test tests something
    device = plan.assignment
    for kept in {label[a] for a, _ in pairs}:  # in training, with the backward nodes of their forward nodes
        group = [v for v in graph if label[v] == kept]
        assert len({device[v] for v in group}) == 1
        assert any(graph.record(v).backward for v in group) == (mode == "training")
    threads = prepared()
    label = {v: r.colocation for v, r in threads.problem.graph.records()}
    assert any(label[a] is None or label[a] != label[b] for a, b in read(threads))  # nothing keeps them together


def test_zero_bubble_is_refused_where_a_later_stage_computes_from_a_model_input():
    """torch.distributed.pipelining's zero-bubble backward finds a stage's weights through its
    inputs' gradients, except at engine stage 0: a plan whose first piece was on rank 1 (engine
    stage 0 a pass-through) left that piece's weights with no gradient, silently (found by fuzzing)."""
    from torchplace.runtime.distributed import _check_zero_bubble

    passing = [EngineSlot(0, 0, (), ("x",), ("x",)), EngineSlot(1, 1, (0,), ("x",), ("h",)),
               EngineSlot(2, 0, (1,), ("h",), ("y",)), EngineSlot(3, 1, (), ("y",), ("y",))]
    with pytest.raises(UnsupportedError, match=r"engine stage 1 \(rank 1\) computes from model input\(s\) \['x'\].*'1f1b'"):
        _check_zero_bubble(passing, ("x",))
    ids_later = [EngineSlot(0, 0, (0,), ("x", "ids"), ("h", "ids")), EngineSlot(1, 1, (1,), ("h", "ids"), ("y",))]
    with pytest.raises(UnsupportedError, match=r"\['ids'\]"):  # an embedding of token ids on a later stage
        _check_zero_bubble(ids_later, ("x", "ids"))
    _check_zero_bubble([EngineSlot(0, 0, (0,), ("x",), ("h",)), EngineSlot(1, 1, (1,), ("h",), ("y",))], ("x",))
