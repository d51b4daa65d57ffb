"""Backward profiling part by part (issue 17 item 6): a device other than the CPU never receives
the whole model; each node's part is copied there. The CPU runs the same path with parts=True."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from torchplace.graph import saved_key, union_of_saved
from torchplace.models import build, leaf_modules_for
from torchplace.profiling import training as training_profile
from torchplace.profiling.trace import trace


def _traced(name: str, leaves: tuple = ()):
    model, inputs = build(name, batch=4)
    model.train()
    with torch.no_grad():
        traced = trace(model, inputs, {}, granularity="module" if name in ("gpt2", "bert") else "operator",
                       leaf_modules=leaves or (leaf_modules_for(name) if name in ("gpt2", "bert") else ()),
                       training=True)
    return model, traced, inputs


@pytest.mark.parametrize(("name", "leaves"), [("mlp", ()), ("mlp", (nn.Linear,)), ("resnet", ()),
                                              ("transformer", ()), ("gpt2", ())])
def test_part_by_part_saves_and_sends_the_same_bytes(name, leaves):
    """Weights read through get_attr and modules called as leaves (copied for their node) alike."""
    model, traced, inputs = _traced(name, leaves)
    if leaves:
        assert sum(n.op == "call_module" for n in traced.gm.graph.nodes) >= 2
    state = {k: v.clone() for k, v in model.state_dict().items()}
    whole = training_profile.measure_backward(traced, inputs, kind="cpu", warmup=0, repeats=1, progress=False)
    parts = training_profile.measure_backward(traced, inputs, kind="cpu", warmup=0, repeats=1, progress=False,
                                              parts=True)
    assert parts.keys() == whole.keys() and whole
    assert {n: (c.saved_bytes, c.grad_bytes) for n, c in parts.items()} == {
        n: (c.saved_bytes, c.grad_bytes) for n, c in whole.items()}
    assert any(c.seconds > 0 for c in parts.values())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # buffers restored


def test_the_model_is_never_copied_whole(monkeypatch):
    model, traced, inputs = _traced("resnet")
    copied = []
    real = copy.deepcopy
    monkeypatch.setattr(training_profile.copy, "deepcopy", lambda x, *a: copied.append(type(x)) or real(x, *a))
    training_profile.measure_backward(traced, inputs, kind="cpu", warmup=0, repeats=1, progress=False, parts=True)
    assert copied and not any(issubclass(t, fx.GraphModule) for t in copied)
    assert all(t.__name__ != type(model).__name__ for t in copied)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backward_leaves_the_model_on_the_cpu():
    model, traced, inputs = _traced("resnet")
    torch.cuda.reset_peak_memory_stats()
    costs = training_profile.measure_backward(traced, inputs, kind="cuda", warmup=0, repeats=1, progress=False)
    assert costs and all(p.device.type == "cpu" for p in model.parameters())
    assert all(p.device.type == "cpu" for p in traced.gm.parameters())


@pytest.mark.parametrize("sharing", [False, True], ids=["exhaustive", "by-signature"])
def test_forward_timing_on_a_device_copies_parts_only(monkeypatch, sharing):
    """The forward timers' device path (run here with device=cpu): the graph's output is the
    model's, every compute node is timed, and only called modules are copied, never the model."""
    import importlib

    from torchplace.fxutil import is_compute

    profile_module = importlib.import_module("torchplace.profiling.profile")  # the package exports profile()

    model, traced, inputs = _traced("mlp", (nn.Linear,))
    copied = []
    real = copy.deepcopy
    monkeypatch.setattr(profile_module.copy, "deepcopy", lambda x, *a: copied.append(type(x)) or real(x, *a))
    cpu = torch.device("cpu")
    if sharing:
        interp = profile_module._SharingInterpreter(traced.gm, profile_module._CpuTimer, cpu, 0, 1)
    else:
        interp = profile_module._TimingInterpreter(traced.gm, profile_module._CpuTimer(), cpu)
    with torch.no_grad():
        out = interp.run(*traced.flat_inputs(inputs, {}))
        expected = traced.gm(*traced.flat_inputs(inputs, {}))
    assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(out), pytree.tree_leaves(expected)))
    timed = interp.times if sharing else interp.timer.elapsed()
    assert set(timed) == {n.name for n in traced.gm.graph.nodes if is_compute(n)}
    assert copied and all(t is nn.Linear for t in copied)


def test_a_batch_norm_in_training_is_timed_and_what_it_saves_counted():
    """Training batch norm writes its running statistics: the probe copies its inputs, and once made
    those copies without grad, so its backward was never timed and nothing counted as saved. Its
    input is saved under the producing convolution's key; the running statistics are not saved
    activations (nor take a gradient: autograd refuses one for them)."""
    model, traced, inputs = _traced("resnet")
    costs = training_profile.measure_backward(traced, inputs, kind="cpu", warmup=0, repeats=1, progress=False)
    norms = [n for n in traced.gm.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]
    assert norms
    for n in norms:
        producer = n.args[0]
        value = producer.meta["val"]
        assert costs[n.name].seconds > 0
        assert costs[n.name].saved_parts[saved_key(producer.name, 0)] == value.numel() * value.element_size()
        # beside the input only the batch statistics it computes (two per channel), no running ones
        assert costs[n.name].saved_bytes - value.numel() * value.element_size() <= 2 * value.shape[1] * 4


def test_a_tensor_saved_by_two_nodes_has_one_key():
    """A ReLU saves its output and the linear reading it saves its input: the same storage, one key."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).train()
    x = torch.randn(4, 8)
    traced = trace(model, (x,), {}, training=True)
    costs = training_profile.measure_backward(traced, (x,), kind="cpu", warmup=0, repeats=1, progress=False)
    relu = next(n for n in traced.gm.graph.nodes if "relu" in n.name)
    after = next(iter(relu.users))
    assert costs[relu.name].saved_parts == {saved_key(relu.name, 0): 4 * 8 * 4}
    assert costs[after.name].saved_parts == {saved_key(relu.name, 0): 4 * 8 * 4}
    graph_parts = union_of_saved([costs[relu.name].saved_parts, costs[after.name].saved_parts])
    assert sum(graph_parts.values()) == 4 * 8 * 4
