"""Micro-batches give the model's outputs or are refused (torchplace.batchdim): an output that reads
no batch comes back once, one that mixes the samples of a batch is refused with MicrobatchError."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx, nn

import torchplace
from torchplace.batchdim import Runs, check_split, reads_batch
from torchplace.errors import MicrobatchError, TraceError, UsageError

DEVICES = ["cpu:0", "cpu:1"]
OPTIONS = dict(allow_single_device=False, progress=False, time_limit=2, repeats=1, warmup=0)


class Extras(nn.Module):
    """Returns, beside its batched output, a constant, a parameter and a tensor sized by the input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.b(torch.relu(self.a(x)))
        return h, torch.arange(5), self.a.bias, torch.zeros(x.size(1))


class BatchMax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return h, h.amax(0)  # a reduction over the batch


class BatchSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        return {"h": h, "total": h.sum()}


class ReturnsItsLoss(nn.Module):
    """A model that computes its loss itself, as Hugging Face's do with ``labels=``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.a(x)
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels)}


class ReturnsItsBatchSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.a(x), x.shape[0]


def _sequence_first() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False: (sequence, batch, features)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_outputs_that_read_no_batch_come_back_once(trace_method: str) -> None:
    torch.manual_seed(0)
    model, x = Extras().eval(), torch.randn(4, 8)
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, trace_method=trace_method, **OPTIONS)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    assert [tuple(o.shape) for o in out] == [(4, 8), (5,), (8,), (8,)]  # was (10,), (16,), (16,): joined copies
    assert torch.allclose(out[0], expected[0], atol=1e-6)
    assert all(torch.equal(o, e) for o, e in zip(out[1:], expected[1:]))


@pytest.mark.parametrize(("model", "match"), [
    (BatchMax(), r"model output \[1\] has shape \(8,\) for 2 samples and \(8,\) for 1: its dim 0 is not the batch"),
    (BatchSum(), r"model output \['total'\] is a scalar computed from the batch"),
    (ReturnsItsLoss(), r"model output \['loss'\] is a scalar .* leave the labels out of the inputs and pass the loss to "
                       r"training, placed.step\(..., target=labels, loss_fn=f\)"),
    (_sequence_first(), r"the model.s output for the example.s last 1 sample alone differs .* batch_first=True"),
    # a number was taken from the first micro-batch: 4 where the model returns 8 (found by fuzzing)
    (ReturnsItsBatchSize(), r"model output \[1\] is a Python int that depends on the batch \(2 on 2 samples, 1 on 1\)"),
])
def test_an_output_that_mixes_the_batch_is_refused(model: nn.Module, match: str) -> None:
    """Joining micro-batches would silently give another output: a reduction over the batch, a
    scalar of it, attention over dim 0 (the sequence first, split along the sequence)."""
    torch.manual_seed(0)
    x = torch.randn(8, 4, 16) if isinstance(model, nn.TransformerEncoder) else torch.randn(4, 8)
    inputs = (x, torch.arange(4)) if isinstance(model, ReturnsItsLoss) else (x,)
    with pytest.raises(MicrobatchError, match=match):
        torchplace.place(model.eval(), DEVICES, inputs, microbatches=2, **OPTIONS)


def test_an_output_container_pytree_does_not_know_is_refused_and_registered_it_is_joined() -> None:
    """(found by fuzzing) fx traces a dataclass built in forward as one node; torch's pytree took
    the object for a leaf, and the placed model returned the first micro-batch's: 4 rows of 8."""

    @dataclasses.dataclass
    class Halves:
        first: torch.Tensor
        second: torch.Tensor

    class ReturnsADataclass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Halves:
            h = self.a(x)
            return Halves(h, self.b(h))

    torch.manual_seed(0)
    model, x = ReturnsADataclass().eval(), torch.randn(8, 8)
    with pytest.raises(MicrobatchError, match=r"the model's output is a Halves dataclass holding tensors, which "
                                              r"micro-batches cannot join.*register_dataclass\(Halves\)"):
        torchplace.place(model, DEVICES, (x,), microbatches=2, trace_method="fx", **OPTIONS)
    torch.utils._pytree.register_dataclass(Halves)
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, trace_method="fx", **OPTIONS)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    assert isinstance(out, Halves) and out.first.shape == out.second.shape == (8, 8)
    assert torch.allclose(out.first, expected.first, atol=1e-6) and torch.allclose(out.second, expected.second, atol=1e-6)


def test_a_tensor_returned_twice_comes_back_as_one_tensor() -> None:
    """(found by fuzzing) micro-batches joined each output on its own, so an output the model
    returns twice came back as two tensors: an in-place change of one no longer showed in the other."""

    class ReturnsItTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.b(torch.relu(self.a(x)))
            return h, x, h

    torch.manual_seed(0)
    model, x = ReturnsItTwice().eval(), torch.randn(8, 8)
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, **OPTIONS)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    assert out[0] is out[2] and expected[0] is expected[2]
    assert torch.allclose(out[0], expected[0], atol=1e-6) and torch.equal(out[1], x)


def test_an_input_the_model_returns_comes_back_as_the_callers_tensor() -> None:
    """An input returned as given is the caller's tensor from the model; micro-batches joined its
    pieces into a copy, so writing to the output no longer wrote to the input."""

    class ReturnsItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.b(torch.relu(self.a(x))) * mask, x, mask

    torch.manual_seed(0)
    model, x, mask = ReturnsItsInput().eval(), torch.randn(8, 8), torch.ones(8, 1)
    placed = torchplace.place(model, DEVICES, (x, mask), microbatches=4, **OPTIONS)
    with torch.no_grad():
        out, expected = placed(x, mask), model(x, mask)
    assert expected[1] is x and out[1] is x and out[2] is mask
    assert torch.allclose(out[0], expected[0], atol=1e-6)


def test_a_model_that_updates_its_state_in_forward_is_not_split() -> None:
    """(found by fuzzing) a buffer updated in forward (a call counter, a running mean) was updated
    once per micro-batch: 4 times per call with microbatches=4, where the model updates it once."""

    class KeepsAMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("mean", torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            h = self.a(x)
            self.mean.mul_(0.9).add_(h.detach().mean(0), alpha=0.1)
            return self.b(torch.relu(h))

    torch.manual_seed(0)
    x = torch.randn(8, 8)
    with pytest.raises(MicrobatchError, match="the model writes 'calls', 'mean' in forward: split into micro-batches, "
                                              "each call would update them once per micro-batch"):
        torchplace.place(KeepsAMean().eval(), DEVICES, (x,), microbatches=4, **OPTIONS)
    model = KeepsAMean().eval()
    reference = KeepsAMean().eval()
    reference.load_state_dict(model.state_dict())
    placed = torchplace.place(model, DEVICES, (x,), microbatches="auto", **OPTIONS)
    assert placed.microbatches == 1
    with torch.no_grad():
        assert torch.allclose(placed(x), reference(x), atol=1e-6)
        assert model.calls.item() == reference.calls.item() == 1 and torch.allclose(model.mean, reference.mean)
        placed.microbatches = 2
        with pytest.raises(MicrobatchError, match="the model writes 'calls', 'mean' in forward"):
            placed(x)
    assert model.calls.item() == 1


def test_auto_keeps_one_micro_batch_and_a_later_split_is_refused() -> None:
    torch.manual_seed(0)
    model, x = _sequence_first(), torch.randn(8, 4, 16)
    placed = torchplace.place(model, DEVICES, (x,), microbatches="auto", **OPTIONS)
    assert placed.microbatches == 1
    assert any("tried only m=1" in note for note in placed.plan.meta["call"]["notes"])
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))
        placed.microbatches = 2
        with pytest.raises(MicrobatchError, match="mixes the samples"):
            placed(x)


def test_the_eval_mode_of_a_training_placement_is_checked_too() -> None:
    torch.manual_seed(0)
    model, x = BatchMax(), torch.randn(4, 8)
    placed = torchplace.place(model.train(), DEVICES, (x,), mode="training", microbatches=2,
                              loss_fn=lambda out, target: ((out[0] - target) ** 2).mean(),
                              example_target=torch.zeros(4, 8), **OPTIONS)
    placed.step(x, target=torch.zeros(4, 8))  # a training step joins no outputs
    placed.eval()
    with torch.no_grad(), pytest.raises(MicrobatchError, match=r"model output \[1\] has shape"):
        placed(x)


class Sizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # x: (batch, sequence, 8)
        return self.a(x), torch.zeros(x.size(1)), torch.zeros(x.size(0)), torch.ones(x.dim())


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_an_output_sized_by_the_batch_reads_it_and_one_sized_otherwise_does_not(trace_method: str) -> None:
    """torch.zeros(x.size(0)) has the batch's rows: joined; torch.zeros(x.size(1)) reads no batch:
    returned once (in an exported graph with a dynamic sequence, a sym_size node of dim 1)."""
    model, x = Sizes(), torch.randn(4, 6, 8)
    if trace_method == "export":
        dims = {0: torch.export.Dim("batch", min=2, max=64), 1: torch.export.Dim("sequence", min=2, max=64)}
        gm = torch.export.export(model, (x,), dynamic_shapes=(dims,), strict=False).module()
        assert any("sym_size" in str(n.target) for n in gm.graph.nodes)
    else:
        gm = fx.symbolic_trace(model)
    assert reads_batch(gm, (x,), 4, 4) == [True, False, True, False]
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, trace_method=trace_method, **OPTIONS)
    with torch.no_grad():
        assert [tuple(o.shape) for o in placed(x)] == [(4, 6, 8), (6,), (4,), (3,)]


def test_nothing_to_split_is_not_checked() -> None:
    gm = fx.symbolic_trace(BatchMax())
    x = torch.randn(4, 8)

    def runs(*args: torch.Tensor) -> Runs:
        return Runs(None, gm, lambda a, k: a, args, {})

    assert check_split(runs(x), 1) is None  # one micro-batch
    assert check_split(runs(x[:1]), 4) is None  # a batch of one
    assert check_split(runs(torch.tensor(3.0)), 4) is None  # no batch dimension


class Threshold(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        return y, y > y.mean(0)  # a bool output that mixes the batch


def test_an_integer_output_that_mixes_the_batch_is_refused_too() -> None:
    """Only floating-point values were compared: the bool output came back with its shape and
    other values."""
    torch.manual_seed(0)
    with pytest.raises(MicrobatchError, match=r"model output \[1\] for the example's last 1 sample alone differs"):
        torchplace.place(Threshold().eval(), DEVICES, (torch.randn(8, 8),), microbatches=4, **OPTIONS)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_trace_that_differs_from_the_model_on_two_samples_is_refused() -> None:
    """An encoder with nested tensors and a padding mask takes a fused path its trace does not
    (zeros at the padded positions): that was blamed on a batch of one and placed with 2 rows."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2).eval()  # enable_nested_tensor=True, the default
    x, mask = torch.randn(4, 6, 16), torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True
    with pytest.raises(TraceError, match="on one sample and on two.*enable_nested_tensor=False"):
        torchplace.place(model, DEVICES, (x,), example_kwargs={"src_key_padding_mask": mask}, microbatches=2,
                         **OPTIONS)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).reshape(4, 2, 4)  # the example's batch, fixed


def test_a_model_that_fixes_its_batch_places_unsplit_and_says_why_it_cannot_split() -> None:
    x = torch.randn(4, 8)
    placed = torchplace.place(FixedBatch().eval(), DEVICES, (x,), microbatches=1, **OPTIONS)
    with torch.no_grad():
        assert placed(x).shape == (4, 2, 4)
    with pytest.raises(MicrobatchError, match="does not run on one of 2 micro-batches"):
        torchplace.place(FixedBatch().eval(), DEVICES, (x,), microbatches=2, **OPTIONS)


class Pairs(nn.Module):
    """Takes its samples in pairs: runs on an even number of them, mixes none."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(-1, 2, 4).relu().reshape(-1, 4))


def test_the_last_smaller_micro_batch_must_run_too() -> None:
    """(found by fuzzing) only the first micro-batch was run (timed): 4 micro-batches of 6 samples hold 2, 2,
    1 and 1, the graph fails on 1, and every call of the example's batch raised StageError after place()."""
    x = torch.randn(6, 4)
    with pytest.raises(MicrobatchError, match=r"does not run on one of 4 micro-batches \(1 of the example's 6"):
        torchplace.place(Pairs().eval(), DEVICES, (x,), microbatches=4, **OPTIONS)
    model = Pairs().eval()
    placed = torchplace.place(model, DEVICES, (x,), microbatches=3, **OPTIONS)  # 2 samples each
    with torch.no_grad():
        assert torch.equal(placed(x), torch.cat([model(c) for c in x.tensor_split(3)]))


class OneSampleBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[0] == 1:  # torch.export traces the batch as 2 or more and drops this, unguarded
            h = h * 100
        return self.b(torch.relu(h))


def test_a_model_that_branches_on_a_batch_of_one_never_runs_one():
    """The trace ran on one sample and computed the other branch, silently: on a call of one
    sample, and on every micro-batch of one (microbatches=4 of an example of 4)."""
    torch.manual_seed(0)
    model, x = OneSampleBranch().eval(), torch.randn(4, 8)
    with pytest.raises(MicrobatchError, match="4 micro-batches of 4 samples would hold one each; set microbatches "
                                              "to 2 or fewer"):
        torchplace.place(model, DEVICES, (x,), microbatches=4, **OPTIONS)
    placed = torchplace.place(model, DEVICES, (x,), microbatches="auto", **OPTIONS)
    assert placed.microbatches <= 2
    with torch.no_grad():
        assert torch.allclose(placed(x), torch.cat([model(c) for c in x.tensor_split(placed.microbatches)]), atol=1e-6)
        with pytest.raises(UsageError, match="call it with 2 or more samples"):
            placed(x[:1])
        placed.microbatches = 4
        with pytest.raises(MicrobatchError, match="set placed.microbatches to 2 or fewer"):
            placed(x)
    with pytest.raises(UsageError, match="place it with an example of 2 or more"):
        torchplace.place(model, DEVICES, (x[:1],), objective="latency", **OPTIONS)
    latency = torchplace.place(model, DEVICES, (x,), objective="latency", **OPTIONS)  # splits nothing: placed
    with torch.no_grad():
        assert torch.allclose(latency(x), model(x), atol=1e-6)


class TimesAMatrix(nn.Module):
    """Takes, beside the batch, a matrix without the batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) @ w)


def test_an_input_without_the_batchs_rows_runs_unsplit_and_micro_batches_are_refused() -> None:
    """Placed with microbatches=1, the placed model raised ValueError on its own example, since the
    runtime looked for a common batch before it saw nothing was to be split (found by fuzzing)."""
    torch.manual_seed(0)
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    model = TimesAMatrix().eval()
    with torch.no_grad():
        expected = model(x, w)
        placed = torchplace.place(model, DEVICES, (x, w), microbatches=1, **OPTIONS)
        assert torch.equal(placed(x, w), expected)
        placed.microbatches = 2
        with pytest.raises(MicrobatchError, match="use microbatches=1"):
            placed(x, w)
    assert torchplace.place(TimesAMatrix().eval(), DEVICES, (x, w), microbatches="auto", **OPTIONS).microbatches == 1
    for mode in ("inference", "training"):
        with pytest.raises(MicrobatchError, match=r"microbatches=2: tensor inputs have different sizes along dim 0"):
            torchplace.place(TimesAMatrix(), DEVICES, (x, w), microbatches=2, mode=mode, **OPTIONS)


class TakesContainers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, batch: dict[str, torch.Tensor], pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.a(batch["x"]) * batch["m"].unsqueeze(-1) + pair[0]
        return self.b(torch.relu(h)) * pair[1]


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_inputs_in_containers_are_joined_from_every_micro_batch(trace_method: str) -> None:
    """An fx placeholder holds a whole dict or tuple, which the check did not see as batched: the
    placed model returned the first micro-batch's rows only (found by fuzzing)."""
    torch.manual_seed(0)
    model = TakesContainers().eval()
    batch, pair = {"x": torch.randn(6, 8), "m": torch.rand(6)}, (torch.randn(6, 8), torch.rand(6, 1))
    placed = torchplace.place(model, DEVICES, (batch, pair), microbatches=2, trace_method=trace_method, **OPTIONS)
    with torch.no_grad():
        halves = [model({k: v[i:i + 3] for k, v in batch.items()}, tuple(t[i:i + 3] for t in pair)) for i in (0, 3)]
        assert torch.equal(placed(batch, pair), torch.cat(halves))


class ComplexOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(self.b(torch.relu(self.a(x))).view(x.shape[0], 32, 2))


def test_a_complex_output_is_compared_to_rounding_not_exactly() -> None:
    """A complex output was compared bit for bit between a batch of one and of two, so float
    rounding read as mixing samples and micro-batches were refused (found by fuzzing)."""
    torch.manual_seed(0)
    model, x = ComplexOutput().eval(), torch.randn(6, 8)
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, **OPTIONS)
    with torch.no_grad():
        assert torch.equal(placed(x), torch.cat([model(x[:3]), model(x[3:])]))


class ReturnsItsLargest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        y = self.b(torch.relu(self.a(x)))
        return y, y.max().item()


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_a_number_read_from_the_batch_s_values_is_refused_for_micro_batches(trace_method: str) -> None:
    """The check compared the number on the last two samples and the last alone, which agree when
    the largest value is in the last sample: each call then returned the first micro-batch's
    largest value, silently (found by fuzzing)."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    x[-1] = x[-1] * 10 + 5  # the largest output is in the last sample
    with pytest.raises(MicrobatchError, match=r"model output \[1\] is a Python float read from the values"):
        torchplace.place(ReturnsItsLargest().eval(), DEVICES, (x,), microbatches=2, trace_method=trace_method,
                         **OPTIONS)
    model = ReturnsItsLargest().eval()
    placed = torchplace.place(model, DEVICES, (x,), microbatches=1, trace_method=trace_method, **OPTIONS)
    with torch.no_grad():
        assert placed(x)[1] == model(x)[1]


class RoundingNoise(nn.Module):
    """Returns, beside a linear layer's output, its difference from the same map by another kernel:
    rounding noise with nothing larger to measure it against, which a batch of one and of two may
    round differently."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        return y, y - ((x.unsqueeze(1) * self.a.weight).sum(-1) + self.a.bias)


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_an_output_of_rounding_noise_is_not_taken_for_mixing(trace_method: str) -> None:
    """Its rows differ alone and beside another by more than rounding at its own scale, and were
    refused as mixing the batch (found by fuzzing); beside a copy of themselves they do not change,
    and the difference is rounding of the subtraction's operands."""
    torch.manual_seed(0)
    model, x = RoundingNoise().eval(), torch.randn(8, 64)
    with torch.no_grad():
        single, pair = model(x[-1:])[1], model(x[-2:])[1]
    assert float((single - pair[1:]).abs().max()) > 1e-3 * float(pair[1:].abs().max())  # what was refused
    placed = torchplace.place(model, DEVICES, (x,), microbatches=4, trace_method=trace_method, **OPTIONS)
    with torch.no_grad():
        assert torch.equal(placed(x)[1], torch.cat([model(part)[1] for part in x.chunk(4)]))
        assert float((placed(x)[1] - model(x)[1]).abs().max()) < 1e-5  # rounding of values near 1


class DividesByTheBatch(RoundingNoise):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.a(x)
        return y, y / x.shape[0]  # every row computed alone, but by the batch's size


class BranchesOnNoise(RoundingNoise):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, noise = super().forward(x)
        return y, torch.where(noise.abs() > 1e-7, y, -y)  # rounding picks the branch


class MixesBesideNan(RoundingNoise):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, torch.cat([x - x.mean(0), torch.log(-x[:, :1].abs() - 1)], dim=1)  # a nan column in every row


@pytest.mark.parametrize("model", [DividesByTheBatch(), BranchesOnNoise(), MixesBesideNan()])
def test_differences_that_are_not_rounding_are_still_refused(model: nn.Module) -> None:
    """Beside a copy of themselves their rows do not change (the batch's size is the same), or a nan
    made the output's scale nan: the difference alone and beside another is not rounding of the
    values it is computed from (the last two were accepted, and micro-batches changed the output)."""
    torch.manual_seed(0)
    with pytest.raises(MicrobatchError, match=r"model output \[1\] for the example.s last 1 sample alone differs"):
        torchplace.place(model.eval(), DEVICES, (torch.randn(8, 64),), microbatches=4, **OPTIONS)


class AddsABias(nn.Module):
    """Adds an attention bias of shape (T, T), an input without a batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2) + bias
        return self.o(scores.softmax(-1) @ x)


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_an_input_without_a_batch_dim_that_broadcasts_in_one_row_micro_batches_is_refused(mode):
    """With as many samples as the bias has rows, micro-batches of one cut it to one row, which
    broadcasts: the placed model ran and returned other outputs than the model (by 1.4), silently
    (found by fuzzing). Two micro-batches already failed, naming the input's size."""
    torch.manual_seed(0)
    x, bias = torch.randn(16, 16, 8), torch.randn(16, 16)
    options = dict(OPTIONS, microbatches=16)
    if mode == "training":
        options.update(mode="training", loss_fn=nn.functional.mse_loss, example_target=torch.randn(16, 16, 8))
    with pytest.raises(MicrobatchError, match=r"runs on micro-batches of 1 sample\(s\) of the example but fails on 2"):
        torchplace.place(AddsABias(), DEVICES, (x, bias), **options)
    if mode == "inference":
        auto = torchplace.place(AddsABias().eval(), DEVICES, (x, bias), **{**options, "microbatches": "auto"})
        assert auto.microbatches == 1
