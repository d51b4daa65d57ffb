"""Training placed models: gradients, optimizer steps, BatchNorm statistics and tied weights equal the
unsplit model's on the same micro-batches (issue 10, item 5).

Every comparison runs with ``TORCHPLACE_ISOLATE_DEVICES=1`` (each logical CPU has memory of its own,
so values and gradients crossing devices are real copies). The models have no dropout (or dropout
0): the masks come from one random generator, drawn in pipeline order, so they could not match.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchplace
from torchplace import costmodel
from torchplace.errors import InfeasibleError, MicrobatchError, StageError, TraceError, UnsupportedError, UsageError
from torchplace.models import MLP, ResidualCNN

DEVICES = {1: ["cpu:0"], 2: ["cpu:0", "cpu:1"], 3: ["cpu:0", "cpu:1", "cpu:2"]}
QUICK = {"progress": False, "repeats": 1, "warmup": 1}


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=63, eos_token_id=63)
    return GPT2LMHeadModel(config)


def _data(name: str, batch: int = 8):
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        return (torch.randn(batch, 32, generator=g),), torch.randn(batch, 10, generator=g), nn.functional.mse_loss
    if name == "resnet":
        return (torch.randn(batch, 3, 8, 8, generator=g),), torch.randint(0, 10, (batch,), generator=g), nn.functional.cross_entropy
    if name == "encoder":
        return (torch.randn(batch, 5, 16, generator=g),), torch.randn(batch, 5, 16, generator=g), nn.functional.mse_loss
    ids = torch.randint(0, 64, (batch, 12), generator=g)

    def lm_loss(out, target):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    return (ids,), ids.roll(-1, dims=1), lm_loss


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        pytest.importorskip("transformers")
        return _gpt2()
    return {"mlp": lambda: MLP(), "resnet": lambda: ResidualCNN(), "encoder": _encoder}[name]()


def _reference_step(model, inputs, target, loss_fn, m):
    """The unsplit model on the same micro-batches, the loss averaged over them."""
    losses = []
    for part, tpart in zip(zip(*(t.tensor_split(m) for t in inputs)), target.tensor_split(m)):
        loss = loss_fn(model(*part), tpart)
        (loss / m).backward()
        losses.append(loss.detach())
    return losses


def _close_grads(placed_model, reference):
    for (name, p), q in zip(placed_model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def _place(model, inputs, n, **options):
    return torchplace.place(model, DEVICES[n], inputs, mode="training", **{**QUICK, "microbatches": 4, **options})


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("name", ["mlp", "resnet", "encoder", "gpt2"])
def test_a_step_gives_the_unsplit_model_s_gradients(name, n, contiguous):
    """Both schedules, one after the other, on one placement (BatchNorm's statistics carry over)."""
    model = _model(name).train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data(name)
    placed = _place(model, inputs, n, contiguous=contiguous)
    for schedule in ("1f1b", "gpipe"):
        model.zero_grad()
        reference.zero_grad()
        losses = placed.step(*inputs, target=target, loss_fn=loss_fn, schedule=schedule)
        expected = _reference_step(reference, inputs, target, loss_fn, 4)
        torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-6)
        _close_grads(model, reference)
        for (name_, b), c in zip(model.named_buffers(), reference.buffers()):  # BatchNorm, per micro-batch
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name_)


@pytest.mark.parametrize("name", ["mlp", "resnet"])
def test_transparent_autograd_gives_the_same_gradients(name):
    model = _model(name).train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data(name)
    placed = _place(model, inputs, 2)
    loss_fn(placed(*inputs), target).backward()
    parts = [reference(*p) for p in zip(*(t.tensor_split(4) for t in inputs))]
    loss_fn(torch.cat(parts), target).backward()
    _close_grads(model, reference)


def test_twenty_adamw_steps_follow_unsplit_training():
    model = _model("resnet").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("resnet")
    placed = _place(model, inputs, 3, contiguous=False)
    opt, ref_opt = torch.optim.AdamW(placed.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    curve, ref_curve = [], []
    for _ in range(20):
        opt.zero_grad()
        ref_opt.zero_grad()
        curve.append(torch.stack(placed.step(*inputs, target=target, loss_fn=loss_fn)).mean())
        ref_curve.append(torch.stack(_reference_step(reference, inputs, target, loss_fn, 4)).mean())
        norm = nn.utils.clip_grad_norm_(placed.parameters(), 1.0)  # over parameters on several devices
        torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(reference.parameters(), 1.0), rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(torch.stack(curve), torch.stack(ref_curve), rtol=1e-4, atol=1e-5)
    assert curve[-1] < curve[0]  # it trains
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    for b, c in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5)


def test_tied_weights_get_both_uses_gradients_and_stay_one_tensor():
    model = _model("gpt2").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("gpt2")
    placed = _place(model, inputs, 3)
    head = next(v for v, r in placed.problem.graph.records() if r.module == "lm_head" and not r.backward)
    wte = next(v for v, r in placed.problem.graph.records() if r.module == "transformer.wte" and not r.backward)
    assign = placed.plan.assignment
    placed.step(*inputs, target=target, loss_fn=loss_fn)
    _reference_step(reference, inputs, target, loss_fn, 4)
    assert model.lm_head.weight is model.transformer.wte.weight
    torch.testing.assert_close(model.lm_head.weight.grad, reference.lm_head.weight.grad, rtol=1e-5, atol=1e-6)
    assert sum(1 for p in placed.parameters() if p is model.lm_head.weight) == 1  # one Parameter, one .grad
    if assign[head] != assign[wte]:  # lm_head ran on a replica; its gradient reached the one weight
        assert placed._executor.stage_params.replicas >= 1


def test_one_placed_module_trains_and_evaluates():
    model = _model("resnet").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("resnet")
    placed = _place(model, inputs, 2, microbatches=1)
    placed.step(*inputs, target=target, loss_fn=loss_fn)
    _reference_step(reference, inputs, target, loss_fn, 1)
    placed.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(placed(*inputs), reference(*inputs))  # running statistics, not the batch's
    with pytest.raises(UnsupportedError, match="train"):
        placed.step(*inputs, target=target, loss_fn=loss_fn)
    placed.train()
    reference.train()
    placed.step(*inputs, target=target, loss_fn=loss_fn)
    _reference_step(reference, inputs, target, loss_fn, 1)
    _close_grads(model, reference)


class ReadsItsMode(nn.Module):
    """Its root's forward reads ``self.training``, as functional dropout and auxiliary terms do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.relu(self.a(x)), 0.5, training=self.training)
        return self.b(h + 1.0 if self.training else h)


def test_eval_reaches_the_model_s_own_forward():
    """placed.eval() set the placed module and the model's children to eval mode, not the model's
    root: its eval graph was traced with dropout on, silently (found by fuzzing)."""
    torch.manual_seed(0)
    model = ReadsItsMode().train()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    placed = _place(model, (x,), 2, microbatches=1, loss_fn=nn.functional.mse_loss, example_target=y,
                    allow_single_device=False)
    placed.eval()
    assert not model.training
    with torch.no_grad():
        assert torch.equal(placed(x), reference.eval()(x))
    placed.train()
    assert model.training


def test_a_loss_module_is_not_part_of_the_placed_model():
    """place(loss_fn=nn.CrossEntropyLoss(weight=w)) made the loss a child of the placed module: its
    state_dict gained loss_fn.weight, a strict load of the model's state failed, and changing the
    loss's settings was refused as a change of the model (found by fuzzing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).train()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = nn.CrossEntropyLoss(weight=torch.rand(4))
    placed = _place(model, (x,), 2, microbatches=2, loss_fn=loss, example_target=y, allow_single_device=False)
    assert placed.loss_fn is loss and "loss_fn" not in dict(placed.named_children())
    assert list(placed.state_dict()) == list(model.state_dict())
    placed.load_state_dict(reference.state_dict())  # strict: the model's keys, nothing else
    loss.label_smoothing = 0.1  # the loss's own setting: step() uses it as it is
    losses = placed.step(x, target=y)
    expected = [loss(reference(c), t) for c, t in zip(x.tensor_split(2), y.tensor_split(2))]
    assert torch.equal(torch.stack(losses), torch.stack(expected).detach())


def test_a_target_tensor_without_the_batch_s_rows_is_refused_for_micro_batches():
    """step() cut every tensor of the target along dim 0: per-output weights of shape (4,) became
    pieces of one that broadcast, and the loss matched no unsplit one, silently (found by fuzzing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y, weights = torch.randn(8, 16), torch.randn(8, 4), torch.rand(4)

    def weighted(out, target):
        y, w = target
        return ((out - y) ** 2 * w).mean()

    placed = _place(model, (x,), 2, microbatches=4, loss_fn=weighted, example_target=(y, weights),
                    allow_single_device=False)
    with pytest.raises(UsageError, match="a tensor of the target has 4 rows where the inputs have 8"):
        placed.step(x, target=(y, weights))
    assert all(p.grad is None for p in model.parameters())
    placed.microbatches = 1
    placed.step(x, target=(y, weights))  # nothing is split


class Router(nn.Module):
    """Returns, beside its per-sample output, a router's load over the batch and a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 3)
        self.temperature = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h), torch.softmax(self.g(h), -1).mean(0), self.temperature * 2


def _routed_loss(out, target):
    logits, load, temperature = out
    return nn.functional.cross_entropy(logits / temperature, target) + 0.01 * load.pow(2).sum()


def test_a_training_call_joins_only_what_micro_batches_can_join():
    """A training placement's call joined every output: the router's load came back as m loads
    end to end, the parameter m times (found by fuzzing). step() gives each micro-batch's outputs
    to the loss, as the model on the same micro-batches."""
    torch.manual_seed(0)
    model = Router()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    placed = _place(model, (x,), 2, microbatches=2, loss_fn=_routed_loss, example_target=y,
                    allow_single_device=False)
    placed.step(x, target=y)
    _reference_step(reference, (x,), y, _routed_loss, 2)
    _close_grads(model, reference)
    with pytest.raises(MicrobatchError, match=r"model output \[1\] has shape \(4,\).*dim 0 is not the batch"):
        placed(x)
    placed.microbatches = 1
    assert [o.shape for o in placed(x)] == [o.shape for o in reference(x)]


def test_a_batch_norm_that_refuses_one_sample_is_not_trained_on_one():
    """Batch norm in training refuses a batch of one; its trace computed one with a variance of 0, so
    micro-batches of one sample trained where the model raises (found by fuzzing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(6, 8), torch.randn(6, 3)
    placed = _place(model, (x,), 2, microbatches=3, loss_fn=nn.functional.mse_loss, example_target=y,
                    allow_single_device=False)
    placed.step(x, target=y)  # micro-batches of two
    placed.microbatches = 4
    with pytest.raises(MicrobatchError, match="refuses one, as batch norm in training mode does"):
        placed.step(x, target=y)
    with pytest.raises(UsageError, match="call it with 2 or more samples"):
        placed.step(x[:1], target=y[:1])


def test_a_frozen_batch_norm_stays_frozen():
    """place(mode='training') set every module to training mode: a batch norm the user froze in
    eval mode used the batch's statistics and updated its running ones, silently (found by fuzzing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).train()
    for _ in range(3):
        model(torch.randn(8, 8))  # running statistics of their own
    model[1].eval()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 3)
    placed = _place(model, (x,), 2, microbatches=2, loss_fn=nn.functional.mse_loss, example_target=y,
                    allow_single_device=False)
    assert not model[1].training and model[0].training
    placed.step(x, target=y)
    _reference_step(reference, (x,), y, nn.functional.mse_loss, 2)
    _close_grads(model, reference)
    assert torch.equal(model[1].running_mean, reference[1].running_mean)
    placed.eval()
    with torch.no_grad():
        assert torch.equal(placed(x), copy.deepcopy(reference).eval()(x))
    placed.train()
    assert not model[1].training and model[0].training  # put back as placed
    model[1].train()
    with pytest.raises(UnsupportedError, match="modules '1' are not in the training modes the model was placed"):
        placed.step(x, target=y)


def test_a_model_whose_dim_0_is_not_the_batch_is_not_trained_in_micro_batches():
    """A training graph's samples may mix (batch statistics), so only shapes were checked: a
    sequence-first transformer was split along its sequence, with gradients 2e-2 off (found by fuzzing)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)  # batch_first=False: (sequence, batch, features)
    x, y = torch.randn(6, 4, 16), torch.randn(6, 4, 16)
    with pytest.raises(MicrobatchError, match="in eval mode, the model's output .* mixes the samples"):
        _place(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (x,), 2, microbatches=2,
               loss_fn=nn.functional.mse_loss, example_target=y)
    _place(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (x,), 2, microbatches=1,
           loss_fn=nn.functional.mse_loss, example_target=y)


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.emb(ids).mean(1))))


def test_sparse_embedding_gradients_train_as_the_model_s():
    """The gradient check compared gradients with dense-only operators: nn.Embedding(sparse=True)
    made place() fail with NotImplementedError (found by fuzzing)."""
    torch.manual_seed(0)
    model = SparseBag()
    reference = copy.deepcopy(model)
    ids, y = torch.randint(0, 30, (8, 6)), torch.randint(0, 4, (8,))
    placed = _place(model, (ids,), 2, microbatches=2, loss_fn=nn.functional.cross_entropy, example_target=y,
                    allow_single_device=False)
    placed.step(ids, target=y)
    _reference_step(reference, (ids,), y, nn.functional.cross_entropy, 2)
    assert model.emb.weight.grad.is_sparse
    torch.testing.assert_close(model.emb.weight.grad.to_dense(), reference.emb.weight.grad.to_dense())
    torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad)


class CheckpointedBlocks(nn.Module):
    """Frozen embeddings and blocks under reentrant activation checkpointing, as PEFT sets it up."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(3))
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
        return self.head(h)


def _token_loss(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, 50), target.reshape(-1))


def test_reentrant_checkpointing_passes_the_gradient_check():
    """The gradient check took autograd.grad, which reentrant checkpointing does not support: the
    blocks' gradients read as None and place() raised TraceError (found by fuzzing)."""
    torch.manual_seed(0)
    model = CheckpointedBlocks()
    model.emb.requires_grad_(False)
    model.emb.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 50, (4, 6))
    placed = _place(model, (ids,), 2, microbatches=2, loss_fn=_token_loss, example_target=ids,
                    allow_single_device=False)
    assert all(p.grad is None for p in model.parameters())  # the check left no gradient behind
    placed.step(ids, target=ids)
    _reference_step(reference, (ids,), ids, _token_loss, 2)
    _close_grads(model, reference)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mid = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


def test_a_gradient_hook_on_a_weight_several_stages_read_is_refused_by_step():
    """step() back-propagates stage by stage: a hook on a tied weight ran once per stage on that
    stage's part of the gradient (a clamp clamped parts), silently (found by fuzzing). The autograd
    path runs one backward, and the hook once on the whole gradient."""
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 40, (4, 6))
    placed = _place(model, (ids,), 2, microbatches=1, loss_fn=_token_loss_40, example_target=ids,
                    allow_single_device=False)
    for m in (model, reference):
        m.emb.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    with pytest.raises(UnsupportedError, match="emb.weight has a gradient hook, and several stages"):
        placed.step(ids, target=ids)
    _token_loss_40(placed(ids), ids).backward()
    _token_loss_40(reference(ids), ids).backward()
    _close_grads(model, reference)


def _token_loss_40(out, target):
    return nn.functional.cross_entropy(out.reshape(-1, 40), target.reshape(-1))


def test_a_model_placed_for_inference_does_not_train():
    model = _model("mlp")
    inputs, target, loss_fn = _data("mlp")
    placed = torchplace.place(model, DEVICES[2], inputs, **QUICK)
    with pytest.raises(UnsupportedError, match="mode='training'"):
        placed.step(*inputs, target=target, loss_fn=loss_fn)


def test_with_a_mean_loss_a_step_matches_one_full_batch_step():
    """Equal micro-batches and a loss that is a mean over samples: the 1/m scaling gives the full
    batch's gradient (to float rounding: the sums are grouped differently)."""
    model = _model("mlp").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("mlp")
    placed = _place(model, inputs, 2)
    placed.step(*inputs, target=target, loss_fn=loss_fn)
    loss_fn(reference(*inputs), target).backward()
    _close_grads(model, reference)



def test_a_batch_the_micro_batches_do_not_divide_gets_the_batch_s_gradient():
    """Each micro-batch's loss counted 1/m: a batch of 10 in micro-batches of 3, 3, 2, 2 (a
    DataLoader's last batch) weighed its samples unlike the batch's gradient, silently (found by
    probing). Each now counts its share of the samples: a mean loss's gradient is the batch's."""
    model = _model("mlp").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("mlp", batch=10)
    placed = _place(model, inputs, 2, loss_fn=loss_fn, example_target=target)
    losses = placed.step(*inputs, target=target)
    assert [len(t) for t in target.tensor_split(4)] == [3, 3, 2, 2] and len(losses) == 4
    loss_fn(reference(*inputs), target).backward()  # the whole batch at once
    _close_grads(model, reference)
    model.zero_grad(), reference.zero_grad()
    placed.step(*(t[:8] for t in inputs), target=target[:8])  # equal micro-batches: 1/m, as before
    _reference_step(reference, tuple(t[:8] for t in inputs), target[:8], loss_fn, 4)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def _halves_in_place(out, target):
    out.div_(2.0)  # a temperature, written into the model's output
    return nn.functional.cross_entropy(out, target)


def test_a_loss_that_writes_the_output_in_place_is_refused_with_the_fix():
    """The model's output is no leaf, so its loss may write it; a step gives the loss autograd leaves,
    which PyTorch does not write. place() said to pass a target of the example batch, and step()
    passed on PyTorch's error (found by probing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    _halves_in_place(copy.deepcopy(model)(x), y).backward()  # the unplaced model trains with it
    with pytest.raises(UsageError, match=r"loss_fn writes the model's output in place .* compute it out of place"):
        _place(copy.deepcopy(model), (x,), 2, microbatches=2, loss_fn=_halves_in_place, example_target=y,
               allow_single_device=False)
    placed = _place(model, (x,), 2, microbatches=2, allow_single_device=False)
    with pytest.raises(StageError, match=r"loss_fn writes the model's output in place .* compute it out of place"):
        placed.step(x, target=y, loss_fn=_halves_in_place)


def test_batch_norm_trained_in_micro_batches_is_placed_with_a_warning():
    """Each micro-batch is normalised by its own statistics, unlike the whole batch: documented, but
    place() said nothing (found by probing). Frozen batch norms and whole batches say nothing."""
    import warnings

    from torchplace.errors import PlacementWarning

    inputs, target, loss_fn = _data("resnet")
    with pytest.warns(PlacementWarning, match=r"batch norm module\(s\) in training mode .* each of the 4 micro-batches"):
        _place(_model("resnet").train(), inputs, 2, loss_fn=loss_fn, example_target=target)
    frozen = _model("resnet").train()
    for module in frozen.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlacementWarning)
        _place(frozen, inputs, 2, loss_fn=loss_fn, example_target=target)
        _place(_model("resnet").train(), inputs, 2, microbatches=1, loss_fn=loss_fn, example_target=target)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_cpu_training_gives_the_unsplit_gradients(monkeypatch):
    monkeypatch.delenv("TORCHPLACE_ISOLATE_DEVICES")
    model = _model("resnet").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("resnet")
    placed = torchplace.place(model, ["cuda:0", "cpu"], inputs, mode="training", microbatches=4, **QUICK)
    placed.step(*inputs, target=target, loss_fn=loss_fn)
    _reference_step(reference, inputs, target, loss_fn, 4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-3, atol=1e-4, msg=name)  # CUDA rounds differently


class StopsAGradientInABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():  # a scale the model does not differentiate through
            s = h.abs().sum(1, keepdim=True)
        return self.b(h / (1 + s))


class HooksAGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 0.5)
        return self.b(h)


@pytest.mark.parametrize(("model_type", "trace_method"), [
    (StopsAGradientInABlock, "fx"), (StopsAGradientInABlock, "export"),
    (HooksAGradient, "export"),  # fx cannot branch on requires_grad
])
def test_a_forward_that_changes_what_autograd_records_is_refused_for_training(model_type, trace_method):
    """The trace keeps the operators, not a no_grad block or a hook: the placed model's gradients
    were silently the ones through the block (1e-2 off)."""
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"gradient of 'a\.(weight|bias)' differs from the model's .* \.detach\(\).* "
                                         r"keep the module that does it whole"):
        torchplace.place(model_type(), ["cpu:0", "cpu:1"], (torch.randn(8, 8),), mode="training", microbatches=2,
                         trace_method=trace_method, progress=False, allow_single_device=False, warmup=0, repeats=1)



class RoundsStraightThrough(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient unchanged backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Rounds(nn.Module):
    def forward(self, x):
        return RoundsStraightThrough.apply(x)


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.q, self.b = nn.Linear(8, 8), Rounds(), nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.q(self.a(x))))


def test_an_autograd_function_with_its_own_backward_is_refused_by_name():
    """A trace keeps a custom autograd.Function's forward operators, not its backward: the refusal
    listed no_grad blocks and hooks only, nothing a user of a straight-through estimator would
    recognise (found by probing). Kept whole as the message says, it trains as the model."""
    torch.manual_seed(0)
    model, x, y = Quantized(), torch.randn(8, 8), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    options = dict(loss_fn=nn.functional.mse_loss, example_target=y, allow_single_device=False, microbatches=2)
    with pytest.raises(TraceError, match=r"a torch\.autograd\.Function with a backward of its own"):
        _place(copy.deepcopy(model), (x,), 2, **options)
    placed = _place(model, (x,), 2, trace_method="fx", leaf_modules=(Rounds,), **options)
    placed.step(x, target=y)
    _reference_step(reference, (x,), y, nn.functional.mse_loss, 2)
    _close_grads(model, reference)


class ScalesItsInputWithoutGradient(nn.Module):
    """Normalises its input by a scale it does not differentiate through, before any parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            s = x.abs().amax(1, keepdim=True)
        return self.b(torch.tanh(self.a(x / s)))


@pytest.mark.parametrize("model_type", [Quantized, ScalesItsInputWithoutGradient])
def test_a_trace_that_changes_only_an_input_s_gradient_is_refused(model_type):
    """The check compared the parameters' gradients only: a no_grad block or a straight-through
    estimator acting on the input alone changes no parameter's gradient, and a step gave inputs
    that require grad (adversarial training) gradients 2e-3 to 9e-3 off, silently (found by probing)."""
    torch.manual_seed(0)
    model = model_type()
    if model_type is Quantized:  # the estimator on the input, before any parameter
        model.a, model.q = model.q, model.a
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    options = dict(loss_fn=nn.functional.mse_loss, example_target=y, allow_single_device=False, microbatches=2)
    _place(copy.deepcopy(model), (x,), 2, **options)  # inputs that take no gradient: nothing differs
    with pytest.raises(TraceError, match=r"gradient of the input args\[0\] differs from the model's"):
        _place(model, (x.requires_grad_(),), 2, **options)

def _dropout_layers(p: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Dropout(p)) for _ in range(8)])


def test_a_model_that_draws_random_numbers_is_planned_without_recomputation():
    """The runtime refuses to recompute a stage with dropout (it would draw other masks); the plan
    recomputed it anyway where memory was short, and place() failed after solving. Now the cap
    that makes the dropout-free model recompute is a clear InfeasibleError for the model with it."""
    options = dict(progress=False, warmup=0, repeats=1, time_limit=2, allow_single_device=False, mode="training",
                   microbatches=8, schedule="gpipe")
    x = torch.randn(1024, 32)
    base = torchplace.place(_dropout_layers(0.0), ["cpu:0", "cpu:1"], (x,), recompute=False, **options)
    whole = sum(costmodel.device_memory(base.problem, base.plan.stages).values())
    for share in (0.5, 0.45, 0.4, 0.35):  # a cap the dropout-free model fits only by recomputing
        caps = {"cpu:0": int(share * whole), "cpu:1": int(share * whole)}
        try:
            recomputing = torchplace.place(_dropout_layers(0.0), ["cpu:0", "cpu:1"], (x,), max_memory=caps, **options)
        except InfeasibleError:
            continue
        if any(s.recompute for s in recomputing.plan.stages):
            break
    else:
        pytest.fail("no cap made the dropout-free model recompute")
    with pytest.raises(InfeasibleError, match="Recomputation was not tried: the model draws random numbers"):
        torchplace.place(_dropout_layers(0.1), ["cpu:0", "cpu:1"], (x,), max_memory=caps, **options)


class PoolsGroupsOfFour(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        g = h.view(x.shape[0] // 4, 4, 8).mean(1, keepdim=True).expand(-1, 4, -1).reshape(x.shape[0], 8)
        return self.b(h + g)


@pytest.mark.parametrize("m", [1, 4])
def test_the_gradient_check_runs_on_as_many_samples_as_the_model_needs(m):
    """It ran on the last two samples only, and a model that pools groups of four failed there
    with a RuntimeError that was not a torchplace error."""
    torch.manual_seed(0)
    placed = torchplace.place(PoolsGroupsOfFour(), ["cpu:0", "cpu:1"], (torch.randn(16, 8),), mode="training",
                              microbatches=m, progress=False, allow_single_device=False, warmup=0, repeats=1)
    assert placed.microbatches == m


def test_a_bfloat16_model_trains_within_its_rounding():
    """bf16 gradients of the trace and of the model differ by 3e-3 to 1e-2 (another backward
    path): the fp32 tolerance refused a model with nothing lost."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100, use_cache=False)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    torchplace.place(model, ["cpu:0", "cpu:1"], (torch.randint(0, 100, (4, 16)),), mode="training", microbatches=2,
                     progress=False, allow_single_device=False, warmup=0, repeats=1)


class HidesItsDropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.p = nn.Linear(8, 8), p

    def forward(self, x):
        return nn.functional.dropout(self.a(x), self.p, self.training)


def test_the_gradient_check_sees_random_numbers_a_leaf_hides():
    """A leaf module's functional dropout is no node of the graph: the planner recomputed it."""
    from torch import fx

    from torchplace.profiling.gradcheck import check_gradients

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, HidesItsDropout) or super().is_leaf_module(m, name)

    x = torch.randn(4, 8)
    for p, draws in ((0.5, True), (0.0, False)):
        model = nn.Sequential(HidesItsDropout(p), nn.Linear(8, 4)).train()
        gm = fx.GraphModule(model, Leaves().trace(model))
        assert check_gradients(model, gm, (x,), {}) is draws


@pytest.mark.parametrize("p, recompute, why", [(0.5, True, "draws random numbers"),
                                                  (0.0, False, "called with recompute=False")])
def test_a_given_plan_that_recomputes_where_it_may_not_is_refused_with_the_reason(p, recompute, why):
    """The refusal named only ``Problem.pipeline.recompute``, not the dropout a leaf hides nor
    the caller's recompute=False."""
    import dataclasses

    from torchplace.errors import InvalidPlanError

    x = torch.randn(8, 8)
    options = dict(mode="training", progress=False, warmup=0, repeats=1, time_limit=2, allow_single_device=False,
                   leaf_modules=[HidesItsDropout])
    model = nn.Sequential(nn.Linear(8, 8), HidesItsDropout(p), nn.Linear(8, 4))
    plan = torchplace.place(copy.deepcopy(model), ["cpu:0", "cpu:1"], (x,), recompute=False, **options).plan
    recomputing = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages))
    with pytest.raises(InvalidPlanError, match=f"given plan recomputes activations on cpu:0, cpu:1, but .*{why}"):
        torchplace.place(model, ["cpu:0", "cpu:1"], (x,), plan=recomputing, recompute=recompute, **options)


def test_random_operators_are_found_by_word_and_by_argument():
    import torch.nn.functional as F
    from torch import fx

    from torchplace.fxutil import draws_random_numbers

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2))

        def forward(self, x):
            q = x[None]
            return (F.normalize(x), F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
                    F.scaled_dot_product_attention(q, q, q), F.rrelu(x, training=True), torch.randn_like(x),
                    self.block(x))

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m, name):
            return name == "block" or super().is_leaf_module(m, name)

    model = Mixed().train()
    gm = fx.GraphModule(model, Leaves().trace(model))
    found = {n.name for n in gm.graph.nodes if draws_random_numbers(gm, n)}
    assert found == {"scaled_dot_product_attention", "rrelu", "randn_like", "block"}
    model.eval()
    assert not draws_random_numbers(gm, next(n for n in gm.graph.nodes if n.name == "block"))


class WritesInANoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            s = torch.exp(self.a(x))  # exp keeps its output for backward, where the block is lost
            s.mul_(0.5)
        return self.b(x) * s.sum(1, keepdim=True)


def test_a_refused_trace_names_the_route_that_runs_and_it_runs_exactly():
    """spectral_norm updates its power-iteration vectors in a no_grad block that export loses, and
    the trace failed backward; the refusal said only .detach() or inference. Kept whole by fx's
    leaf_modules, as the message now says, its gradients and buffers equal the model's bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    nn.utils.parametrizations.spectral_norm(model[2])
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    options = dict(mode="training", microbatches=1, progress=False, allow_single_device=False, warmup=0, repeats=1,
                   loss_fn=nn.functional.mse_loss, example_target=y)
    with pytest.raises(TraceError, match=r"keep the module that does it whole \(trace_method='fx' with leaf_modules="):
        torchplace.place(model, ["cpu:0", "cpu:1"], (x,), trace_method="export", **options)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), trace_method="fx", leaf_modules=(nn.Linear,), **options)
    nn.functional.mse_loss(placed(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(placed.parameters(), reference.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(placed.buffers(), reference.buffers()))


def test_a_trace_that_fails_backward_where_the_model_does_not_is_refused():
    """Found by fuzzing: the lost block made the trace's backward fail (an in-place write on a
    saved tensor); the check took that for a model needing more samples, and the placed model
    raised a RuntimeError on its first backward."""
    torch.manual_seed(0)
    with pytest.raises(TraceError, match="fails forward or backward where the model does not"):
        torchplace.place(WritesInANoGradBlock(), ["cpu:0", "cpu:1"], (torch.randn(8, 8),), mode="training",
                         microbatches=2, trace_method="export", progress=False, allow_single_device=False, warmup=0,
                         repeats=1)


class CountsItsRoutes(nn.Module):
    """Counts the samples routed to each of 4 experts, as transformers' mixture-of-experts layers do
    (histc of the float of an argmax, then an integer cumsum): values that take no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.out = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        counts = torch.histc(self.router(x).argmax(-1).float(), bins=4, min=0, max=3)
        return self.out(x) * (counts.cumsum(0, dtype=torch.int32)[-1] > 0)


def test_values_that_take_no_gradient_are_probed_without_one():
    """The backward probe made every floating input require grad: the integer cumsum of Mixtral's
    and Qwen2-MoE's routing then failed ('Autograd not support dtype: Int'), untyped (found by fuzzing)."""
    torch.manual_seed(0)
    model, x = CountsItsRoutes().train(), torch.randn(8, 8)
    reference = copy.deepcopy(model)
    placed = _place(model, (x,), 2, loss_fn=lambda out, _: out.pow(2).mean(), example_target=torch.zeros(8),
                    allow_single_device=False)
    placed.step(x, target=torch.zeros(8))
    _reference_step(reference, (x,), torch.zeros(8), lambda out, _: out.pow(2).mean(), 4)
    _close_grads(model, reference)


class CountsItsCalls(nn.Module):
    """BatchNorm first, then a buffer of its own written in forward and read in the same call."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn = nn.Linear(6, 16), nn.BatchNorm1d(16)
        self.mid = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
        self.register_buffer("count", torch.zeros(()))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.bn(self.inp(x)))
        self.count.add_(1)
        return self.head(h * (1 + 0.01 * self.count))


def _writes_of(graph, buffer: str) -> list[str]:
    """The nodes that write ``buffer`` in place (an export graph's ``add_`` on its placeholder)."""
    return [n.name for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("aten.add_")
            and buffer in n.args[0].name]


def test_the_eval_graph_is_matched_to_the_training_graph_by_what_nodes_compute():
    """The eval trace has no BatchNorm counter update, so the model's own count.add_ took that
    update's name there, and its stage: it ran on the first device, away from its reader and from
    the buffer's home, and the model's buffer was never written in eval calls (found by fuzzing)."""
    from torchplace.profiling import trace
    from torchplace.runtime.remap import matched_nodes, stage_assignment

    torch.manual_seed(0)
    model, x = CountsItsCalls(), torch.randn(4, 6)
    train = trace(model.train(), (x,), method="export", training=True)
    other = trace(model.eval(), (x,), method="export")
    mine, bn = _writes_of(train.gm.graph, "count"), _writes_of(train.gm.graph, "num_batches_tracked")
    assert len(mine) == len(bn) == 1 and _writes_of(other.gm.graph, "count") == bn  # the name it takes
    assert matched_nodes(other.gm.graph, train.gm.graph)[bn[0]] == mine[0]
    order = [n.name for n in train.gm.graph.nodes if n.op == "call_function"]
    known = {name: int(i >= order.index(mine[0])) for i, name in enumerate(order)}  # cut just before count.add_
    stage = stage_assignment(other.gm.graph, other.effects, train.gm.graph, known, ["cpu:0", "cpu:1"])
    assert stage[bn[0]] == 1


def test_a_buffer_written_in_forward_is_written_in_eval_calls_too():
    torch.manual_seed(0)
    model, x, y = CountsItsCalls(), torch.randn(8, 6), torch.randn(8, 5)
    reference = copy.deepcopy(model)
    placed = _place(model, (x,), 2, loss_fn=nn.functional.mse_loss, example_target=y, allow_single_device=False)
    writes = {buffer: {i for i, stage in enumerate(placed._stages) if _writes_of(stage.graph, buffer)}
              for buffer in ("count", "num_batches_tracked")}
    assert writes["count"] != writes["num_batches_tracked"]  # the case: the two writes on two devices
    placed.step(x, target=y)
    for part in x.tensor_split(4):
        reference(part)
    placed.eval()
    reference.eval()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(placed(x), torch.cat([reference(part) for part in x.tensor_split(4)]))
    assert model.count.item() == reference.count.item() == 16


class EvalDiffers(nn.Module):
    """Dropout and BatchNorm, whose eval-mode nodes differ from their training-mode ones."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.norm = nn.BatchNorm1d(8) if norm else nn.Identity()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.norm(torch.relu(self.layers[0](x))))
        for layer in self.layers[1:]:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize(("method", "norm"), [("fx", False), ("export", False), ("export", True)])
def test_the_eval_graph_keeps_the_training_split(method, norm):
    """Matched by what they compute, dropout and batch norm (another flag, another operator in
    eval mode) matched nothing, nor did every node after them: the whole eval graph from there on
    ran on one device (found in review)."""
    from torchplace.profiling import trace
    from torchplace.runtime.remap import stage_assignment

    torch.manual_seed(0)
    model, x = EvalDiffers(norm), torch.randn(4, 8)
    train = trace(model.train(), (x,), method=method, training=True)
    other = trace(model.eval(), (x,), method=method)
    order = [n.name for n in train.gm.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
    known = {name: int(i >= len(order) // 2) for i, name in enumerate(order)}
    stage = stage_assignment(other.gm.graph, other.effects, train.gm.graph, known, ["cpu:0", "cpu:1"])
    linears = [n.name for n in other.gm.graph.nodes if "linear" in str(n.target)]
    assert len(linears) == 6 and [stage[name] for name in linears] == [known[name] for name in linears]
    assert {stage[name] for name in linears} == {0, 1}


def test_more_micro_batches_than_the_batch_are_planned_as_the_step_runs_them():
    """A step runs at most one micro-batch per sample (the executor clamps m); the plan priced and
    simulated m = 10**9 for a batch of 4 a micro-batch at a time, for hours (found by fuzzing).
    10**3 here: that took seconds before, so a regression fails this test instead of hanging it."""
    model = _model("mlp").train()
    reference = copy.deepcopy(model)
    inputs, target, loss_fn = _data("mlp", batch=4)
    placed = _place(model, inputs, 2, microbatches=10**3, loss_fn=loss_fn, example_target=target,
                    allow_single_device=False, time_limit=5)
    assert placed.problem.pipeline.microbatches == 4
    with pytest.warns(RuntimeWarning, match="using 4"):
        losses = placed.step(*inputs, target=target)
    torch.testing.assert_close(torch.stack(losses), torch.stack(_reference_step(reference, inputs, target, loss_fn, 4)))
    _close_grads(model, reference)


class ScalesItsInput(nn.Module):
    """Tanh layers after ``x.mul_(2)`` when ``writes``: the forward writes the caller's input."""

    def __init__(self, writes: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.writes = writes
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])

    def forward(self, x):
        if self.writes:
            x.mul_(2)
        else:
            x = x * 2
        return self.body(x)


def test_a_model_that_writes_its_input_is_planned_without_recomputation():
    """With memory short, place() (recompute=True, the default) solved a plan that recomputes the
    stage writing the input, then refused it with 'place without recomputation (recompute=False)',
    the flag it had been given the choice of (found by fuzzing). Such a model is now planned
    without recomputation, and a cap only recomputation meets is an InfeasibleError saying why."""
    options = dict(progress=False, warmup=0, repeats=1, time_limit=2, allow_single_device=False, mode="training",
                   microbatches=8, schedule="gpipe")
    x = torch.randn(1024, 32)
    base = torchplace.place(ScalesItsInput(False), ["cpu:0", "cpu:1"], (x,), recompute=False, **options)
    whole = sum(costmodel.device_memory(base.problem, base.plan.stages).values())
    for share in (0.45, 0.4, 0.35):  # a cap the model that does not write its input fits only by recomputing
        caps = {"cpu:0": int(share * whole), "cpu:1": int(share * whole)}
        try:
            recomputing = torchplace.place(ScalesItsInput(False), ["cpu:0", "cpu:1"], (x,), max_memory=caps,
                                           **options)
        except InfeasibleError:
            continue
        if any(s.recompute for s in recomputing.plan.stages):
            break
    else:
        pytest.fail("no cap made the model recompute")
    with pytest.raises(InfeasibleError, match=r"Recomputation was not tried: the model writes its input 'x' in place"):
        torchplace.place(ScalesItsInput(True), ["cpu:0", "cpu:1"], (x.clone(),), max_memory=caps, **options)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_an_eval_call_after_fused_optimizer_steps_reads_the_new_weights(optimizer):
    """A fused optimizer writes the parameters without moving their version counters: the eval
    graph's replica of the tied weight kept the weight of before training, and eval outputs were
    0.3 off, silently (found by probing)."""
    torch.manual_seed(0)
    model = TiedLM().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 40, (8, 6))
    placed = _place(model, (ids,), 2, microbatches=2, loss_fn=_token_loss_40, example_target=ids,
                    allow_single_device=False)
    opt = optimizer(placed.parameters(), lr=0.1, fused=True)
    ref_opt = optimizer(reference.parameters(), lr=0.1, fused=True)
    for _ in range(2):
        for mode in (False, True):  # an eval call, then a training step
            placed.train(mode)
            reference.train(mode)
            with torch.no_grad():
                torch.testing.assert_close(placed(ids), torch.cat([reference(p) for p in ids.tensor_split(2)]))
        opt.zero_grad()
        ref_opt.zero_grad()
        placed.step(ids, target=ids)
        _reference_step(reference, (ids,), ids, _token_loss_40, 2)
        opt.step()
        ref_opt.step()
    assert placed._eval.stage_params.replicas >= 1
    placed.eval()
    with torch.no_grad():
        torch.testing.assert_close(placed(ids), torch.cat([reference.eval()(p) for p in ids.tensor_split(2)]))


def test_an_optimizer_step_while_another_thread_places_a_model_does_not_raise():
    """Placing a model with replicas adds it to the models the optimizer-step hook marks stale; an
    optimizer step in another thread iterated that set as it grew and raised 'Set changed size
    during iteration' out of optimizer.step() (found by review)."""
    import sys
    import threading
    import time

    from torchplace.runtime import params as stage_params

    class Watched:  # what the hook needs of a StageParameters
        def forget(self, homes=None) -> None:
            pass

    kept = [Watched() for _ in range(64)]
    for watched in kept:
        stage_params._watch_optimizers(watched)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    stop, errors = threading.Event(), []

    def places() -> None:
        while not stop.is_set():
            stage_params._watch_optimizers(Watched())  # gone at once: only the add matters

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=places)
    thread.start()
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not errors:
            try:
                opt.step()
            except RuntimeError as error:
                errors.append(error)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
