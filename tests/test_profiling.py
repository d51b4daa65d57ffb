"""Tests of torchplace.profiling: tracing is transparent, the OpGraph is a sound DAG, costs add up."""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny GPT-2 is built from a config, offline

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchplace.errors import TraceError
from torchplace.fxutil import is_compute
from torchplace.models import NAMES, ResidualBlock, build
from torchplace.profiling import DEVICE_SPECS, Traced, estimate_times, profile, trace

pytestmark = pytest.mark.usefixtures("mha_fastpath_off")

MODELS = [
    "mlp",
    "resnet",
    "transformer",
    "gpt2",
]
GRANULARITIES = ("operator", "module")
_CACHE: dict[tuple[str, str], tuple[nn.Module, tuple, Traced]] = {}


def traced_model(name: str, granularity: str) -> tuple[nn.Module, tuple, Traced]:
    """Build and trace an example model once per (name, granularity)."""
    if (name, granularity) not in _CACHE:
        model, inputs = build(name)
        _CACHE[name, granularity] = (model, inputs, trace(model, inputs, granularity=granularity))
    return _CACHE[name, granularity]


def unique_tensor_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, shared (tied) tensors counted once."""
    tensors = {t.untyped_storage().data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def assert_same_outputs(expected, actual) -> None:
    """Same pytree structure and bitwise-equal tensors."""
    e_leaves, e_spec = pytree.tree_flatten(expected)
    a_leaves, a_spec = pytree.tree_flatten(actual)
    assert type(expected) is type(actual)
    assert e_spec == a_spec
    assert all(torch.equal(e, a) for e, a in zip(e_leaves, a_leaves))


def assert_covers_graph(traced: Traced) -> None:
    """Every compute fx node is in exactly one OpGraph node, and nothing else is."""
    covered = [n for _, r in traced.graph.records() for n in r.fx_nodes]
    compute = [n.name for n in traced.gm.graph.nodes if is_compute(n)]
    assert sorted(covered) == sorted(compute)
    assert len(covered) == len(set(covered))


def expected_edges(traced: Traced) -> set[tuple[str, str]]:
    """u -> v iff an fx node of v reads an fx node of u (recomputed from the fx graph)."""
    owner = {fx: nid for nid, r in traced.graph.records() for fx in r.fx_nodes}
    return {
        (owner[a.name], owner[n.name])
        for n in traced.gm.graph.nodes if n.name in owner
        for a in n.all_input_nodes if a.name in owner and owner[a.name] != owner[n.name]
    }


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", MODELS)
def test_trace_is_transparent_and_sound(name: str, granularity: str) -> None:
    model, inputs, traced = traced_model(name, granularity)
    with torch.no_grad():
        assert_same_outputs(model(*inputs), traced.gm(*inputs))
    traced.graph.check_dag()
    assert_covers_graph(traced)
    assert set(traced.graph.edges) == expected_edges(traced)
    assert traced.method in ("fx", "export")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", MODELS)
def test_param_bytes_counted_once(name: str, granularity: str) -> None:
    model, _, traced = traced_model(name, granularity)
    attributed = sum(r.param_bytes for _, r in traced.graph.records())
    state = traced.graph.meta["state"]
    assert attributed == sum(e["bytes"] for e in state.values())  # each tensor on exactly one owner
    assert unique_tensor_bytes(model) <= attributed  # every model tensor, read or not (plus constants)
    unread = [n for n, e in state.items() if not e["readers"]]
    if name in ("mlp", "gpt2"):  # every tensor is read in eval mode; GPT-2's tied lm_head once
        assert unread == []
    assert all(state[n]["owner"] in traced.graph for n in unread)


def test_gpt2_tied_weight_on_first_user() -> None:
    model, _, traced = traced_model("gpt2", "module")
    assert model.lm_head.weight is model.transformer.wte.weight
    by_module = {r.module: r for _, r in traced.graph.records()}
    assert by_module["transformer.wte"].param_bytes == model.lm_head.weight.nbytes
    assert by_module["lm_head"].param_bytes == 0


def test_sizes_come_from_shapes() -> None:
    model, inputs, traced = traced_model("mlp", "module")
    last = traced.graph.record(traced.graph.topological_order()[-1])
    assert last.output_bytes == model(*inputs).nbytes == last.temp_bytes
    assert last.op == "call_module:Linear" and last.module == "net.6"
    assert traced.graph.meta["inputs"] == ["x"]


@pytest.mark.parametrize(
    "name, leaf",
    [("resnet", ResidualBlock), ("transformer", nn.TransformerEncoderLayer), ("gpt2", "GPT2Block")],
)
def test_leaf_modules_coarsen(name: str, leaf) -> None:
    if isinstance(leaf, str):
        leaf = getattr(importlib.import_module("transformers.models.gpt2.modeling_gpt2"), leaf)
    model, inputs, fine = traced_model(name, "operator")
    coarse = trace(model, inputs, granularity="module", leaf_modules=(leaf,))
    assert len(coarse.graph) < len(fine.graph)
    assert_covers_graph(coarse)
    coarse.graph.check_dag()
    with torch.no_grad():
        assert_same_outputs(model(*inputs), coarse.gm(*inputs))
    leaf_nodes = [r for _, r in coarse.graph.records() if r.op == f"call_module:{leaf.__name__}"]
    assert len(leaf_nodes) == 2


class SharedTwice(nn.Module):
    """Calls one Linear twice around an op outside it: grouping by instance makes a cycle."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


def test_grouping_cycle_is_merged() -> None:
    model, x = SharedTwice().eval(), torch.randn(2, 8)
    traced = trace(model, (x,), granularity="module", method="export")
    traced.graph.check_dag()
    assert_covers_graph(traced)
    merged = [r for _, r in traced.graph.records() if r.op.startswith("group:")]
    assert len(merged) == 1
    # linear, relu, linear_1 on the cycle; export's guard node (consumed by nobody) folded in
    assert set(merged[0].fx_nodes) == {"linear", "relu", "linear_1", "_guards_fn"}
    assert merged[0].name == "lin+relu"
    assert torch.equal(traced.gm(x), model(x))


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python control flow: fx cannot trace it
            return x * 2
        return x - 1


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.lin(x))


def test_untraceable_model_raises_trace_error() -> None:
    model, x = Gated().eval(), torch.randn(2, 4)
    with pytest.raises(TraceError, match="leaf_modules") as info:
        trace(model, (x,), method="fx")
    msg = str(info.value)
    assert "gate" in msg and "Gate" in msg and "method='export'" in msg
    assert info.value.__cause__ is not None


def test_auto_reports_both_methods() -> None:
    model, x = Gated().eval(), torch.randn(2, 4)
    with pytest.raises(TraceError, match="leaf_modules=\\(Gate,\\)") as info:
        trace(model, (x,), method="auto")
    assert "fx failed in gate" in str(info.value) and "export failed" in str(info.value)


def test_a_failed_export_prints_no_partial_graph_and_passes_other_output_on(capfd) -> None:
    """torch.export printed the partial graph of a failed export to stderr, twice per try (its
    wrapper is nested), before torchplace's TraceError: hundreds of lines for a transformer. A
    batch norm without momentum reads its counter as a Python float, which export cannot trace."""
    import sys

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU()).train()
    with pytest.raises(TraceError, match=r"leaf_modules=\(BatchNorm1d,\)"):
        trace(model, (torch.randn(8, 8),), method="auto")
    err = capfd.readouterr().err
    assert "def forward(self" not in err and "aten.linear" not in err, err

    from torchplace.profiling.trace import _without_partial_graph

    with _without_partial_graph():
        print("a warning written meanwhile", file=sys.stderr)
    with pytest.raises(ValueError), _without_partial_graph():
        print("written before the failure", file=sys.stderr)
        raise ValueError("no partial graph here")
    err = capfd.readouterr().err
    assert "a warning written meanwhile" in err and "written before the failure" in err


def test_leaf_module_makes_untraceable_model_traceable() -> None:
    model, x = Gated().eval(), torch.randn(2, 4)
    traced = trace(model, (x,), method="fx", leaf_modules=(Gate,))
    assert traced.method == "fx"
    assert torch.equal(traced.gm(x), model(x))


def test_bad_arguments() -> None:
    model, inputs = build("mlp")
    with pytest.raises(ValueError, match="granularity"):
        trace(model, inputs, granularity="layer")
    with pytest.raises(ValueError, match="method"):
        trace(model, inputs, method="jit")
    with pytest.raises(ValueError, match="unknown example model"):
        build("vgg")
    assert set(NAMES) == {"mlp", "resnet", "inception", "transformer", "gpt2", "bert"}


def test_trace_is_deterministic() -> None:
    model, inputs = build("resnet")
    a, b = trace(model, inputs), trace(model, inputs)
    assert a.graph == b.graph
    assert a.graph.topological_order() == b.graph.topological_order()


@pytest.mark.parametrize("name", MODELS)
def test_profile_fills_cpu_times(name: str) -> None:
    _, inputs, traced = traced_model(name, "module")
    graph = profile(traced, inputs, warmup=1, repeats=2, progress=False)
    assert graph is not traced.graph
    assert list(graph) == list(traced.graph) and set(graph.edges) == set(traced.graph.edges)
    assert all(r.times == {} for _, r in traced.graph.records())  # the input graph is untouched
    for _, r in graph.records():
        t = r.times["cpu"]
        assert math.isfinite(t) and t >= 0
        if r.output_bytes > 0:
            assert t > 0


def test_profile_estimates_absent_kinds() -> None:
    _, inputs, traced = traced_model("mlp", "operator")
    graph = profile(traced, inputs, kinds=("cpu", "accel"), warmup=0, repeats=1, progress=False)
    assert graph.device_kinds() == {"cpu", "accel"}
    assert all(r.times["accel"] >= DEVICE_SPECS["accel"].overhead for _, r in graph.records())
    with pytest.raises(ValueError, match="known kinds"):
        profile(traced, inputs, kinds=("tpu",), progress=False)


def test_estimate_cuda_is_positive_and_grows_with_work() -> None:
    _, inputs, traced = traced_model("mlp", "operator")
    times = estimate_times(traced, inputs, "cuda")
    assert set(times) == set(traced.graph) and all(t > 0 for t in times.values())
    big_model, big_inputs = build("mlp", batch=512)
    big = estimate_times(trace(big_model, big_inputs), big_inputs, "cuda")
    assert sum(big.values()) > sum(times.values())


def test_profile_does_not_swallow_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    # the package re-exports the function `profile`, which shadows the module of that name
    prof = importlib.import_module("torchplace.profiling.profile")

    def interrupt(self, n):
        raise KeyboardInterrupt

    _, inputs, traced = traced_model("mlp", "operator")
    monkeypatch.setattr(prof._TimingInterpreter, "run_node", interrupt)
    with pytest.raises(KeyboardInterrupt):
        profile(traced, inputs, progress=False)


_CTRL_C_IN_EXPORT_IMPORT = """
import importlib.abc, signal, sys
import torch
from torch import nn
from torchplace.profiling import trace

class CtrlCOnImport(importlib.abc.MetaPathFinder):  # Ctrl-C while torch._dynamo imports its eval_frame
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo.eval_frame":
            sys.meta_path.remove(self)
            signal.raise_signal(signal.SIGINT)

class Net(nn.Module):  # fx stops at BatchNorm1d's input check: traced with torch.export
    def __init__(self):
        super().__init__()
        self.a, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8) if sys.argv[1] == "export" else nn.ReLU()
    def forward(self, x):
        return self.bn(self.a(x))

assert "torch._dynamo" not in sys.modules, "torch.export was imported before the test"
sys.meta_path.insert(0, CtrlCOnImport())
try:
    trace(Net().eval(), (torch.randn(4, 8),))
    sys.exit("no KeyboardInterrupt")
except KeyboardInterrupt:
    pass
print(trace(Net().eval(), (torch.randn(4, 8),)).method)
"""


@pytest.mark.parametrize("method", ["export", "fx"])
def test_ctrl_c_while_torch_internals_are_first_imported_leaves_later_traces_working(method: str) -> None:
    """Ctrl-C in the 2 s that the first export or fx Interpreter run spends importing torch._dynamo left it half
    imported, and every later place() in the process failed with a TraceError ('partially initialized module')
    (found by fuzzing). A fresh interpreter, bounded by a timeout; the SIGINT is sent while torch._dynamo imports."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _CTRL_C_IN_EXPORT_IMPORT, method], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(root)))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [method]


def test_shape_only_and_dead_end_nodes_are_folded() -> None:
    """GPT-2's mask computation (shape-only ops) and export's asserts fold into their neighbours:
    the graph stays a DAG, covers every compute node once, and keeps the two blocks whole."""
    leaf = importlib.import_module("transformers.models.gpt2.modeling_gpt2").GPT2Block
    model, inputs = build("gpt2")
    traced = trace(model, inputs, granularity="module", leaf_modules=(leaf,))
    traced.graph.check_dag()
    assert_covers_graph(traced)
    names = [r.name for _, r in traced.graph.records()]
    assert names.count("transformer.h.0") == names.count("transformer.h.1") == 1
    assert not any("assert" in r.op or "arange" in r.op for _, r in traced.graph.records())
    assert len(traced.graph) <= 12


class TakesKeywords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x, **kwargs):
        return self.b(self.a(x)) * kwargs.get("scale", 1.0)


@pytest.mark.parametrize("extra", [{}, {"scale": 2.0}])
def test_a_forward_with_var_keywords_is_traced_by_fx(extra):
    """fx binds `**kwargs` to a placeholder its Interpreter fed a list: place() failed with an
    untyped AttributeError ('list' object has no attribute 'get'), keywords or not (found by fuzzing)."""
    model, x = TakesKeywords().eval(), torch.randn(4, 8)
    import torchplace

    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), example_kwargs=extra, microbatches=1,
                              allow_single_device=False, progress=False, warmup=0, repeats=1, time_limit=2)
    with torch.no_grad():
        assert torch.equal(placed(x, **extra), model(x, **extra))


def test_keywords_export_cannot_trace_through_var_keywords_are_named_with_the_fix():
    from torchplace.errors import TraceError

    with pytest.raises(TraceError, match=r"through \*\*kwargs \('scale'\).*set them in the model"):
        trace(TakesKeywords().eval(), (torch.randn(4, 8),), {"scale": 2.0}, method="export")


def test_planning_on_the_example_clusters_kinds_and_an_unknown_kind():
    from pathlib import Path

    import torchplace
    from torchplace.clusterfile import load_cluster
    from torchplace.devices import Cluster, Device
    from torchplace.errors import UsageError

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(2, 64)
    cluster = load_cluster(Path(__file__).parents[1] / "examples" / "clusters" / "two-gpus-and-cpu.json")
    plan, problem = torchplace.plan_model(model, cluster, (x,), objective="latency")  # kind "cuda-t4": was a ValueError
    assert all(r.times["cuda-t4"] > r.times["cuda"] for _, r in problem.graph.records() if r.times["cuda"] > 1e-5)
    with pytest.raises(UsageError, match="no device spec for kind 'npu'.*known kinds"):
        torchplace.plan_model(model, Cluster((Device("a", "meta", "npu"),)), (x,), objective="latency")
