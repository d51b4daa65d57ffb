"""One placed model serves every sequence length (issue 17, item 5)."""
from __future__ import annotations

import math

import pytest
import torch

import torchplace
from torchplace.errors import UsageError

transformers = pytest.importorskip("transformers")

QUICK = dict(progress=False, repeats=1, warmup=0, microbatches=2)
LENGTHS = (1, 8, 13, 32)  # 1: a decoding step, which the trace (of sizes >= 2) must also compute


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, use_cache=False,
                                     bos_token_id=1, eos_token_id=1)
    return transformers.GPT2LMHeadModel(config).eval()


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=64, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def _call(length: int, with_types: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 64, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length // 2:] = 0  # padding in the second sample
    call = {"input_ids": ids, "attention_mask": mask}
    if with_types:
        call["token_type_ids"] = torch.zeros_like(ids)
    return call


def _equal(out, ref, key: str) -> bool:
    return torch.equal(getattr(out, key), getattr(ref, key))


def _equal_split(out, model, call: dict[str, torch.Tensor], key: str, m: int = QUICK["microbatches"]) -> bool:
    """``out`` is bitwise the model's on the same ``m`` micro-batches (on the whole batch at once its
    kernels may round otherwise: at length one they do)."""
    parts = [{k: v.tensor_split(m)[i] for k, v in call.items()} for i in range(m)]
    return torch.equal(getattr(out, key), torch.cat([getattr(model(**p), key) for p in parts]))


def test_one_placed_gpt2_serves_every_sequence_length():
    model = _gpt2()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16),
                              dynamic_dims={"input_ids": [1], "attention_mask": [1]}, **QUICK)
    assert len({s.device for s in placed.plan.stages}) == 2
    with torch.no_grad():
        for n in LENGTHS:
            assert _equal_split(placed(**_call(n)), model, _call(n), "logits"), n


def test_one_placed_bert_serves_every_sequence_length():
    model = _bert()
    dims = {"input_ids": [1], "attention_mask": [1], "token_type_ids": [1]}
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16, True), dynamic_dims=dims, **QUICK)
    with torch.no_grad():
        for n in LENGTHS:
            assert _equal_split(placed(**_call(n, True)), model, _call(n, True), "last_hidden_state"), n


def test_auto_finds_the_dimensions_that_vary():
    model = _gpt2()
    # one micro-batch: at some lengths (5, 7) the model's own kernels round a batch of one
    # differently from a batch of two, so micro-batching alone would break bitwise equality there
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16), dynamic_dims="auto",
                              **{**QUICK, "microbatches": 1})
    with torch.no_grad():
        for n in (5, 40):
            assert _equal(placed(**_call(n)), model(**_call(n)), "logits"), n


def test_a_length_the_trace_did_not_allow_is_a_usage_error_naming_the_fix():
    model = _gpt2()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16), **QUICK)
    with torch.no_grad(), pytest.raises(UsageError, match=r"size\(\)\[1\] == 16.*dynamic_dims=\{'input_ids': \[1\]\}"):
        placed(**_call(8))


class AddsPositions(torch.nn.Module):
    """Adds one of 32 learned positions to each token: it runs on 32 tokens at most."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16)
        self.pos = torch.nn.Parameter(torch.randn(32, 16))

    def forward(self, ids):
        return self.out(self.emb(ids) + self.pos[:ids.shape[1]])


def test_a_length_beyond_what_the_model_allows_says_so_not_to_declare_dims():
    """The export bounds the length by the position table; the message said to declare dynamic_dims,
    which were declared (and named `input_ids` for an input called `ids`)."""
    torch.manual_seed(0)
    placed = torchplace.place(AddsPositions().eval(), ["cpu:0", "cpu:1"], (torch.randint(0, 50, (4, 16)),),
                              dynamic_dims={"ids": [1]}, allow_single_device=False, trace_method="export", **QUICK)
    with torch.no_grad(), pytest.raises(UsageError, match=r"ids.size\(\)\[1\] <= 32.*holds only within that range") as e:
        placed(torch.randint(0, 50, (4, 40)))
    assert "dynamic_dims" not in str(e.value)


class PadsToEven(torch.nn.Module):
    """Pads an odd sequence by one: the export takes the example's side of the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        n = x.shape[1]
        if n % 2:
            x = torch.nn.functional.pad(x, (0, 0, 0, 1))
        return self.lin(x)[:, :n]


class ScalesByLength(torch.nn.Module):
    """Divides by sqrt(length), a Python float: the export fixes the length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) / math.sqrt(x.shape[1])


@pytest.mark.parametrize("model, dims, length", [(PadsToEven, {"x": [1]}, 13), (ScalesByLength, "auto", 8)],
                         ids=["branch-on-parity", "python-float-of-the-length"])
def test_a_declared_length_the_code_fixed_says_so_not_to_declare_it(model, dims, length):
    """A size asked dynamic that the model's code fixed while tracing (a branch on its parity, a
    Python number of it) was refused with advice to declare the dims that were declared."""
    torch.manual_seed(0)
    model = model().eval()
    x = torch.randn(4, length, model.lin.in_features)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), dynamic_dims=dims, allow_single_device=False,
                              trace_method="export", **QUICK)
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))
        with pytest.raises(UsageError, match=r"dim 1 of 'x' was asked dynamic, but the model's code fixed it") as e:
            placed(torch.randn(4, length + 1, model.lin.in_features))
    assert "dynamic_dims" not in str(e.value)


def test_a_declared_dim_the_code_fixes_is_a_trace_error_saying_so():
    """torch.export's reason (the dim was fixed to a constant) was cut to its first line, and the
    hints were about use_cache and data-dependent control flow."""
    from torchplace.errors import TraceError

    x = torch.randn(4, 8, 8)
    with pytest.raises(TraceError, match=r"specialized it to be a constant \(8\).*Leave that dim out of dynamic_dims"):
        torchplace.place(ScalesByLength().eval(), ["cpu:0", "cpu:1"], (x,), dynamic_dims={"x": [1]},
                         trace_method="export", **QUICK)


@pytest.mark.parametrize("dims, message", [
    ({"input_idz": [1]}, "does not pass"),
    ({"input_ids": [5]}, "not a dimension"),
    ({"input_ids": 1}, "list of dimensions"),
    ([1], "must be a dict"),
])
def test_bad_dynamic_dims_are_usage_errors(dims, message):
    with pytest.raises(UsageError, match=message):
        torchplace.place(_gpt2(), ["cpu:0"], example_kwargs=_call(8), dynamic_dims=dims, **QUICK)


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.a(x) * scale


def test_a_python_number_the_export_kept_is_a_usage_error_naming_the_fix():
    """The message told to declare dynamic dimensions, which cannot help a float argument."""
    x = torch.randn(4, 8)
    placed = torchplace.place(Scaled(), ["cpu:0", "cpu:1"], (x,), example_kwargs={"scale": 1.5}, trace_method="export",
                              **{**QUICK, "microbatches": 1})
    with torch.no_grad(), pytest.raises(UsageError, match=r"scale == 1\.5.*a Python number.*torch\.tensor"):
        placed(x, scale=3.0)


class BranchesOnOneStep(torch.nn.Module):
    """Another computation for a sequence of one (a decoding step), and a mean that guards it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        length = x.shape[1]
        if length == 1:
            return self.a(x) + 100
        return self.b(self.a(x)) / (length - 1 if length > 1 else 1)


def test_a_size_of_one_the_trace_does_not_compute_as_the_model_is_refused():
    """torch.export traces the length as 2 or more and drops the branch without a guard: a call of
    length one ran the other branch (values near 0 where the model's are near 100), silently."""
    torch.manual_seed(0)
    model = BranchesOnOneStep().eval()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (torch.randn(4, 16, 8),), dynamic_dims={"x": [1]},
                              allow_single_device=False, **QUICK)
    with torch.no_grad():
        for n in (2, 5):
            x = torch.randn(4, n, 8)
            assert torch.equal(placed(x), torch.cat([model(c) for c in x.tensor_split(2)])), n
        with pytest.raises(UsageError, match=r"dim 1 of 'x' has size one"):
            placed(torch.randn(4, 1, 8))


def test_a_training_placement_serves_every_declared_length_in_eval_mode_too():
    """Its eval-mode graph was traced again without the declared dims, and a call at another
    length was refused, asking to declare them (found by fuzzing)."""
    model = _gpt2()
    config = model.config
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config).train()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16), mode="training",
                              dynamic_dims={"input_ids": [1], "attention_mask": [1]}, allow_single_device=False, **QUICK)
    placed.eval()
    with torch.no_grad():
        for n in (5, 16):
            assert _equal_split(placed(**_call(n)), model, _call(n), "logits"), n


def test_a_training_step_at_a_length_the_trace_fixed_is_a_usage_error_naming_the_fix():
    """The step raised the graph's raw guard failure inside a StageError (found by fuzzing)."""
    model = _gpt2().train()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], example_kwargs=_call(16), mode="training",
                              allow_single_device=False, **QUICK)
    loss_fn = lambda out, target: out["logits"].float().pow(2).mean()  # noqa: E731
    with pytest.raises(UsageError, match=r"size\(\)\[1\] == 16.*dynamic_dims=\{'input_ids': \[1\]\}"):
        placed.step(**_call(8), target=torch.zeros(2), loss_fn=loss_fn)


def test_the_sizes_a_trace_fixed_are_checked_before_a_runtime_that_runs_no_guard():
    """torch.distributed ranks met the guard inside the engine's forward, after communicating
    (found by fuzzing): CallSizes.check_fixed refuses such a call first, with the same message."""
    from torchplace.batchdim import CallSizes
    from torchplace.profiling import trace

    traced = trace(_gpt2(), (), _call(16), method="export")
    sizes = CallSizes(gm=traced.gm)
    sizes.check_fixed((), _call(16))
    with pytest.raises(UsageError, match=r"input_ids.size\(\)\[1\] == 16.*dynamic_dims=\{'input_ids': \[1\]\}"):
        sizes.check_fixed((), _call(8))
    dynamic = trace(_gpt2(), (), _call(16), method="export", dynamic_dims={"input_ids": [1], "attention_mask": [1]})
    CallSizes(gm=dynamic.gm).check_fixed((), _call(8))


class MasksItsInput(torch.nn.Module):
    """Multiplies each position by its mask: the two lengths must agree."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.lin(x) * mask.unsqueeze(-1)


def test_two_declared_lengths_that_must_agree_say_so():
    """A mask shorter than the input broke the guard `mask.size()[1] == x.size()[1]`, and the
    message said the model's code had fixed the mask's length while tracing (found by fuzzing)."""
    torch.manual_seed(0)
    model = MasksItsInput().eval()
    x, mask = torch.randn(4, 16, 8), torch.ones(4, 16)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x, mask), dynamic_dims={"x": [1], "mask": [1]},
                              allow_single_device=False, trace_method="export", **QUICK)
    with torch.no_grad():
        x, mask = x[:, :9], mask[:, :9]
        expected = torch.cat([model(a, b) for a, b in zip(x.tensor_split(2), mask.tensor_split(2))])
        assert torch.equal(placed(x, mask), expected)
        with pytest.raises(UsageError, match=r"dim 1 of 'mask' and dim 1 of 'x' together, so they must be equal") as e:
            placed(x, mask[:, :7])
    assert "fixed it" not in str(e.value)


class Downsamples(torch.nn.Module):
    """A stride-2 convolution: export assumes the map it makes is not of size one."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.nn.functional.adaptive_avg_pool2d(self.conv(x), 1).flatten(1))


def test_a_guard_on_a_size_computed_from_declared_dims_does_not_ask_to_declare_them():
    """A guard such as `1 + (-1 + x.size()[3]) // 2 != 1` said to declare
    dynamic_dims={input: [dims]}, which were declared (found by fuzzing)."""
    torch.manual_seed(0)
    model = Downsamples().eval()
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], (torch.randn(4, 3, 16, 16),), dynamic_dims={"x": [2, 3]},
                              allow_single_device=False, trace_method="export", **QUICK)
    with torch.no_grad():
        x = torch.randn(4, 3, 9, 13)
        assert torch.equal(placed(x), torch.cat([model(c) for c in x.tensor_split(2)]))
        with pytest.raises(UsageError, match=r"asked dynamic, but the trace holds only where that condition does") as e:
            placed(torch.randn(2, 3, 2, 2))
    assert "dynamic_dims" not in str(e.value)


def test_a_declared_length_fixed_by_an_undeclared_mask_says_to_declare_the_mask():
    """Declaring only input_ids: the mask's length, left static, fixes theirs, and the TraceError
    blamed a branch or a Python number and said to leave the dim out (found by fuzzing)."""
    from torchplace.errors import TraceError

    declared = r"declare those too: dynamic_dims=\{'input_ids': \[1\], 'attention_mask': \[1\]\}"
    with pytest.raises(TraceError, match=declared):
        torchplace.place(_gpt2(), ["cpu:0", "cpu:1"], example_kwargs=_call(16), dynamic_dims={"input_ids": [1]},
                         trace_method="export", **QUICK)


def test_dims_declared_by_position_or_from_the_end_count_as_declared_in_guard_messages():
    """dynamic_dims={0: [-2]} asks the same dim as {'x': [1]}, but a call the trace refused was
    told to declare dynamic_dims={'x': [1]} (found by fuzzing)."""
    torch.manual_seed(0)
    placed = torchplace.place(PadsToEven().eval(), ["cpu:0", "cpu:1"], (torch.randn(4, 13, 16),),
                              dynamic_dims={0: [-2]}, allow_single_device=False, trace_method="export", **QUICK)
    with torch.no_grad(), pytest.raises(UsageError, match=r"dim 1 of 'x' was asked dynamic") as e:
        placed(torch.randn(4, 14, 16))
    assert "dynamic_dims" not in str(e.value)


class Mixes(torch.nn.Module):
    """Mixes the positions of a sequence: runs at any length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h + h.mean(1, keepdim=True)


def test_a_declared_dim_of_size_one_in_the_example_is_a_usage_error_naming_the_fix():
    """torch.export fixes a size of one: the TraceError quoted its 'conflicts between user-specified
    ranges and inferred ranges' and hinted at use_cache (found by fuzzing)."""
    with pytest.raises(UsageError, match=r"dim 1 of 'x' has size 1 in the example.*size 2 or more"):
        torchplace.place(Mixes().eval(), ["cpu:0", "cpu:1"], (torch.randn(4, 1, 8),), dynamic_dims={"x": [1]},
                         trace_method="export", **QUICK)


def test_auto_from_an_example_of_size_one_says_the_example_fixed_it():
    """dynamic_dims='auto' keeps a dim of size one fixed; a call at another length was told the
    model's code had fixed it (found by fuzzing)."""
    placed = torchplace.place(Mixes().eval(), ["cpu:0", "cpu:1"], (torch.randn(4, 1, 8),), dynamic_dims="auto",
                              allow_single_device=False, trace_method="export", **QUICK)
    with torch.no_grad(), pytest.raises(UsageError, match=r"had size one in the example.*size 2 or more") as e:
        placed(torch.randn(4, 5, 8))
    assert "model's code" not in str(e.value)
