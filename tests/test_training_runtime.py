"""Training schedules as data, and the training executor: gradients equal the unsplit model's
(issue 10, item 4)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

from torchplace.errors import StageError
from torchplace.runtime import GraphIO, split_stages
from torchplace.runtime.schedule import Action, gpipe, one_f_one_b, per_worker, training_schedule
from torchplace.runtime.split import compute_nodes
from torchplace.runtime.training import TrainingExecutor


def test_gpipe_runs_every_forward_then_every_backward_by_the_clock():
    assert [repr(a) for a in gpipe(2, 3)] == [
        "F0.0", "F0.1", "F1.0", "F0.2", "F1.1", "F1.2", "B0.2", "B0.1", "B1.2", "B0.0", "B1.1", "B1.0"]


def test_one_f_one_b_per_stage_orders_are_warmup_steady_cooldown():
    order = one_f_one_b(4, 3)
    by_stage = {s: [repr(a) for a in order if a.stage == s] for s in range(3)}
    assert by_stage[0] == ["F0.0", "F1.0", "F2.0", "B0.0", "F3.0", "B1.0", "B2.0", "B3.0"]
    assert by_stage[1] == ["F0.1", "F1.1", "B0.1", "F2.1", "B1.1", "F3.1", "B2.1", "B3.1"]
    assert by_stage[2] == ["F0.2", "B0.2", "F1.2", "B1.2", "F2.2", "B2.2", "F3.2", "B3.2"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m, n", [(1, 1), (1, 3), (3, 1), (4, 3), (2, 5), (7, 4)])
def test_a_schedule_runs_every_action_once_after_what_it_needs(name, m, n):
    order = training_schedule(name, m, n)
    assert sorted(order) == sorted(Action(k, i, s) for k in "FB" for i in range(m) for s in range(n))
    seen: set[Action] = set()
    for a in order:
        needs = [Action("F", a.microbatch, a.stage - 1)] if a.kind == "F" and a.stage else []
        if a.kind == "B":
            needs = [Action("F", a.microbatch, a.stage)] + ([Action("B", a.microbatch, a.stage + 1)] if a.stage < n - 1 else [])
        assert all(d in seen for d in needs), (a, needs)
        seen.add(a)


def test_1f1b_holds_at_most_the_stages_to_the_end_in_flight():
    m, n = 6, 3
    for s in range(n):
        live = peak = 0
        for a in one_f_one_b(m, n):
            if a.stage == s:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
        assert peak == min(m, n - s)
    assert max(sum(1 if a.kind == "F" else -1 for a in gpipe(m, n)[:k] if a.stage == 0) for k in range(2 * m * n)) == m


def test_per_worker_keeps_the_global_order():
    order = gpipe(2, 3)
    split = per_worker(order, ["a", "b", "a"])
    assert split["b"] == [a for a in order if a.stage == 1]
    assert split["a"] == [a for a in order if a.stage != 1]


class Net(nn.Module):
    """A skip connection across stages and a parameter used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        g = torch.tanh(self.b(h)) + h
        return self.c(g) + self.c(h)


def _executor(model, stages_count, devices=None, isolate=True):
    gm = fx.symbolic_trace(model)
    nodes = compute_nodes(gm.graph)
    stage_of = {n.name: min(i * stages_count // len(nodes), stages_count - 1) for i, n in enumerate(nodes)}
    stages = split_stages(gm, stage_of, stages_count)
    workers = devices or [f"cpu:{i}" for i in range(stages_count)]
    return TrainingExecutor(stages, ["cpu"] * stages_count, workers, GraphIO(gm), isolate=isolate)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, workers", [(1, None), (2, None), (3, None), (4, ["cpu:0", "cpu:1", "cpu:0", "cpu:1"])])
def test_gradients_equal_the_unsplit_model_on_the_same_microbatches(schedule, stages, workers):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    executor = _executor(model, stages, workers)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    losses = executor.step((x,), {}, y, nn.functional.mse_loss, 4, schedule)
    expected = []
    for xs, ys in zip(x.tensor_split(4), y.tensor_split(4)):
        loss = nn.functional.mse_loss(reference(xs), ys)
        (loss / 4).backward()
        expected.append(loss.detach())
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(losses, expected))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


class SplitAcross(nn.Module):
    """``split`` returns a list: a value holding several tensors, read by the next stage."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        parts = torch.split(h, 8, dim=1)
        r = torch.tanh(h).sum(dim=1, keepdim=True)  # the producer's other output shares h's history
        return self.b(parts[0]) + parts[1][:, :4] + r


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_list_value_crossing_stages_carries_its_gradients(schedule, recompute):
    """Found as a flaky GPT-2 test: a plan that cut after attention's ``split`` let the consumer's
    backward run into the producer's graph ("backward through the graph a second time")."""
    torch.manual_seed(0)
    model = SplitAcross()
    reference = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    first = {"a", "split", "tanh", "sum_1"}
    stage_of = {n.name: 0 if n.name in first else 1 for n in compute_nodes(gm.graph)}
    stages = split_stages(gm, stage_of, 2)
    assert "split" in stages[0].outputs
    executor = TrainingExecutor(stages, ["cpu", "cpu"], ["cpu:0", "cpu:1"], GraphIO(gm), isolate=True,
                                recompute=[recompute, False])
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    executor.step((x,), {}, y, nn.functional.mse_loss, 2, schedule)
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
        (nn.functional.mse_loss(reference(xs), ys) / 2).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_failing_backward_names_the_stage_microbatch_and_direction():
    executor = _executor(Net(), 2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def bad_loss(out, target):  # a vector, not a scalar
        return (out - target).sum(dim=0)

    with pytest.raises(StageError, match="loss of micro-batch 0.*scalar"):
        executor.step((x,), {}, y, bad_loss, 2, "1f1b")
    model = Net()
    executor = _executor(model, 2)
    model.c.register_full_backward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(StageError, match=r"stage 1 .* backward pass of micro-batch \d: RuntimeError: boom"):
        executor.step((x,), {}, y, nn.functional.mse_loss, 2, "1f1b")


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.mark.parametrize("recompute", [(True, False), (False, True), (True, True)])
def test_recomputed_stages_give_the_same_gradients_and_statistics(recompute):
    torch.manual_seed(0)
    model = WithBatchNorm().train()
    reference = copy.deepcopy(model)
    gm = fx.symbolic_trace(model)
    nodes = compute_nodes(gm.graph)
    stage_of = {n.name: 0 if i < 2 else 1 for i, n in enumerate(nodes)}
    stages = split_stages(gm, stage_of, 2)
    executor = TrainingExecutor(stages, ["cpu", "cpu"], ["cpu:0", "cpu:1"], GraphIO(gm), isolate=True,
                                recompute=recompute)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    executor.step((x,), {}, y, nn.functional.mse_loss, 3, "1f1b")
    for xs, ys in zip(x.tensor_split(3), y.tensor_split(3)):
        (nn.functional.mse_loss(reference(xs), ys) / 3).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    for b, c in zip(model.buffers(), reference.buffers()):  # the statistics advanced once per micro-batch
        assert torch.equal(b, c)


def test_a_stage_with_dropout_is_not_recomputed():
    from torchplace.errors import UnsupportedError

    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    gm = fx.symbolic_trace(model)
    stages = split_stages(gm, {n.name: 0 for n in compute_nodes(gm.graph)}, 1)
    with pytest.raises(UnsupportedError, match="random numbers"):
        TrainingExecutor(stages, ["cpu"], ["cpu:0"], GraphIO(gm), recompute=[True])


def test_a_dropout_of_zero_or_in_eval_mode_is_recomputed():
    for model in (nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Linear(8, 4)),
                  nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 4)).eval()):
        gm = fx.symbolic_trace(model)
        stages = split_stages(gm, {n.name: 0 for n in compute_nodes(gm.graph)}, 1)
        TrainingExecutor(stages, ["cpu"], ["cpu:0"], GraphIO(gm), recompute=[True])


class WideHead(nn.Module):
    """A small body and a wide output: the model outputs dwarf everything else a worker holds."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4096)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_worker_forgets_a_microbatchs_values_after_its_backward():
    from torchplace.runtime.workers import peak_live_bytes

    executor = _executor(WideHead(), 2)
    x = torch.randn(64, 8)
    output = 16 * 4096 * 4  # one micro-batch's output
    with peak_live_bytes() as peaks:
        executor.step((x,), {}, None, lambda out, _: out.sum(), 4, "1f1b")
    # under 1F1B the last worker runs each micro-batch's forward, loss and backward in a row: it
    # holds one output, its gradient and the head's weight gradient (half an output), about 3.1
    # outputs; it held 6.1 when every value of the step stayed until the step ended
    assert 2 * output <= peaks["cpu:1"] < 4 * output


def _two_stages(model: nn.Module, second: str, **options) -> TrainingExecutor:
    """``model`` traced as ``place()`` traces it for training (its in-place writes recorded) and
    split before compute node ``second``, on two isolated CPU workers."""
    from torchplace.profiling import trace

    traced = trace(model, (torch.randn(8, 8),), {}, training=True)
    names = [n.name for n in compute_nodes(traced.gm.graph)]
    stage_of = {name: int(i >= names.index(second)) for i, name in enumerate(names)}
    return TrainingExecutor(split_stages(traced.gm, stage_of, 2, traced.effects), ["cpu", "cpu"],
                            ["cpu:0", "cpu:1"], GraphIO(traced.gm), isolate=True, **options)


class _Averaging(nn.Module):
    """Two layers and a running average of an activation (a buffer the forward writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))


class ReadsItsAverage(_Averaging):
    """Updates a running average of its activations and reads it in the same forward."""

    def forward(self, x):
        h = self.a(x)
        self.ema.mul_(0.9).add_(torch.tanh(h.detach()).mean(0) * 0.1)  # no gradient through the statistic
        return self.b(torch.tanh(h + self.ema))


def _recomputing_steps(model_type: type[nn.Module], second: str, m: int, schedule: str) -> None:
    """Two steps of ``model_type`` split before ``second``, its first stage recomputed, against the
    unsplit model on the same micro-batches: equal gradients and averages, no autograd history."""
    torch.manual_seed(0)
    model = model_type().train()
    reference = copy.deepcopy(model)
    executor = _two_stages(model, second, recompute=(True, False))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(2):
        model.zero_grad(), reference.zero_grad()
        executor.step((x,), {}, y, nn.functional.mse_loss, m, schedule)
        for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
            (nn.functional.mse_loss(reference(xs), ys) / m).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        assert torch.equal(model.ema, reference.ema) and not model.ema.requires_grad


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_recomputed_stage_runs_again_from_the_buffers_its_first_run_found(schedule):
    """Recomputing a stage that reads the average it updated gives its first run's activations:
    the gradients were 1e-3 off when it ran from the advanced average."""
    _recomputing_steps(ReadsItsAverage, "linear_1", 2, schedule)  # the average is updated and read on cpu:0


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x + 1)
        x.mul_(2)  # on cpu:1, through its copy of x (the devices are isolated)
        return self.b(h + x)


def test_a_step_writes_back_the_inputs_the_model_writes():
    torch.manual_seed(0)
    model = WritesItsInput()
    executor = _two_stages(model, "mul_")
    x = torch.randn(8, 8)
    caller = x.clone()
    executor.step((caller,), {}, torch.randn(8, 4), nn.functional.mse_loss, 2, "1f1b")
    assert torch.equal(caller, 2 * x)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_a_step_gives_the_inputs_that_require_grad_their_gradient(m):
    """As the unsplit model does; the gradients of the inputs were dropped before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    executor = _two_stages(model, "tanh")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    executor.step((mine,), {}, y, nn.functional.mse_loss, m, "1f1b")
    for xs, ys in zip(theirs.tensor_split(m), y.tensor_split(m)):
        (nn.functional.mse_loss(reference(xs), ys) / m).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-7)


class AveragesWhatItIsSent(_Averaging):
    """Averages a value the next device gets, which needs no gradient there."""

    def forward(self, x):
        h = self.a(x)
        d = torch.tanh(h.detach())  # sent to cpu:1, where it needs no gradient
        self.ema.mul_(0.9).add_(d.mean(0) * 0.1)
        return self.b(h) + self.ema


@pytest.mark.parametrize("m", [1, 2])
def test_a_recomputed_stage_sends_what_needs_no_gradient_without_one(m):
    """A recomputing stage marked every output as needing a gradient: the average of one took
    autograd history, and the next micro-batch's (or step's) backward ran into a freed graph."""
    _recomputing_steps(AveragesWhatItIsSent, "mul_", m, "1f1b")  # tanh(h.detach()) is sent to cpu:1


class FourierMixer(nn.Module):
    """An FFT mixing layer (FNet): a complex value between its linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        z = torch.fft.fft(torch.view_as_complex(h.reshape(h.shape[0], 16, 2)), dim=-1)
        h = torch.view_as_real(torch.fft.ifft(z * z.conj().tanh(), dim=-1)).reshape(h.shape[0], 32)
        return self.c(torch.relu(self.b(h)))


def test_a_complex_value_between_stages_carries_its_gradient():
    """A stage boundary kept requires_grad for floating-point values only: with the FFT's complex
    output sent across, every parameter before it got no gradient, silently (found by fuzzing)."""
    torch.manual_seed(0)
    model = FourierMixer()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    gm = fx.symbolic_trace(model)
    nodes = [n.name for n in compute_nodes(gm.graph)]
    cut = nodes.index("fft_fft")
    stages = split_stages(gm, {n: 0 if i <= cut else 1 for i, n in enumerate(nodes)}, 2)
    executor = TrainingExecutor(stages, ["cpu", "cpu"], ["cpu:0", "cpu:1"], GraphIO(gm), isolate=True)
    executor.step((x,), {}, y, nn.functional.mse_loss, 2, "1f1b")
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
        (nn.functional.mse_loss(reference(xs), ys) / 2).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
