"""torch.autocast around a placed model's call or step reaches its stages: autocast is
thread-local, like the grad mode, and the stages run on worker threads (found by fuzzing: the
placed model computed in float32 under autocast, silently)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchplace

OPTIONS = dict(progress=False, repeats=1, warmup=0, time_limit=5, allow_single_device=False)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize("objective", ["throughput", "latency"])
@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_a_call_under_autocast_computes_as_the_model_does(trace_method: str, objective: str) -> None:
    model = _model().eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method=trace_method,
                              objective=objective, **OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = placed(x), reference(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    with torch.no_grad():
        assert placed(x).dtype == torch.float32  # and only under it


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_a_training_step_under_autocast_gives_the_model_s_loss_and_gradients(trace_method: str) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss_fn = nn.functional.cross_entropy
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=1, loss_fn=loss_fn,
                              example_target=y, trace_method=trace_method, **OPTIONS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss,) = placed.step(x, target=y)
        expected = loss_fn(reference(x), y)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
