"""Planning a model that does not fit one device (issue 17, item 6): profiling times each part on
the device without moving the model there, and a model on the meta device is planned from shapes
with estimated costs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace
from torchplace import costmodel
from torchplace.devices import Device
from torchplace.errors import UsageError
from torchplace.models import build
import importlib

profile_module = importlib.import_module("torchplace.profiling.profile")
from torchplace.profiling import profile, trace


def _model_to_spy(monkeypatch) -> list[int]:
    """Parameter counts of every module moved with ``Module.to``."""
    moved: list[int] = []
    original = nn.Module.to

    def spy(self, *args, **kwargs):
        moved.append(sum(p.numel() for p in self.parameters()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", spy)
    return moved


@pytest.mark.parametrize("method, granularity", [("fx", "module"), ("export", "operator")])
def test_profiling_another_kind_moves_one_part_at_a_time(monkeypatch, method, granularity):
    model, inputs = build("mlp")
    with torch.no_grad():
        traced = trace(model, inputs, method=method, granularity=granularity)
    before = {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()}
    total = sum(p.numel() for p in model.parameters())
    # the meta device stands in for an accelerator: it runs every operator, holds no values
    monkeypatch.setattr(profile_module, "present_kinds", lambda: {"cpu", "meta"})
    moved = _model_to_spy(monkeypatch)
    graph = profile(traced, inputs, kinds=("cpu", "meta"), warmup=0, repeats=1, progress=False)
    assert all("meta" in r.times and "cpu" in r.times for _, r in graph.records())
    assert all(n < total for n in moved), f"a move of {max(moved)} of {total} parameters: the whole model"
    if method == "fx":
        assert moved, "the graph calls Linear modules: each is copied over for its own call"
    assert {n: (p.device, p.data_ptr()) for n, p in model.named_parameters()} == before


def _meta_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False,
                                     bos_token_id=1, eos_token_id=1)
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(config).eval()
    return meta, transformers.GPT2LMHeadModel(config).eval()


def test_a_model_on_the_meta_device_is_planned_with_estimated_costs():
    meta, real = _meta_gpt2()
    ids = torch.randint(0, 128, (2, 16))
    weights = sum(p.numel() * 4 for p in real.parameters())
    cap = int(weights * 0.8)  # no one device holds the model
    devices = [Device("cuda:0", "cuda:0", "cuda", cap), Device("cuda:1", "cuda:1", "cuda", cap)]
    plan, problem = torchplace.plan_model(meta, devices, example_kwargs={"input_ids": ids}, progress=False)
    assert {s.device for s in plan.stages} == {"cuda:0", "cuda:1"}
    assert sum(r.param_bytes for _, r in problem.graph.records()) == weights  # tied lm_head counted once
    assert all(r.times.get("cuda", 0) > 0 for _, r in problem.graph.records())  # roofline estimates
    assert plan.objective == costmodel.evaluate(problem, plan)
    assert max(costmodel.device_memory(problem, plan.stages).values()) <= cap
    assert set(plan.device_map(problem).values()) == {"cuda:0", "cuda:1"}
    assert all(p.device.type == "meta" for p in meta.parameters())  # nothing materialized


def test_place_refuses_a_meta_model_and_names_plan_model():
    meta, _ = _meta_gpt2()
    with pytest.raises(UsageError, match="plan_model"):
        torchplace.place(meta, ["cpu:0"], example_kwargs={"input_ids": torch.zeros(2, 8, dtype=torch.long)},
                         progress=False)


def test_plan_model_refuses_a_half_materialized_model():
    meta, _ = _meta_gpt2()
    meta.lm_head = nn.Linear(64, 128, bias=False)  # on the CPU, the rest on meta
    with pytest.raises(UsageError, match="every tensor must be on the meta device"):
        torchplace.plan_model(meta, ["cpu:0"], example_kwargs={"input_ids": torch.zeros(2, 8, dtype=torch.long)},
                              progress=False)


class ConvWithNorm(nn.Module):
    """A model with buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        return self.head(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_meta_model_with_buffers_is_planned(mode):
    """Checking that tracing wrote no buffer compared their values, which a meta tensor has not:
    every meta model with a buffer (BatchNorm, BERT's position_ids) failed with a raw
    'Tensor.item() cannot be called on meta tensors'; for training on CPU devices the backward
    was then timed on the CPU, with a raw 'Cannot copy out of meta tensor' (found by fuzzing)."""
    torch.manual_seed(0)
    real = ConvWithNorm().train(mode == "training")
    with torch.device("meta"):
        meta = ConvWithNorm().train(mode == "training")
    x = torch.randn(4, 3, 8, 8)
    options = dict(mode=mode, progress=False, microbatches=2)
    devices = ["cpu:0", "cpu:1"]
    plan, problem = torchplace.plan_model(meta, devices, (x,), **options)
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)
    _, expected = torchplace.plan_model(real, devices, (x,), **options)
    assert (sum(r.param_bytes for _, r in problem.graph.records())
            == sum(r.param_bytes for _, r in expected.graph.records()))
    assert all(t.device.type == "meta" for t in [*meta.parameters(), *meta.buffers()])


def test_a_meta_bert_is_planned():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    with torch.device("meta"):
        meta = transformers.BertModel(config).eval()
    ids = torch.zeros(2, 8, dtype=torch.long)
    plan, problem = torchplace.plan_model(meta, ["cpu:0", "cpu:1"], example_kwargs={"input_ids": ids}, progress=False)
    plan.validate(problem)
    assert set(plan.device_map(problem).values()) <= {"cpu:0", "cpu:1"}


class AddsARange(nn.Module):
    """Makes a tensor in forward without ``device=``: on the CPU, whatever the weights' device."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + torch.arange(16, dtype=torch.float32)


def test_a_meta_model_that_makes_a_cpu_tensor_is_a_trace_error_naming_the_fix():
    """It failed with torch's raw 'Tensor on device cpu is not on the expected device meta!'
    (found by fuzzing)."""
    from torchplace.errors import TraceError

    with torch.device("meta"):
        meta = AddsARange()
    with pytest.raises(TraceError, match=r"fails on the meta device.*without device=.*device=x\.device"):
        torchplace.plan_model(meta, ["cpu:0", "cpu:1"], (torch.randn(4, 16),), progress=False)


def test_a_meta_plan_for_a_graph_the_loaded_model_does_not_trace_to_says_why_and_what_works():
    """plan_model's docstring says place(loaded, plan=plan) runs its plan; at operator level the
    meta trace of BERT has .contiguous() copies the loaded model's has not, and the refusal said to
    trace 'the same model with the same granularity', which it was (found by fuzzing). Blocks kept
    whole give the same nodes on both, and that plan runs."""
    from torchplace.errors import InvalidPlanError

    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 64, (4, 8))
    call = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    options = dict(example_kwargs=call, progress=False, microbatches=2)
    with torch.device("meta"):
        meta = transformers.BertModel(config).eval()
    plan, _ = torchplace.plan_model(meta, ["cpu:0", "cpu:1"], **options)
    torch.manual_seed(0)
    loaded = transformers.BertModel(config).eval()
    with pytest.raises(InvalidPlanError, match=r"made by plan_model from the model on the meta device.*leaf_modules="):
        torchplace.place(loaded, ["cpu:0", "cpu:1"], plan=plan, repeats=1, warmup=0, **options)
    blocks = dict(options, leaf_modules=["BertLayer"])
    plan, _ = torchplace.plan_model(meta, ["cpu:0", "cpu:1"], **blocks)
    placed = torchplace.place(loaded, ["cpu:0", "cpu:1"], plan=plan, repeats=1, warmup=0, **blocks)
    with torch.no_grad():
        parts = [{k: v.chunk(2)[i] for k, v in call.items()} for i in range(2)]
        expected = torch.cat([loaded(**part).last_hidden_state for part in parts])
        assert torch.equal(placed(**call).last_hidden_state, expected)


def test_a_meta_model_given_inputs_it_rejects_is_a_trace_error_saying_so():
    """fx traces without running anything: a raw RuntimeError came from the shape run."""
    from torchplace.errors import TraceError

    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    with pytest.raises(TraceError, match=r"fails on the meta device.*pass example inputs the model accepts"):
        torchplace.plan_model(meta, ["cpu:0", "cpu:1"], (torch.randn(4, 15),), progress=False)


def test_a_half_precision_meta_model_is_estimated_at_the_gpus_tensor_core_peak():
    """The roofline took one peak per kind, the A100's FP32 19.5 TFLOP/s: a float16 matmul, which its
    tensor cores run at 312, was priced 16 times too slow, and offloading looked cheap beside it."""
    from torchplace.profiling.estimate import DEVICE_SPECS, node_costs

    spec = DEVICE_SPECS["cuda"]
    times = {}
    for dtype in (torch.float32, torch.float16):
        with torch.device("meta"):
            meta = nn.Sequential(nn.Linear(1024, 1024, bias=False)).to(dtype)
        x = torch.randn(2048, 1024, dtype=dtype, device="meta")
        _, problem = torchplace.plan_model(meta, [Device("cuda:0", "cuda:0", "cuda")], (x,), progress=False)
        [(_, record)] = problem.graph.records()
        times[dtype] = record.times["cuda"]
        costs = node_costs(trace(meta, (x,)), (x,))
        [cost] = [c for c in costs.values() if c.flops]
        assert cost.dtype == str(dtype).removeprefix("torch.")
        assert times[dtype] == pytest.approx(max(cost.flops / spec.peak(dtype), cost.bytes / spec.mem_bandwidth)
                                             + spec.overhead)
    assert spec.peak(torch.float16) == spec.peak(torch.bfloat16) == 312e12 and spec.peak(torch.float32) == 19.5e12
    assert times[torch.float32] / times[torch.float16] > 8  # bytes halving alone gives at most 2


def test_a_device_spec_falls_back_to_its_fp32_peak_and_refuses_a_bad_dtype_table():
    from torchplace.profiling.estimate import DEVICE_SPECS, DeviceSpec

    assert DEVICE_SPECS["cuda-t4"].peak(torch.bfloat16) == DEVICE_SPECS["cuda-t4"].peak_flops  # Turing: no bf16 cores
    assert DEVICE_SPECS["cpu"].peak(torch.float16) == DEVICE_SPECS["cpu"].peak_flops
    spec = DeviceSpec(1e12, 1e11, 0.0, {torch.float16: 4e12})
    assert spec.dtype_peak_flops == {"float16": 4e12} and spec.seconds(8e12, 0, "float16") == 2.0
    with pytest.raises(UsageError, match="dtype_peak_flops"):
        DeviceSpec(1e12, 1e11, 0.0, {"float16": 0})
