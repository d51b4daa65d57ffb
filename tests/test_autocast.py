"""torch.autocast around a placed model's call or step reaches its stages: autocast is
thread-local, like the grad mode, and the stages run on worker threads (found by fuzzing: the
placed model computed in float32 under autocast, silently)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchplace
from torchplace.errors import UnsupportedError

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


class AutocastInside(nn.Module):
    """Runs its middle layer under autocast, as mixed-precision code written into a model does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.b(h))
        return self.c(h.float())


def test_an_autocast_region_in_forward_is_traced_by_export():
    """fx runs a `with torch.autocast` block at trace time and records nothing of it: "auto" kept
    the fx trace, whose region ran in float32, and the checks refused the model with a TraceError
    that blamed hooks (found by fuzzing). Such a forward is now an fx failure, and export traces it."""
    torch.manual_seed(0)
    model = AutocastInside()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=1,
                              loss_fn=nn.functional.mse_loss, example_target=y, **OPTIONS)
    assert placed._traced.method == "export"
    (loss,) = placed.step(x, target=y)
    expected = nn.functional.mse_loss(reference(x), y)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


class AddsPositions(nn.Module):
    """``h += self.pos``: in place, autocast keeps ``h`` in bfloat16; fx ran it as ``h = h + pos``,
    which promoted it to float32, silently (found by fuzzing)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(16, 32), nn.Linear(32, 4)
        self.pos = nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h += self.pos
        return self.head(torch.relu(h))


def test_an_augmented_assignment_keeps_its_dtype_under_autocast() -> None:
    torch.manual_seed(0)
    model = AddsPositions()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss_fn = nn.functional.cross_entropy
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=1, loss_fn=loss_fn,
                              example_target=y, trace_method="fx", **OPTIONS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (loss,) = placed.step(x, target=y)
        expected = loss_fn(reference(x), y)
    expected.backward()
    assert torch.equal(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


class CastsForItsNorm(nn.Module):
    """An RMSNorm-style ``h.to(torch.float32)``: a no-op without autocast, which export records as a
    dtype check; under autocast the placed graph failed on it, and T5's gradients differed silently
    (found by fuzzing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * torch.rsqrt(h.to(torch.float32).pow(2).mean(-1, keepdim=True) + 1e-6).type_as(h)
        return self.b(h)


def test_an_exported_graph_with_dtype_checks_is_refused_under_autocast() -> None:
    torch.manual_seed(0)
    model = CastsForItsNorm()
    x = torch.randn(8, 16)
    placed = torchplace.place(model.eval(), ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="export",
                              **OPTIONS)
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))  # without autocast: exact
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match="dtype conversions"):
            placed(x)
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match="dtype conversions"):
            torchplace.place(copy.deepcopy(model), ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="export",
                             **OPTIONS)
    fx = torchplace.place(copy.deepcopy(model), ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="fx",
                          **OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # fx records the conversions as calls
        assert torch.equal(fx(x), model(x))


class FullPrecisionRegion(nn.Module):
    """A ``with torch.autocast("cpu", enabled=False)`` region holding a ``.float()`` that converts
    nothing without autocast: export puts the region in a ``wrap_with_autocast`` subgraph, and its
    dtype check there was not looked for."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.autocast("cpu", enabled=False):
            h = torch.relu(self.b(h.float()))
        return self.c(h)


def test_a_dtype_check_inside_an_autocast_region_is_refused_under_autocast() -> None:
    """The call under autocast failed inside a stage with a raw 'Tensor dtype mismatch' StageError
    (found by fuzzing); the check in the region's subgraph now gets the UnsupportedError before any
    stage runs."""
    torch.manual_seed(0)
    model = FullPrecisionRegion().eval()
    x = torch.randn(8, 16)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, **OPTIONS)
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))  # without autocast: exact
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match="dtype conversions"):
            placed(x)


def test_the_refusal_under_autocast_names_a_way_that_runs() -> None:
    """The refusal said to trace with fx, which cannot trace a forward that enters torch.autocast
    itself; fx with that module kept whole runs under autocast as the model does (found by fuzzing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), FullPrecisionRegion()).eval()
    x = torch.randn(8, 16)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="export", **OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(UnsupportedError, match=r"trace_method='fx', with the modules fx cannot trace .* kept whole "
                                                   r"by leaf_modules"):
            placed(x)
        expected = model(x)
    advised = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="fx",
                               leaf_modules=[FullPrecisionRegion], **OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(advised(x), expected)


class MakesABias(nn.Module):
    """``torch.full(..., dtype=h.dtype)``: under autocast ``h`` is bfloat16, and so is the bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.relu(self.a(x)))
        return h * 3 + torch.full((h.shape[-1],), 0.1, dtype=h.dtype)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_dtype_an_exported_graph_read_from_a_tensor_is_refused_under_autocast(mode: str) -> None:
    """export records ``dtype=h.dtype`` as the float32 it saw: under autocast the placed model made a
    float32 bias, returned float32 outputs where the model's are bfloat16, and its loss and gradients
    differed, silently (found by probing). fx reads the dtype at run time and computes as the model does."""
    torch.manual_seed(0)
    model = MakesABias().train(mode == "training")
    x, y = torch.randn(8, 16), torch.randn(8, 32)
    extra = dict(loss_fn=nn.functional.mse_loss, example_target=y) if mode == "training" else {}
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode=mode, microbatches=1, trace_method="export",
                              **extra, **OPTIONS)
    call = (lambda: placed.step(x, target=y)) if mode == "training" else (lambda: placed(x))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match=r"dtype=h\.dtype"):
        call()
    fx = torchplace.place(copy.deepcopy(model), ["cpu:0", "cpu:1"], (x,), microbatches=1, trace_method="fx", **OPTIONS)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = fx(x), model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


class MasksWithTheLimit(nn.Module):
    """``masked_fill(mask, torch.finfo(s.dtype).min)``: under autocast ``s`` and its limit are bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ x.transpose(-1, -2)
        s = s.masked_fill(~mask.unsqueeze(1), torch.finfo(s.dtype).min)
        return self.o(s.softmax(-1) @ x)


def test_a_dtype_limit_an_exported_graph_holds_as_a_number_is_refused_under_autocast() -> None:
    """export records float32's ``finfo.min`` as a number: under autocast the placed call failed in a
    stage with a raw 'cannot be converted to type c10::BFloat16 without overflow' (found by probing)."""
    torch.manual_seed(0)
    model = MasksWithTheLimit().eval()
    x, mask = torch.randn(4, 6, 16), torch.ones(4, 6, dtype=torch.bool)
    mask[2, 3:] = False
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x, mask), microbatches=1, **OPTIONS)
    assert placed._traced.method == "export"  # fx cannot read the dtype's limits
    with torch.no_grad():
        assert torch.equal(placed(x, mask), model(x, mask))  # without autocast: exact
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedError, match=r"finfo\(h\.dtype\)"):
            placed(x, mask)
