"""Tests of torchplace.runtime: stage splitting, the pipeline schedule and the executor."""
from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import pytest
import torch
from torch import fx, nn

from torchplace.errors import InvalidPlanError, StageError, UnsupportedError
from torchplace.runtime import (
    GraphIO,
    PipelineExecutor,
    StageModule,
    clock_cycles,
    segments,
    split_stages,
    worker_orders,
)
from torchplace.runtime.devices import ALIGNMENT, copy_to
from torchplace.runtime.split import compute_nodes

WORKERS = ["cpu:0", "cpu:1", "cpu:2"]


# ----------------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ResidualCNN(nn.Module):
    """Skip connections: the stem's output is read again at the very end."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.block2 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = torch.relu(self.stem(x))
        h = self.block1(stem) + stem
        h = self.block2(h) + h + stem
        return self.head(h.mean(dim=(2, 3)))


class Encoder(nn.Module):
    """nn.TransformerEncoder's layers (the encoder's own forward is not symbolically traceable)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.head(h)


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    return MLP(), torch.randn(8, 16)


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    return ResidualCNN(), torch.randn(8, 3, 8, 8)


def _encoder() -> tuple[nn.Module, torch.Tensor]:
    return Encoder(), torch.randn(8, 6, 12)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "mlp": _mlp,
    "cnn": _cnn,
    "encoder": _encoder,
}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------- helpers


def contiguous_stages(gm: fx.GraphModule, num_stages: int) -> dict[str, int]:
    """Cut the topological order of the compute nodes into ``num_stages`` equal chunks."""
    nodes = compute_nodes(gm.graph)
    return {n.name: i * num_stages // len(nodes) for i, n in enumerate(nodes)}


def make_executor(gm: fx.GraphModule, num_stages: int, **kwargs: Any) -> PipelineExecutor:
    stages = split_stages(gm, contiguous_stages(gm, num_stages), num_stages)
    return PipelineExecutor(
        stages, ["cpu"] * num_stages, WORKERS[:num_stages], GraphIO(gm), **kwargs
    )


def run_guarded(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Run ``fn`` in a thread; fail if it does not finish within ``timeout`` (no hang).

    Grad mode is thread-local, so the caller's is applied in the thread.
    """
    outcome: dict[str, Any] = {}
    grad_enabled = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed back to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"executor did not finish within {timeout} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


# --------------------------------------------------------------------------------- schedule


def test_clock_cycles_exact() -> None:
    assert list(clock_cycles(3, 2)) == [[(0, 0)], [(0, 1), (1, 0)], [(1, 1), (2, 0)], [(2, 1)]]
    assert list(clock_cycles(2, 3)) == [
        [(0, 0)],
        [(0, 1), (1, 0)],
        [(0, 2), (1, 1)],
        [(1, 2)],
    ]
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]
    assert list(clock_cycles(0, 3)) == []


def test_clock_cycles_rejects_negative() -> None:
    with pytest.raises(ValueError, match="num_microbatches: -1"):
        list(clock_cycles(-1, 2))


def test_segments_and_worker_orders() -> None:
    assert segments(["a", "a", "b", "a"]) == [("a", (0, 1)), ("b", (2,)), ("a", (3,))]
    assert worker_orders(3, ["a", "b", "a"]) == {
        "a": [(0, 0), (1, 0), (0, 2), (2, 0), (1, 2), (2, 2)],
        "b": [(0, 1), (1, 1), (2, 1)],
    }


# ------------------------------------------------------------------------------------ split


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_split_stages_run_sequentially(name: str, num_stages: int) -> None:
    model, x = MODELS[name]()
    gm = fx.symbolic_trace(model.eval())
    stages = split_stages(gm, contiguous_stages(gm, num_stages), num_stages)
    assert [s.index for s in stages] == list(range(num_stages))
    io = GraphIO(gm)
    env = io.bind_inputs((x,), {})
    with torch.no_grad():
        for stage in stages:
            assert isinstance(stage, StageModule)
            env.update(zip(stage.outputs, stage(*(env[n] for n in stage.inputs))))
        assert torch.equal(io(env), gm(x))


def test_stage_holds_only_its_parameters() -> None:
    gm = fx.symbolic_trace(MLP())
    stages = split_stages(gm, contiguous_stages(gm, 3), 3)
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sum(counts) == sum(p.numel() for p in gm.parameters())
    assert all(c > 0 for c in counts)


def test_skip_connection_crosses_stages() -> None:
    gm = fx.symbolic_trace(ResidualCNN())
    stages = split_stages(gm, contiguous_stages(gm, 3), 3)
    stem = next(n.name for n in gm.graph.nodes if n.target == torch.relu)
    assert stem in stages[0].outputs and stem in stages[2].inputs


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.wte(ids)))
        return h @ self.wte.weight.t()


def test_a_tied_weight_has_one_home_and_a_replica_on_the_other_device() -> None:
    model = TiedLM()
    weight = model.wte.weight
    gm = fx.symbolic_trace(model)
    stage_of = {n.name: (0 if i < 2 else 1) for i, n in enumerate(compute_nodes(gm.graph))}
    stages = split_stages(gm, stage_of, 2)
    weights = [dict(s.named_parameters()) for s in stages]
    assert any(p is weight for p in weights[0].values())
    assert any(p is weight for p in weights[1].values())
    executor = PipelineExecutor(stages, ["cpu", "meta"], ["cpu:0", "cpu:1"], GraphIO(gm))
    assert executor.stage_params.replicas == 1
    # the model keeps its own Parameter at its home (the first stage reading it, on cpu)
    assert model.wte.weight is weight and weight.device.type == "cpu" and stages[0].wte.weight is weight
    assert executor.stages[1].wte.weight.device.type == "meta"  # the replica, in stage 1 only


def test_parameters_stay_the_models_own_objects() -> None:
    model = MLP()
    params = list(model.parameters())
    gm = fx.symbolic_trace(model)
    stages = split_stages(gm, contiguous_stages(gm, 2), 2)
    PipelineExecutor(stages, ["cpu", "cpu"], ["w0", "w1"], GraphIO(gm))
    assert list(model.parameters()) == params  # the same objects, in order
    assert [list(s.parameters()) for s in stages] == [params[:4], params[4:]]


def test_a_parameter_that_cannot_move_in_place_is_refused() -> None:
    gm = fx.symbolic_trace(MLP())
    stages = split_stages(gm, contiguous_stages(gm, 2), 2)
    with pytest.raises(UnsupportedError, match="in place"):
        PipelineExecutor(stages, ["cpu", "meta"], ["w0", "w1"], GraphIO(gm))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_parameters_move_home_in_place_on_cuda() -> None:
    model = MLP()
    params = list(model.parameters())
    gm = fx.symbolic_trace(model)
    stages = split_stages(gm, contiguous_stages(gm, 2), 2)
    PipelineExecutor(stages, ["cuda:0", "cpu"], ["w0", "w1"], GraphIO(gm))
    assert list(model.parameters()) == params
    first = set(map(id, stages[0].parameters()))
    assert all((p.device.type == "cuda") == (id(p) in first) for p in params)


def test_invalid_stage_order_names_node_and_stages() -> None:
    gm = fx.symbolic_trace(MLP())
    stage_of = contiguous_stages(gm, 2)
    first, second = compute_nodes(gm.graph)[:2]
    stage_of[first.name], stage_of[second.name] = 1, 0
    with pytest.raises(InvalidPlanError, match=rf"{second.name!r} in stage 0 reads {first.name!r}"):
        split_stages(gm, stage_of, 2)


def test_missing_unknown_and_out_of_range_nodes() -> None:
    gm = fx.symbolic_trace(MLP())
    stage_of = contiguous_stages(gm, 2)
    name = next(iter(stage_of))
    with pytest.raises(InvalidPlanError, match="have no stage"):
        split_stages(gm, {k: v for k, v in stage_of.items() if k != name}, 2)
    with pytest.raises(InvalidPlanError, match="not compute nodes"):
        split_stages(gm, {**stage_of, "x": 0}, 2)
    with pytest.raises(InvalidPlanError, match="outside"):
        split_stages(gm, {**stage_of, name: 5}, 2)


# ------------------------------------------------------------------------------- executor


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_pipeline_equals_model_bitwise(name: str, num_stages: int) -> None:
    model, x = MODELS[name]()
    gm = fx.symbolic_trace(model.eval())
    executor = make_executor(gm, num_stages)
    with torch.no_grad():
        expected = gm(x)
        expected_chunks = torch.cat([gm(c) for c in x.tensor_split(4)])
        assert torch.equal(run_guarded(lambda: executor.run((x,), {}, 1)), expected)
        assert torch.equal(run_guarded(lambda: executor.run((x,), {}, 4)), expected_chunks)


@pytest.mark.parametrize("name", list(MODELS))
def test_microbatched_equals_full_batch(name: str) -> None:
    """Micro-batching is exact per chunk but not bitwise equal to the full batch in general.

    CPU GEMM/conv kernels block differently for different batch sizes, so e.g. the MLP with
    chunks of 2 rows differs from the 8-row batch by ~3e-8; only closeness is asserted here.
    """
    model, x = MODELS[name]()
    gm = fx.symbolic_trace(model.eval())
    with torch.no_grad():
        out = make_executor(gm, 3).run((x,), {}, 4)
        torch.testing.assert_close(out, gm(x))


def test_observed_order_is_valid() -> None:
    model, x = _cnn()
    gm = fx.symbolic_trace(model)
    stages = split_stages(gm, contiguous_stages(gm, 4), 4)
    workers = ["cpu:0", "cpu:1", "cpu:0", "cpu:2"]
    executor = PipelineExecutor(stages, ["cpu"] * 4, workers, GraphIO(gm), queue_size=1)
    run_guarded(lambda: executor.run((x,), {}, 8))
    trace = executor.last_trace
    assert sorted((mb, s) for _, mb, s in trace) == [(mb, s) for mb in range(8) for s in range(4)]
    for worker, mb, stage in trace:
        assert workers[stage] == worker
    for stage in range(4):
        assert [mb for _, mb, s in trace if s == stage] == list(range(8))
    for mb in range(8):
        assert [s for _, m, s in trace if m == mb] == list(range(4))
    order = worker_orders(8, [w for w, _ in segments(workers)])["cpu:0"]
    seg_of = {0: 0, 2: 2}
    assert [(mb, seg_of[s]) for w, mb, s in trace if w == "cpu:0"] == order


def test_grad_mode_propagates_to_workers() -> None:
    model, x = _mlp()
    gm = fx.symbolic_trace(model)
    executor = make_executor(gm, 2)
    assert executor.run((x,), {}, 2).requires_grad
    with torch.no_grad():
        assert not executor.run((x,), {}, 2).requires_grad


def test_microbatches_clamped_to_batch_size() -> None:
    model, x = _mlp()
    gm = fx.symbolic_trace(model)
    executor = make_executor(gm, 2)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="using 3"):
        out = executor.run((x[:3],), {}, 8)
    assert len({mb for _, mb, _ in executor.last_trace}) == 3
    with torch.no_grad():
        assert torch.equal(out, torch.cat([gm(c) for c in x[:3].tensor_split(3)]))


# ----------------------------------------------------------------------------------- export


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, bias: torch.Tensor) -> dict:
        h = torch.relu(self.a(x))
        g = self.b(h) * self.scale + bias
        return {"out": g, "pair": (h, y + 1)}


def test_exported_graph_with_pytree_inputs_and_outputs() -> None:
    x, y, bias = torch.randn(6, 4), torch.randn(6, 3), torch.randn(6, 8)
    model = DictModel()
    batch = {0: torch.export.Dim("batch", min=2, max=64)}
    dynamic = {"x": batch, "y": batch, "bias": batch}
    gm = torch.export.export(
        model, (x, y), {"bias": bias}, dynamic_shapes=dynamic, strict=False
    ).module()
    stage_of = contiguous_stages(gm, 3)
    executor = PipelineExecutor(split_stages(gm, stage_of, 3), ["cpu"] * 3, WORKERS, GraphIO(gm))
    with torch.no_grad():
        expected = model(x, y, bias=bias)
        for microbatches in (1, 3):
            out = run_guarded(partial(executor.run, (x, y), {"bias": bias}, microbatches))
            assert out.keys() == expected.keys()
            assert torch.equal(out["out"], expected["out"])
            assert torch.equal(out["pair"][0], expected["pair"][0])
            assert torch.equal(out["pair"][1], expected["pair"][1])


class SlicedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[:, :-1])  # a view with gaps (stride 8) read on the next device


def test_a_value_read_on_another_device_keeps_its_layout() -> None:
    """A copy on another device has the original's strides: the Linear reads x[:, :-1] as the
    model does, where a contiguous copy rounds differently (1.2e-7 here on the CPU)."""
    torch.manual_seed(10)
    model, x = SlicedLinear(), torch.randn(4, 8, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert not torch.equal(model.lin(x[:, :-1].contiguous()), model(x))  # the rounding this guards
        out = run_guarded(partial(make_executor(fx.symbolic_trace(model), 2, isolate=True).run, (x,), {}, 1))
    assert torch.equal(out, model(x))


@pytest.mark.parametrize("view", [
    lambda t: t[:, 1:],                       # gaps and an offset
    lambda t: t[1:],                          # dense, an offset inside the alignment
    lambda t: t.t(),                          # dense, transposed
    lambda t: t[:, ::2].t(),                  # gaps, transposed
    lambda t: t[:, :1].expand(-1, 3),         # elements overlap: copied contiguous
])
def test_copy_to_keeps_strides_and_the_offsets_alignment(view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    original = view(torch.arange(48, dtype=torch.float32).reshape(6, 8))
    copy = copy_to(original, torch.device("cpu"))
    assert torch.equal(copy, original) and copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
    if original.stride()[-1] != 0:
        assert copy.stride() == original.stride()
        assert copy.storage_offset() * 4 % ALIGNMENT == original.storage_offset() * 4 % ALIGNMENT
        assert copy.untyped_storage().nbytes() <= original.untyped_storage().nbytes()
    else:
        assert copy.is_contiguous()


class Pair(NamedTuple):
    h: torch.Tensor
    doubled: torch.Tensor


class Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple:
        h = self.a(x)
        return {"h": h, "y": self.b(h)}, [h, x * 2], Pair(h, h * 2)


def test_outputs_come_back_in_the_containers_the_model_returns() -> None:
    """fx keeps a graph's output as immutable_dict / immutable_list; the placed model returns the
    dict, list and namedtuple the model does, which the caller may change."""
    x = torch.randn(6, 4)
    model = Containers()
    gm = fx.symbolic_trace(model)
    executor = make_executor(gm, 2)
    with torch.no_grad():
        expected = model(x)
        for microbatches in (1, 3):
            out = run_guarded(partial(executor.run, (x,), {}, microbatches))
            assert [type(o) for o in out] == [dict, list, Pair]
            assert torch.equal(out[0]["y"], expected[0]["y"]) and torch.equal(out[1][1], expected[1][1])
            assert torch.equal(out[2].doubled, expected[2].doubled)
            out[0]["extra"], out[1][0] = 1, None  # as the caller may with the model's own output


def test_exported_transformer_encoder() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(4, 6, 32)
    batch = {0: torch.export.Dim("batch", min=2, max=64)}
    gm = torch.export.export(model, (x,), dynamic_shapes=(batch,), strict=False).module()
    executor = PipelineExecutor(
        split_stages(gm, contiguous_stages(gm, 3), 3), ["cpu"] * 3, WORKERS, GraphIO(gm)
    )
    with torch.no_grad():
        assert torch.equal(executor.run((x,), {}, 1), gm(x))
        assert torch.equal(
            executor.run((x,), {}, 2), torch.cat([gm(c) for c in x.tensor_split(2)])
        )


# ----------------------------------------------------------------------------------- errors


class Boom(nn.Module):
    """Adds one; raises ValueError on its ``fail_at``-th call (counting from 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError(f"boom on call {self.calls}")
        return x + 1


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.boom = Boom()
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.boom(torch.relu(self.a(x))) * 2)


class LeafTracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Boom) or super().is_leaf_module(m, qualname)


def _faulty_executor(fail_at: int) -> tuple[PipelineExecutor, Boom]:
    model = Faulty()
    gm = fx.GraphModule(model, LeafTracer().trace(model))
    stage_of = {n.name: 0 for n in compute_nodes(gm.graph)}
    stage_of["boom"], stage_of["mul"], stage_of["c"] = 1, 2, 2
    stages = split_stages(gm, stage_of, 3)
    executor = PipelineExecutor(stages, ["cpu"] * 3, WORKERS, GraphIO(gm), queue_size=1)
    boom = executor.stages[1].boom
    boom.fail_at = fail_at
    return executor, boom


def test_stage_error_on_first_microbatch() -> None:
    executor, _ = _faulty_executor(fail_at=1)
    with pytest.raises(StageError, match="stage 1 on cpu:1 failed on micro-batch 0: ValueError"):
        run_guarded(lambda: executor.run((torch.randn(4, 4),), {}, 1))


def test_stage_error_in_the_middle_of_a_run() -> None:
    executor, boom = _faulty_executor(fail_at=3)
    x = torch.randn(12, 4)
    with pytest.raises(StageError, match="stage 1 on cpu:1 failed on micro-batch 2") as info:
        run_guarded(lambda: executor.run((x,), {}, 6))
    assert isinstance(info.value.__cause__, ValueError)
    assert not executor._threads.busy()  # every worker stopped; their threads wait for the next run
    # the executor is usable again after a failure
    boom.fail_at = None
    with torch.no_grad():
        assert run_guarded(lambda: executor.run((x,), {}, 6)).shape == (12, 4)


def test_pipeline_workers_are_kept_across_runs_and_end_with_the_executor() -> None:
    """CUDA keeps per-thread state: a thread per call cost 18 ms per call on an H100 (runtime/workers.py)."""
    import gc

    gm = fx.symbolic_trace(MLP())
    stages = split_stages(gm, contiguous_stages(gm, 2), 2)
    executor = PipelineExecutor(stages, ["cpu", "cpu"], ["w0", "w1"], GraphIO(gm))
    def workers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("torchplace-pipeline-w")}

    before = workers()
    with torch.no_grad():
        executor.run((torch.randn(8, 16),), {}, 4)
        threads = workers() - before
        for _ in range(5):
            executor.run((torch.randn(8, 16),), {}, 4)
    assert workers() - before == threads  # one thread per worker, made once
    assert sorted(t.name for t in threads) == ["torchplace-pipeline-w0", "torchplace-pipeline-w1"]
    del executor
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


class SharedOnTwoDevices(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shared(x), self.shared(x[:, ::2])  # the second use reads a replica, on a strided 3-d input


def test_a_parameter_replica_requires_grad_as_its_home_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """aten::matmul picks its path for a non-contiguous input by the weight's requires_grad, even
    under no_grad: a replica that dropped it rounded differently (2.4e-7) from the model."""
    import torchplace
    from torchplace.plan import Plan, Stage

    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")  # a replica, as on a second GPU
    torch.manual_seed(0)
    model, x = SharedOnTwoDevices().eval(), torch.randn(4, 5, 8)
    with torch.no_grad():
        w = model.shared.weight
        assert not torch.equal(nn.functional.linear(x[:, ::2], w), nn.functional.linear(x[:, ::2], w.detach()))
    plan = Plan([Stage("cpu:0", ("linear",)), Stage("cpu:1", ("getitem", "linear_1"))], 0.0, 0.0, "user", 0.0)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, plan=plan, progress=False)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    placed.requires_grad_(False)  # frozen after a call: the replica is frozen too (found by fuzzing)
    out, expected = placed(x), model(x)
    assert not out[1].requires_grad and torch.equal(out[1], expected[1])
    placed.requires_grad_(True)
    assert placed(x)[1].requires_grad


def test_a_copy_of_a_sparse_view_is_dense():
    """x[:, 0] of BERT's hidden states kept its gaps: 448 times its bytes on the receiving device,
    which the memory model does not charge."""
    original = torch.randn(8, 64, 16)[:, 0]
    copy = copy_to(original, torch.device("cpu"))
    assert torch.equal(copy, original) and copy.stride() == (16, 1)
    assert copy.untyped_storage().nbytes() <= (original.numel() + ALIGNMENT // 4) * 4
    columns = torch.randn(16, 64)[:, :2].t()  # dense in the transposed order: kept so
    assert copy_to(columns, torch.device("cpu")).stride() == (1, 2)


class ChunkOfAStridedSlice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2).eval()
        self.bn.running_mean.uniform_(-1, 1)
        self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        half = x[:, ::2].chunk(2, dim=-1)  # a view 3.6 times its elements wide
        return self.bn(half[0]) * 2


def test_a_view_with_a_few_gaps_keeps_its_layout_on_another_device():
    """Found by fuzzing: BatchNorm read the dense copy of a chunk of a strided slice with other
    rounding (2.4e-7) than the view itself."""
    torch.manual_seed(0)
    model, x = ChunkOfAStridedSlice().eval(), torch.randn(4, 4, 8)
    gm = fx.symbolic_trace(model)
    names = [n.name for n in compute_nodes(gm.graph)]
    stage_of = {name: int(i >= names.index("bn")) for i, name in enumerate(names)}
    executor = PipelineExecutor(split_stages(gm, stage_of, 2), ["cpu", "cpu"], WORKERS[:2], GraphIO(gm), isolate=True)
    with torch.no_grad():
        assert torch.equal(run_guarded(partial(executor.run, (x,), {}, 1)), model(x))
