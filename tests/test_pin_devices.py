"""Device constants recorded at trace time follow the device a piece of graph is placed on."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from torchplace.fxutil import pin_devices
from torchplace.models import build
from torchplace.profiling.trace import trace


def _device_constants(gm: fx.GraphModule) -> set[torch.device]:
    found: set[torch.device] = set()
    for node in gm.graph.nodes:
        fx.node.map_aggregate((node.args, node.kwargs), lambda v: found.add(v) if isinstance(v, torch.device) else v)
    return found


def test_exported_gpt2_runs_on_another_device_once_pinned() -> None:
    pytest.importorskip("transformers")
    model, (ids,) = build("gpt2", batch=2)
    gm = trace(model.eval(), (ids,), method="export").gm
    assert torch.device("cpu") in _device_constants(gm)  # arange(..., device=cpu) and friends
    moved = copy.deepcopy(gm).to("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):  # without pinning: tensors built on the CPU
        moved(ids.to("meta"))
    assert pin_devices(moved, torch.device("meta")) > 0
    assert _device_constants(moved) == {torch.device("meta")}
    out = moved(ids.to("meta"))
    assert all(t.device.type == "meta" for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    assert pin_devices(moved, torch.device("meta")) == 0  # idempotent


def test_string_and_object_device_keywords_are_pinned() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            return x + torch.zeros(n, device="cpu") + torch.full((n,), 2.0, device=torch.device("cpu")) + torch.ones(3)

    gm = fx.symbolic_trace(M()).to("meta")  # fx keeps ones(3) as a buffer, which .to() moves
    assert pin_devices(gm, torch.device("meta")) == 2
    assert gm(torch.ones(3, device="meta")).device.type == "meta"
    assert pin_devices(fx.symbolic_trace(M()), torch.device("cpu")) == 0  # already there


def test_plain_tensor_constants_move_with_the_graph() -> None:
    """A constant that is neither parameter nor buffer (as torch.export may leave them)."""
    gm = fx.symbolic_trace(nn.Linear(3, 3))
    gm.scale = torch.full((3,), 2.0)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out), pytest.warns(UserWarning, match="no underlying reference"):
        scale = gm.graph.get_attr("scale")  # fx warns: a plain attribute, as export's constants are
        out.replace_input_with(out.args[0], gm.graph.call_function(torch.mul, (out.args[0], scale)))
    gm.recompile()
    moved = gm.to("meta")
    assert moved.scale.device.type == "cpu"
    assert pin_devices(moved, torch.device("meta")) == 1
    assert moved(torch.ones(2, 3, device="meta")).device.type == "meta"
