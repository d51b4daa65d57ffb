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


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).view(-1) * 2


class _WritesThroughView(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        z = y.view(-1)
        z.add_(1)  # writes y through its view
        return y


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_view_the_traced_strides_allowed_survives_other_strides(method) -> None:
    # found on an H100: nn.MultiheadAttention traced on the CPU views a tensor that CUDA's
    # attention returns with other strides; here a transposed input stands in for those strides
    x = torch.randn(3, 4)
    gm = trace(_Flatten(), (x,), method=method).gm
    other = torch.randn(4, 3).t()  # same shape, strides that relu keeps and view refuses
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        torch.relu(other).view(-1)
    assert torch.equal(gm(other), torch.relu(other).reshape(-1) * 2)
    assert torch.equal(gm(x), _Flatten()(x))  # where view works, reshape is that view: the same bits


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_view_that_is_written_through_stays_a_view(method) -> None:
    x = torch.randn(3, 4)
    gm = trace(_WritesThroughView(), (x,), method=method).gm
    views = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.view.default, "view")]
    reshapes = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.reshape.default, "reshape")]
    assert not reshapes and (views or method == "export")  # export may functionalise the write away
    assert torch.equal(gm(x), x + 1)
