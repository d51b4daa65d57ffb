"""place(): placed models give the original outputs on 1, 2 and 3 logical devices; errors are clear."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import torchplace
from torchplace.errors import InfeasibleError, StageError, TraceError, UnsupportedError
from torchplace.models import build, leaf_modules_for
from torchplace.runtime.microbatch import gather, scatter

pytestmark = pytest.mark.usefixtures("mha_fastpath_off")

DEVICES = {1: ["cpu:0"], 2: ["cpu:0", "cpu:1"], 3: ["cpu:0", "cpu:1", "cpu:2"]}


def _tensors(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _assert_bitwise(a, b):
    xs, ys = _tensors(a), _tensors(b)
    assert len(xs) == len(ys) > 0
    for x, y in zip(xs, ys):
        assert torch.equal(x, y), f"max difference {(x - y).abs().max()}"


@pytest.fixture(scope="module")
def placed_models():
    """Place each example model once per device count (profiling is the slow part)."""
    cache = {}

    def get(name, n, granularity="operator"):
        key = (name, n, granularity)
        if key not in cache:
            model, inputs = build(name, batch=8)
            leaves = leaf_modules_for(name) if granularity == "module" else ()
            placed = torchplace.place(model, DEVICES[n], inputs, microbatches=4, granularity=granularity,
                                      leaf_modules=leaves, progress=False, repeats=2, warmup=1)
            cache[key] = (model, inputs, placed)
        return cache[key]

    return get


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("name, granularity", [
    ("mlp", "operator"), ("resnet", "operator"), ("transformer", "operator"),
    ("gpt2", "operator"), ("gpt2", "module"),
])
def test_placed_outputs_equal_the_original(placed_models, name, granularity, n):
    model, inputs, placed = placed_models(name, n, granularity)
    assert len({s.device for s in placed.plan.stages}) <= n
    placed.plan.validate(placed.problem)
    with torch.no_grad():
        placed.microbatches = 1
        _assert_bitwise(placed(*inputs), model(*inputs))  # one input batch, no split
        placed.microbatches = 4
        out = placed(*inputs)
        # micro-batched: bitwise equal to the model on the same micro-batches ...
        _assert_bitwise(out, gather([model(*a, **k) for a, k in scatter(inputs, {}, 4)]))
        # ... and equal up to float rounding of the batch-size-dependent kernels on the whole batch
        for x, y in zip(_tensors(out), _tensors(model(*inputs))):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_placed_module_accepts_other_batch_sizes(placed_models):
    model, inputs, placed = placed_models("gpt2", 2)
    ids = inputs[0][:3]
    placed.microbatches = 3
    with torch.no_grad():
        _assert_bitwise(placed(ids), gather([model(c) for c in ids.tensor_split(3)]))


def test_plan_objective_is_the_cost_model_value(placed_models):
    from torchplace import costmodel

    _, _, placed = placed_models("resnet", 3)
    assert placed.plan.objective == costmodel.evaluate(placed.problem, placed.plan)
    assert placed.plan.lower_bound <= placed.plan.objective
    assert "lower bound" in str(placed.plan)


def test_device_map_covers_every_parameter_holding_module(placed_models):
    model, _, placed = placed_models("mlp", 2)
    dm = placed.device_map()
    assert set(dm.values()) <= {"cpu:0", "cpu:1"}
    for name, _ in model.named_parameters():
        module = name.rpartition(".")[0]
        assert any(module == k or module.startswith(k + ".") or k == "" for k in dm), module


def test_unknown_device_lists_valid_ones():
    model, inputs = build("mlp")
    with pytest.raises(ValueError, match="unknown device 'gpu7'.*valid devices"):
        torchplace.place(model, ["gpu7"], inputs, progress=False)


def test_infeasible_memory_states_the_smallest_memory_that_fits():
    model, inputs = build("mlp", batch=4)
    with pytest.raises(InfeasibleError) as e:
        torchplace.place(model, ["cpu:0", "cpu:1"], inputs, max_memory={"cpu:0": 100, "cpu:1": 100}, progress=False)
    need = e.value.min_memory_bytes
    assert need is not None and need > 100
    assert str(need) in str(e.value)
    placed = torchplace.place(model, ["cpu:0", "cpu:1"], inputs, max_memory={"cpu:0": need, "cpu:1": need},
                              progress=False)
    assert max(c.memory for c in placed.plan.costs) <= need


class _Counting(nn.Module):
    """Dropout (its mode matters) and a buffer every call writes."""

    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.b(self.drop(torch.relu(self.a(x))))


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.filterwarnings("ignore:the model is in training mode")  # placed in training mode on purpose
def test_a_place_that_fails_or_is_interrupted_leaves_the_model_as_it_was(monkeypatch):
    """Ctrl-C (or an error) after tracing left a model in training mode in eval mode, and refine=True left the
    buffers its measured calls wrote (found by fuzzing). Interrupted while solving, then after refine's calls."""
    import torchplace.api
    from torchplace.placed_module import PlacedModule

    model, x = _Counting().train(), torch.randn(8, 8)
    with monkeypatch.context() as m:
        m.setattr(torchplace.api, "_solve", _ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, progress=False)
        with pytest.raises(KeyboardInterrupt):
            torchplace.plan_model(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, progress=False)
    assert all(module.training for module in model.modules())
    measure = PlacedModule.measure

    def measure_then_ctrl_c(self, *args, **kwargs):
        measure(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(PlacedModule, "measure", measure_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, progress=False, refine=True)
    assert all(module.training for module in model.modules())
    assert model.calls.item() == 0
    # after prepare() too: building the placed module, or refusing a Piper plan (found by review)
    with monkeypatch.context() as m:
        m.setattr(torchplace.api, "PlacedModule", _ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            torchplace.place(model, ["cpu:0", "cpu:1"], (x,), microbatches=1, progress=False)
    assert all(module.training for module in model.modules())
    model.eval()
    with pytest.raises(UnsupportedError, match="Piper plan"):
        torchplace.place(model, ["cpu:0", "cpu:1"], (x,), mode="training", parallelism="piper", microbatches=2,
                         progress=False)
    assert not any(module.training for module in model.modules())


def test_placing_a_model_in_training_mode_for_inference_says_it_puts_it_in_eval_mode():
    """A model built in code is in training mode; placing it for inference turned its dropout off and
    its batch norm to running statistics without a word, so the placed model (and the model) computed
    otherwise than the model had a moment before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8))
    x = torch.randn(8, 8)
    options = dict(microbatches=1, progress=False, warmup=0, repeats=1)
    with pytest.warns(torchplace.PlacementWarning, match=r"the model is in training mode, and placing it for inference "
                      r"puts it in eval mode, as model.eval\(\) does: 2 module\(s\) \(1 \(BatchNorm1d\), 2 \(Dropout\)\)"):
        placed = torchplace.place(model, ["cpu:0", "cpu:1"], (x,), **options)
    assert not model.training
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 8))  # the same in both modes
    for quiet in (model.eval(), plain):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torchplace.place(quiet, ["cpu:0", "cpu:1"], (x,), **options)
        assert not [w for w in caught if "training mode" in str(w.message)]


class _Attends(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class _Recurs(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, num_layers=2, dropout=dropout, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("model, x, warned", [
    # a batch norm without running statistics uses the batch's in eval mode too: the same outputs
    (nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, track_running_stats=False)), torch.randn(8, 8), False),
    # dropout that is no dropout module: an attention's, a stacked LSTM's between its layers
    (_Attends(0.5), torch.randn(4, 5, 8), True),
    (_Recurs(0.5), torch.randn(4, 5, 8), True),
    (_Attends(0.0), torch.randn(4, 5, 8), False),
])
def test_the_eval_mode_warning_names_the_modules_that_compute_otherwise_in_eval_mode(model, x, warned):
    """The warning named a batch norm without running statistics, which computes the same in both modes,
    and missed an attention's and an LSTM's dropout, which the switch to eval mode turned off, silently
    (found by review)."""
    from torchplace.api import _warn_of_eval_mode

    with torch.no_grad():
        torch.manual_seed(0)
        trained = model(x)
        evaluated = copy.deepcopy(model).eval()(x)
    assert torch.equal(trained, evaluated) is not warned  # what eval mode changes
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_of_eval_mode(model)
    assert bool([w for w in caught if "training mode" in str(w.message)]) is warned


def test_placing_draws_no_random_numbers_from_the_users_generator():
    """Profiling a training placement ran dropout and drew stand-in tensors from the global
    generator, so torch.manual_seed(0), then placing, then training drew other batches and masks
    than the same script without torchplace. place() and plan_model() put the generator back."""
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3)).train()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for call in (torchplace.place, torchplace.plan_model):
        torch.manual_seed(0)
        state = torch.get_rng_state()
        call(model, ["cpu:0", "cpu:1"], (x,), mode="training", microbatches=2, loss_fn=nn.functional.mse_loss,
             example_target=y, progress=False, repeats=1, warmup=1)
        assert torch.equal(torch.get_rng_state(), state), call.__name__


def test_cuda_generators_a_placement_starts_are_seeded_as_their_first_use_would_find_them(monkeypatch):
    """(found by review) random_state_kept restored only the CUDA generators in use when the block
    began: seeding, building on the CPU and placing on GPUs left profiling's draws on them. The
    ones the block starts are seeded again with torch.initial_seed() (the CUDA calls are stubbed:
    no GPU here)."""
    from torchplace.runtime.devices import random_state_kept

    torch.manual_seed(7)
    started, seeded = [False], []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: started[0])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    with random_state_kept():
        started[0] = True  # the block's first CUDA use
    assert seeded == [7]
    with random_state_kept():  # in use before the block: fork_rng puts their states back
        pass
    assert seeded == [7]


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: neither fx nor export can trace it
            return x * 2
        return x


def test_untraceable_model_raises_trace_error():
    with pytest.raises(TraceError, match="leaf_modules|export"):
        torchplace.place(_Branchy(), ["cpu:0"], (torch.randn(2, 3),), progress=False)


def test_stage_failure_names_the_stage(placed_models):
    _, _, placed = placed_models("mlp", 2)
    with pytest.raises(StageError, match=r"stage \d on cpu:\d failed"):
        placed(torch.randn(8, 5))  # wrong feature size


def test_unknown_objective_is_refused():
    model, inputs = build("mlp")
    with pytest.raises(ValueError, match="throughput"):
        torchplace.place(model, ["cpu:0"], inputs, objective="speed", progress=False)


def test_placed_decorator_places_on_first_call():
    from torchplace.models import MLP

    Placed = torchplace.placed(devices=["cpu:0", "cpu:1"], microbatches=2, progress=False)(MLP)
    net = Placed()
    with pytest.raises(torchplace.UsageError, match="first call"):
        _ = net.plan
    x = torch.randn(4, 32)
    with torch.no_grad():
        y = net(x)
        _assert_bitwise(y, gather([net.module(c) for c in x.tensor_split(2)]))
    assert len(net.plan.stages) >= 1
    assert Placed.__wrapped__ is MLP


# -- latency mode and non-contiguous splits --------------------------------------------------------
@pytest.mark.parametrize("name", ["inception", "resnet", "transformer", "bert"])
def test_latency_placement_gives_the_original_outputs(name):
    model, inputs = build(name, batch=2)
    placed = torchplace.place(model, DEVICES[2], inputs, objective="latency", time_limit=5,
                              progress=False, repeats=2, warmup=1)
    plan, problem = placed.plan, placed.problem
    assert problem.objective == "latency" and placed.microbatches == 1
    assert plan.objective == torchplace.costmodel.evaluate(problem, plan)
    assert 0 < plan.lower_bound <= plan.objective
    assert set(plan.meta["auto"]) >= {"m-sct", "m-etf"}
    with torch.no_grad():
        _assert_bitwise(placed(*inputs), model(*inputs))
    assert {s.worker for s in placed._executor.last_spans} <= set(DEVICES[2])


def test_latency_placement_runs_branches_on_both_devices():
    model, inputs = build("inception", batch=2)
    placed = torchplace.place(model, DEVICES[2], inputs, objective="latency", solver="m-etf",
                              progress=False, repeats=2, warmup=1)
    assert {s.device for s in placed.plan.stages} == set(DEVICES[2])
    with torch.no_grad():
        _assert_bitwise(placed(*inputs), model(*inputs))


@pytest.mark.parametrize("name", ["resnet", "transformer"])
def test_noncontiguous_placement_gives_the_original_outputs(name):
    model, inputs = build(name, batch=4)
    placed = torchplace.place(model, DEVICES[2], inputs, contiguous=False, solver="ip", time_limit=10,
                              microbatches=2, progress=False, repeats=2, warmup=1)
    assert not placed.problem.contiguous and placed.plan.solver == "maxload-ip"
    placed.plan.validate(placed.problem)
    with torch.no_grad():
        _assert_bitwise(placed(*inputs), gather([model(*a, **k) for a, k in scatter(inputs, {}, 2)]))


def test_fused_placement_expands_to_every_operator_and_gives_the_original_outputs():
    model, inputs = build("transformer", batch=4)
    placed = torchplace.place(model, DEVICES[3], inputs, fuse=True, microbatches=1, progress=False,
                              repeats=2, warmup=1)
    assert placed.plan.solver.endswith("+coarsen")
    assert sum(len(s.nodes) for s in placed.plan.stages) == len(placed.problem.graph)
    with torch.no_grad():
        _assert_bitwise(placed(*inputs), model(*inputs))


def test_latency_placement_that_does_not_fit_raises_infeasible():
    model, inputs = build("mlp")
    with pytest.raises(InfeasibleError):
        torchplace.place(model, DEVICES[2], inputs, objective="latency", max_memory={"cpu:0": 1, "cpu:1": 1},
                         progress=False, repeats=1, warmup=0)


def test_max_memory_caps_the_devices_of_a_given_cluster():
    from torchplace.devices import Cluster, Device

    model, inputs = build("mlp")
    cluster = Cluster((Device("cpu:0", "cpu", "cpu"), Device("cpu:1", "cpu", "cpu")))
    with pytest.raises(InfeasibleError):  # the caps were dropped: the plan ignored them
        torchplace.place(model, cluster, inputs, objective="latency", max_memory={"cpu:0": 1, "cpu:1": 1},
                         progress=False, repeats=1, warmup=0)
    with pytest.raises(ValueError, match=r"GPU index 0 is the device named 'cuda:0'"):
        torchplace.place(model, cluster, inputs, max_memory={0: "1GiB"}, progress=False)


def test_max_memory_caps_devices_planned_for_a_meta_model():
    from torchplace.devices import Device

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    devices = [Device("gpu0", "meta", "cuda"), Device("gpu1", "meta", "cuda")]
    plan, problem = torchplace.plan_model(model, devices, (torch.randn(2, 256),), objective="latency",
                                          max_memory={"gpu0": "300KB", "gpu1": "300KB"})  # was: "holds no data"
    assert [d.memory_bytes for d in problem.cluster.devices] == [300_000, 300_000]
    assert set(plan.assignment.values()) == {"gpu0", "gpu1"}  # 2 x 263 KB of weights: one per device


def test_a_batch_of_one_is_placed_for_latency():
    model, inputs = build("inception", batch=1)
    placed = torchplace.place(model, DEVICES[2], inputs, objective="latency", solver="m-etf",
                              progress=False, repeats=1, warmup=0)
    with torch.no_grad():
        _assert_bitwise(placed(*inputs), model(*inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("objective", ["latency", "throughput"])
@pytest.mark.parametrize("name", ["inception", "gpt2"])
def test_cuda_and_cpu_placement_gives_the_original_outputs(objective, name, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model, inputs = build(name, batch=4)
    reference = copy.deepcopy(model)  # placing moves the model's own parameters onto the devices
    gpu_share = sum(p.numel() * p.element_size() for p in model.parameters()) // 2  # so that it must split
    placed = torchplace.place(model, ["cuda:0", "cpu"], inputs, objective=objective, microbatches=1,
                              max_memory={"cuda:0": gpu_share}, granularity="module",
                              leaf_modules=leaf_modules_for(name), progress=False, repeats=2, warmup=1)
    with torch.no_grad():
        out, ref = placed(*inputs), reference(*inputs)
    for x, y in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-4, atol=1e-4)  # CUDA kernels round differently


def test_a_transformers_model_with_its_kv_cache_on_gets_the_real_fix():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     bos_token_id=1, eos_token_id=1)  # use_cache=True, the default
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TraceError, match=r"returns a DynamicCache .*use_cache=False"):
        torchplace.place(model, DEVICES[2], (ids,), progress=False, repeats=1, warmup=0)
    placed = torchplace.place(model, DEVICES[2], (ids,), example_kwargs={"use_cache": False}, progress=False,
                              repeats=1, warmup=0)  # the fix the message names
    with torch.no_grad():
        assert torch.equal(placed(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_an_encoder_decoder_with_its_cache_on_gets_a_fix_that_works_for_it():
    """The message said model.config.use_cache = False, which T5 ignores: its decoder keeps a copy
    of the config. The first fix it names now is the keyword, which works."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                   vocab_size=64)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 64, (2, 8))
    call = {"input_ids": ids, "decoder_input_ids": ids}
    with pytest.raises(TraceError, match=r"returns a EncoderDecoderCache .*; pass example_kwargs=\{'use_cache': False\}"):
        torchplace.place(model, DEVICES[2], example_kwargs=call, progress=False, repeats=1, warmup=0)
    placed = torchplace.place(model, DEVICES[2], example_kwargs={**call, "use_cache": False}, progress=False,
                              repeats=1, warmup=0)
    with torch.no_grad():
        assert torch.equal(placed(**call, use_cache=False).logits, model(**call, use_cache=False).logits)


def test_attention_that_takes_the_fast_path_under_no_grad_is_named_in_a_warning(monkeypatch):
    """Under no_grad an eval nn.MultiheadAttention runs a fused kernel no trace holds: the placed
    model differed from `with torch.no_grad(): model(x)` by 7e-7, and nothing said so."""
    from torchplace.errors import PlacementWarning

    model, inputs = build("transformer", batch=4)
    torch.backends.mha.set_fastpath_enabled(True)
    with torch.no_grad():
        fast = model(*inputs)
    with pytest.warns(PlacementWarning, match=r"layers.0.self_attn.*set_fastpath_enabled\(False\)"):
        placed = torchplace.place(model, ["cpu:0", "cpu:1"], inputs, microbatches=1, progress=False,
                                  allow_single_device=False, warmup=0, repeats=1, time_limit=2)
    with torch.no_grad():
        out = placed(*inputs)
        torch.testing.assert_close(out, fast)  # to float rounding ...
        torch.backends.mha.set_fastpath_enabled(False)
        assert torch.equal(out, model(*inputs))  # ... and bitwise on the ordinary path


def test_every_error_and_warning_is_reachable_from_the_package():
    """README names the errors as ``torchplace.X``: each class in torchplace.errors is exported."""
    import inspect

    import torchplace
    from torchplace import errors

    defined = {name for name, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__ and issubclass(c, (errors.TorchplaceError, Warning))}
    assert defined and all(getattr(torchplace, n) is getattr(errors, n) for n in defined)
    assert defined <= set(torchplace.__all__)
