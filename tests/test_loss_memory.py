"""The training loss's memory (issue 17, item 4): measured from the loss given to place(),
assumed without one, charged on the device of the model's outputs, and the loss reused by step()."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchplace
from torchplace import costmodel
from torchplace.errors import UsageError
from torchplace.profiling.loss import ASSUMED_LOSS_FACTOR, assumed_loss_bytes, measure_loss_bytes

OUT = 16 * 512 * 4  # bytes of the model's output below


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 512))


def _mean_square(out, target):
    return out.pow(2).mean()


def _place(**options):
    return torchplace.place(_model(), ["cpu:0", "cpu:1"], (torch.randn(16, 8),), mode="training", optimizer="sgd",
                            microbatches=2, progress=False, warmup=0, repeats=1, allow_single_device=False, **options)


def test_a_losses_bytes_are_what_it_and_its_backward_hold_beyond_the_outputs():
    out = torch.randn(16, 512)
    # pow(2).mean(): the mean's gradient, pow's two temporaries and the outputs' gradient
    def about(n: int, outputs: int) -> bool:  # and a few scalars
        return outputs * OUT <= n < outputs * OUT + 256

    assert about(measure_loss_bytes(out, _mean_square, None), 4)
    assert about(measure_loss_bytes(out, lambda o, t: o.sum(), None), 1)  # only the outputs' gradient
    target = torch.randint(0, 512, (16,))
    assert about(measure_loss_bytes(out, nn.functional.cross_entropy, target), 3)  # log-softmax, its gradient, the outputs'
    assert out.grad is None  # measured on copies


def test_measuring_a_loss_leaves_the_gradients_of_what_it_reads():
    """The loss's backward accumulated into a parameter the loss reads (a learned temperature,
    weight decay written in the loss): the first step after place() applied it twice (found by fuzzing)."""
    temperature = nn.Parameter(torch.tensor(2.0))
    out = torch.randn(16, 512)
    bytes_ = measure_loss_bytes(out, lambda o, t: (o / temperature).pow(2).mean(), None)
    assert temperature.grad is None and bytes_ >= OUT  # the outputs' gradient was still taken


def test_place_measures_the_given_loss_and_assumes_one_without_it():
    placed = _place(loss_fn=_mean_square, example_target=torch.zeros(16))
    assert placed.problem.graph.meta["loss_bytes"] == measure_loss_bytes(torch.randn(16, 512), _mean_square, None)
    assumed = _place()
    assert assumed.problem.graph.meta["loss_bytes"] == assumed_loss_bytes(assumed.problem.graph) \
        == ASSUMED_LOSS_FACTOR * OUT


def test_the_loss_is_charged_on_the_device_of_the_outputs_and_step_reuses_it():
    placed = _place(loss_fn=_mean_square)
    parts = costmodel.device_memory_parts(placed.problem, placed.plan.stages)
    g = placed.problem.graph
    makers = {v for v, r in g.records() if not r.backward and set(g.meta["outputs"]) & set(r.fx_nodes)}
    last = next(s.device for s in placed.plan.stages if makers & set(s.nodes))
    per_microbatch = -(-OUT // 2)
    assert parts[last]["working"] >= per_microbatch + 4 * per_microbatch  # the outputs' and the loss's
    placed.train()
    losses = placed.step(torch.randn(16, 8), target=None)  # place()'s loss_fn
    assert len(losses) == 2 and all(loss.dim() == 0 for loss in losses)


def test_loss_errors_say_what_to_do():
    with pytest.raises(UsageError, match="loss_fn is the training loss"):
        torchplace.place(_model(), ["cpu:0"], (torch.randn(16, 8),), loss_fn=_mean_square, progress=False)
    with pytest.raises(UsageError, match="give loss_fn too"):
        _place(example_target=torch.zeros(16))
    # the other training options were dropped silently for inference (a forgotten mode='training')
    for options, named in (({"schedule": "gpipe"}, "schedule='gpipe' is a training option"),
                           ({"optimizer": "sgd", "recompute": False}, "optimizer='sgd', recompute=False are training options")):
        with pytest.raises(UsageError, match=f"{named} .*pass mode='training'"):
            torchplace.place(_model(), ["cpu:0"], (torch.randn(16, 8),), progress=False, **options)
    with pytest.raises(UsageError, match="loss_fn fails on the model's outputs.*ValueError: no"):
        _place(loss_fn=lambda out, target: (_ for _ in ()).throw(ValueError("no")))
    with pytest.raises(UsageError, match="scalar tensor"):
        _place(loss_fn=lambda out, target: out)
    model = _model()  # optimizer= names the memory model's optimizer: an optimizer object said "expected a number"
    with pytest.raises(UsageError, match=r"not an optimizer object \(SGD: .*; pass optimizer='momentum'"):
        torchplace.place(model, ["cpu:0"], (torch.randn(16, 8),), mode="training", progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    placed = _place()
    placed.train()
    with pytest.raises(UsageError, match="step\\(\\) needs a loss"):
        placed.step(torch.randn(16, 8), target=None)


def test_measure_with_a_target_times_steps_with_place_s_loss():
    placed = _place(loss_fn=_mean_square)
    placed.train()
    placed.zero_grad(set_to_none=True)
    m = placed.measure(torch.randn(16, 8), target=torch.zeros(16), runs=1, warmup=0)
    assert {s.kind for s in m.stages} == {"F", "B"}  # a training step ran, with place()'s loss
    assert all(p.grad is None for p in placed.parameters())  # and its gradients were undone
    without = _place()
    without.train()
    with pytest.raises(UsageError, match="a target measures a training step, which needs a loss"):
        without.measure(torch.randn(16, 8), target=torch.zeros(16), runs=1, warmup=0)
