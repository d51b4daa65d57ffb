"""A PlacedModule behaves like the model it places: its state dict, parameters and checkpoints are the
model's; what it cannot do exactly it refuses with a typed error; bad place() arguments are refused
before anything is traced (issue 9, items 4-6)."""
from __future__ import annotations

import collections
import copy
import json
import io
import pickle

import pytest
import torch
from torch import nn

import torchplace
from torchplace import api
from torchplace.errors import InvalidPlanError, PlacementWarning, UnsupportedError, UsageError
from torchplace.profiling.cache import FINGERPRINT
from torchplace.models import MLP, build
from torchplace.plan import Plan
from torchplace.profiling.cache import FORMAT as PROFILE_FORMAT

DEVICES = ["cpu:0", "cpu:1"]
QUICK = {"progress": False, "repeats": 1, "warmup": 0}


def _place(model, inputs, devices=DEVICES, **options):
    return torchplace.place(model, devices, inputs, **{**QUICK, **options})


@pytest.fixture(scope="module")
def gpt2():
    pytest.importorskip("transformers")
    model, (ids,) = build("gpt2", batch=4)
    reference, _ = build("gpt2", batch=4)
    placed = _place(model, (ids,), ["cpu:0", "cpu:1", "cpu:2"], granularity="module", leaf_modules=["GPT2Block"],
                    microbatches=1)
    return model, reference, ids, placed


# -- item 4: the model's state ----------------------------------------------------------------------
def test_state_dict_has_the_models_keys_and_tensors(gpt2):
    model, _, _, placed = gpt2
    ours, theirs = placed.state_dict(), model.state_dict()
    assert list(ours) == list(theirs)  # original keys (lm_head.weight too), no stages.* copies
    assert all(ours[k] is theirs[k] or ours[k].data_ptr() == theirs[k].data_ptr() for k in theirs)
    assert [id(p) for p in placed.parameters()] == [id(p) for p in model.parameters()]
    assert dict(placed.named_buffers()).keys() == dict(model.named_buffers()).keys()


def test_load_state_dict_of_the_original_model_changes_the_placed_outputs(gpt2, monkeypatch):
    model, reference, ids, placed = gpt2
    other, _ = build("gpt2", batch=4, seed=1)
    placed.load_state_dict(other.state_dict())  # strict, the original model's keys
    with torch.no_grad():
        assert torch.equal(placed(ids).logits, other(ids).logits)
    placed.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert torch.equal(placed(ids).logits, reference(ids).logits)
    with pytest.raises(UsageError, match="Missing key"):
        placed.load_state_dict({k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"} | {"x": 1})


def test_a_tied_weight_replica_follows_load_state_dict(monkeypatch):
    """With isolated devices the tied weight has a replica; loading new weights refreshes it."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")
    model, (ids,) = build("gpt2", batch=2)
    placed = _place(model, (ids,), granularity="module", leaf_modules=["GPT2Block"], microbatches=1,
                    plan=_two_device_plan(model, ids))
    assert placed._executor.stage_params.replicas >= 1
    other, _ = build("gpt2", batch=2, seed=3)
    placed.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(placed(ids).logits, other(ids).logits)


def _two_device_plan(model, ids):
    """A plan putting the first half of GPT-2's nodes on cpu:0, the rest on cpu:1."""
    probe = _place(model, (ids,), ["cpu:0"], granularity="module", leaf_modules=["GPT2Block"])
    order = probe.problem.graph.topological_order()
    half = len(order) // 2
    stages = [torchplace.Stage("cpu:0", tuple(order[:half])), torchplace.Stage("cpu:1", tuple(order[half:]))]
    return Plan(stages, objective=0.0, lower_bound=0.0, solver="manual", seconds=0.0, status="feasible")


def test_a_plan_file_and_a_state_dict_rebuild_the_placed_model(tmp_path):
    model, inputs = build("resnet", batch=4)
    placed = _place(model, inputs, microbatches=2)
    placed.plan.save(tmp_path / "plan.json")
    torch.save(placed.state_dict(), tmp_path / "weights.pt")
    fresh, _ = build("resnet", batch=4, seed=7)
    rebuilt = _place(fresh, inputs, plan=tmp_path / "plan.json", microbatches=2)
    rebuilt.load_state_dict(torch.load(tmp_path / "weights.pt"))
    assert [s.nodes for s in rebuilt.plan.stages] == [s.nodes for s in placed.plan.stages]
    rebuilt.plan.save(tmp_path / "again.json")  # a restarted job saves the plan it ran: it says "(given)" once
    again = _place(fresh, inputs, plan=tmp_path / "again.json", microbatches=2)
    assert again.plan.solver == rebuilt.plan.solver == f"{placed.plan.solver} (given)"
    with torch.no_grad():
        assert torch.equal(rebuilt(*inputs), placed(*inputs))


def test_a_plan_for_another_graph_is_refused():
    model, inputs = build("mlp", batch=4)
    plan = _place(model, inputs).plan
    other, other_inputs = build("resnet", batch=4)
    with pytest.raises(InvalidPlanError, match="made for another graph"):
        _place(other, other_inputs, plan=plan)


def test_a_non_contiguous_plan_given_without_contiguous_false_says_to_pass_it(tmp_path):
    """(found by fuzzing) a saved plan with two pieces on one device was refused as 'not contiguous
    (Tarnawski Def. 3.1)', without saying that place() needs contiguous=False to run it."""
    model, inputs = build("mlp", batch=4)
    probe = _place(model, inputs, ["cpu:0"], microbatches=2)
    order = probe.problem.graph.topological_order()
    stages = [torchplace.Stage(("cpu:0", "cpu:1")[i % 2], (v,)) for i, v in enumerate(order)]
    plan = Plan(stages, objective=0.0, lower_bound=0.0, solver="manual", seconds=0.0, status="feasible")
    with pytest.raises(InvalidPlanError, match="place it with contiguous=False"):
        _place(model, inputs, plan=plan, microbatches=2)
    placed = _place(model, inputs, plan=plan, microbatches=2, contiguous=False)
    with torch.no_grad():
        assert torch.equal(placed(*inputs), torch.cat([model(c) for c in inputs[0].tensor_split(2)]))


# -- issue 13, item 6: a saved plan skips profiling ---------------------------------------------------
def _count_profiling(monkeypatch):
    """Count the calls of what times operators (forward, and backward for training)."""
    calls = []
    for name in ("profile", "measure_backward"):
        real = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_saved_plan_of_the_same_model_is_run_without_profiling(tmp_path, monkeypatch, mode):
    model, inputs = build("mlp", batch=4)
    calls = _count_profiling(monkeypatch)
    placed = _place(model, inputs, microbatches=2, mode=mode)
    # the batch, then one of its 2 micro-batches (the call's prediction, torchplace.callplan), forward and backward
    assert calls == (["profile", "profile"] if mode == "inference" else ["profile", "measure_backward"] * 2)
    placed.plan.save(tmp_path / "plan.json")
    calls.clear()
    fresh, _ = build("mlp", batch=4, seed=3)  # other weights, same graph
    again = _place(fresh, inputs, microbatches=2, mode=mode, plan=tmp_path / "plan.json")
    assert calls == []  # nothing timed: the costs came with the plan
    assert [s.nodes for s in again.plan.stages] == [s.nodes for s in placed.plan.stages]
    assert again.plan.objective == placed.plan.objective
    assert again.problem.graph == placed.problem.graph
    if mode == "inference":
        (x,) = inputs
        with torch.no_grad():  # bitwise equal to the model run on the same two micro-batches
            assert torch.equal(again(x), torch.cat([fresh(x[:2]), fresh(x[2:])]))


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_saved_plan_runs_with_the_micro_batches_it_was_made_for(tmp_path, mode):
    model, inputs = build("mlp", batch=8)
    placed = _place(model, inputs, microbatches=8, mode=mode, allow_single_device=False)
    placed.plan.save(tmp_path / "plan.json")
    fresh, _ = build("mlp", batch=8, seed=3)
    again = _place(fresh, inputs, mode=mode, plan=tmp_path / "plan.json")  # no microbatches=: the plan's 8
    assert again.microbatches == 8 and again.plan.meta["call"]["microbatches"] == 8
    assert again.problem.pipeline.microbatches == 8  # its memory is counted for 8 micro-batches, as when solved
    other = _place(copy.deepcopy(fresh), inputs, mode=mode, plan=tmp_path / "plan.json", microbatches=2)
    assert other.microbatches == 2  # asked for: run (and its memory checked) with 2
    if mode == "inference":
        (x,) = inputs
        with torch.no_grad():
            assert torch.equal(again(x), torch.cat([fresh(c) for c in x.tensor_split(8)]))


def test_a_saved_training_plan_runs_with_the_schedule_it_was_made_for(tmp_path):
    """A plan solved for GPipe was run (and its memory counted) with place()'s default 1F1B when
    given back without schedule=, though its micro-batches were the plan's (found by fuzzing)."""
    model, inputs = build("mlp", batch=8)
    _place(model, inputs, microbatches=4, mode="training", schedule="gpipe").plan.save(tmp_path / "plan.json")
    again = _place(build("mlp", batch=8, seed=3)[0], inputs, mode="training", plan=tmp_path / "plan.json")
    assert again.problem.pipeline.schedule == again.plan.meta["schedule"] == "gpipe"
    other = _place(build("mlp", batch=8, seed=3)[0], inputs, mode="training", plan=tmp_path / "plan.json",
                   schedule="1f1b")
    assert other.problem.pipeline.schedule == other.plan.meta["schedule"] == "1f1b"  # asked for


def test_a_saved_plan_that_does_not_fit_the_memory_given_says_what_to_do(tmp_path):
    model, inputs = build("mlp", batch=8)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    with pytest.raises(InvalidPlanError, match=r"device 'cpu:0' needs \d+ bytes but has 1024: give it more memory "
                                               r"\(max_memory\), or a plan that puts less on it"):
        _place(model, inputs, microbatches=2, plan=tmp_path / "plan.json", max_memory={"cpu:0": "1KiB"})


def test_microbatches_auto_is_remembered_by_the_plan_it_chose(tmp_path):
    model, inputs = build("mlp", batch=8)
    placed = _place(model, inputs, microbatches="auto", allow_single_device=False)
    placed.plan.save(tmp_path / "plan.json")
    again = _place(build("mlp", batch=8, seed=3)[0], inputs, plan=tmp_path / "plan.json")
    assert again.microbatches == placed.microbatches
    assert "tried" not in again.plan.meta["call"]  # the plan's m is run, not searched for again
    assert Plan([], 0.0, 0.0, "manual", 0.0).microbatches == torchplace.plan.DEFAULT_MICROBATCHES == 4


def test_a_saved_plan_profiled_with_other_threads_is_profiled_again(tmp_path, monkeypatch):
    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    calls = _count_profiling(monkeypatch)
    devices = [torchplace.Device("cpu:0", "cpu", "cpu", threads=1), torchplace.Device("cpu:1", "cpu", "cpu", threads=1)]
    _place(model, inputs, devices, microbatches=2, plan=tmp_path / "plan.json")
    assert calls == ["profile", "profile"]  # times taken with other threads would not be this run's (batch, micro-batch)


@pytest.mark.parametrize("change", ["input shape", "dtype", "mode", "leaf_modules"])
def test_a_saved_plan_for_another_trace_is_refused(tmp_path, change):
    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    options = {"microbatches": 2, "plan": tmp_path / "plan.json"}
    if change == "input shape":
        _, inputs = build("mlp", batch=8)
    elif change == "dtype":  # the message names it among the causes
        model, inputs = model.double(), (inputs[0].double(),)
    elif change == "mode":
        options["mode"] = "training"
    else:
        options["leaf_modules"] = [nn.Linear]
    expected = "was solved for mode='inference', not 'training'" if change == "mode" else (
        "was made for another graph .*another model dtype.*leave out plan=")
    with pytest.raises(InvalidPlanError, match=rf"plan file .*plan\.json.* {expected}"):
        _place(model, inputs, **options)


def test_a_latency_plan_is_not_run_as_a_pipeline(tmp_path):
    """Plan files did not say their objective: a latency plan given to place() without
    objective='latency' was refused for contiguity, or with contiguous=False run as a pipeline of
    4 micro-batches, and reports drew it as one (found by fuzzing)."""
    model, inputs = build("mlp", batch=4)
    plan = _place(model, inputs, objective="latency", allow_single_device=False).plan
    assert (plan.meta["objective"], plan.meta["mode"]) == ("latency", "inference")
    plan.save(tmp_path / "plan.json")
    for options in ({}, {"contiguous": False}):
        with pytest.raises(InvalidPlanError, match="was solved for objective='latency', not 'throughput'"):
            _place(model, inputs, plan=tmp_path / "plan.json", **options)
    placed = _place(model, inputs, plan=tmp_path / "plan.json", objective="latency")
    assert placed.microbatches == 1
    from torchplace.cli import main

    assert main(["report", str(tmp_path / "plan.json"), "-o", str(tmp_path / "plan.html")]) == 0
    assert "s (latency of one call)" in (tmp_path / "plan.html").read_text()


@pytest.mark.parametrize("saved", [None, "torchplace.fingerprint/1", "torchplace.fingerprint/2"])
def test_a_plan_saved_by_another_version_is_refused_as_such(tmp_path, saved):
    import json

    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    profile = data["meta"]["profile"]
    assert profile["format"] == FINGERPRINT == "torchplace.fingerprint/3"  # /3: nodes' kernel scratch counted
    if saved is None:
        del profile["format"]  # a plan from before the format was stored
    else:
        profile["format"] = saved
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(InvalidPlanError, match=r"saved by another version of torchplace .*Leave out plan=") as e:
        _place(model, inputs, microbatches=2, plan=tmp_path / "plan.json")
    assert "another graph" not in str(e.value)


def test_an_edited_profile_in_a_plan_file_is_named(tmp_path):
    import json

    from torchplace.errors import WorkloadFormatError

    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["meta"]["profile"]["graph"]["nodes"][0]["times"] = {"cpu": -1}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=r"meta\.profile\.graph: nodes\[0\]"):
        _place(model, inputs, microbatches=2, plan=tmp_path / "plan.json")


@pytest.mark.parametrize(("edit", "field"), [
    (lambda e: "nan", ": expected an object"),
    (lambda e: {**e, "readers": 1}, ".readers: expected a list of strings"),
    (lambda e: {**e, "bytes": -4}, ".bytes"),
    (lambda e: {**e, "owner": 3}, ".owner: expected a node id"),
])
def test_an_edited_tensor_entry_in_a_plan_file_is_named(tmp_path, edit, field):
    """A tensor entry of the stored profile was read unchecked: AttributeError or TypeError deep
    in the cost model (found by fuzzing)."""
    import re

    from torchplace.errors import WorkloadFormatError

    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    state = data["meta"]["profile"]["graph"]["meta"]["state"]
    name = next(iter(state))
    state[name] = edit(state[name])
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=re.escape(f"meta.profile.graph: meta.state[{name!r}]{field}")):
        _place(model, inputs, microbatches=2, plan=tmp_path / "plan.json")


@pytest.mark.parametrize(("key", "value"), [("outputs", float("nan")), ("outputs", [{}]), ("inputs", 3),
                                            ("aliases", {"linear": ["nowhere"]})])
def test_an_edited_graph_record_in_a_plan_file_is_named(tmp_path, key, value):
    """(found by fuzzing) the stored profile's record of the graph's inputs, outputs and views was read
    unchecked: a TypeError deep in the cost model, or memory priced for another graph."""
    from torchplace.errors import WorkloadFormatError

    model, inputs = build("mlp", batch=4)
    _place(model, inputs, microbatches=2).plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    data["meta"]["profile"]["graph"]["meta"][key] = value
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=rf"meta\.profile\.graph\.meta\.{key} is not this model's"):
        _place(model, inputs, microbatches=2, plan=tmp_path / "plan.json")


class WritesAValueInPlace(nn.Module):
    """``h`` is written in place twice after another layer read it: its writers share a device."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        g = self.b(h)
        h[:, :8] = g[:, :8]
        h.mul_(2)
        return self.d(self.c(h))


@pytest.mark.parametrize("edit", ["colocation", "edge", "fx_nodes"])
def test_a_plan_file_whose_profile_lost_a_constraint_is_refused(tmp_path, monkeypatch, edit):
    """The stored graph's costs are a cache, but the Problem was built from the file's graph, so a
    file with its colocation labels removed let the in-place writes of h run on another device than
    its readers: outputs 1.3 off (found by fuzzing)."""
    from torchplace.errors import WorkloadFormatError

    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")
    torch.manual_seed(0)
    model, x = WritesAValueInPlace().eval(), torch.randn(8, 16)
    _place(copy.deepcopy(model), (x,), microbatches=1, allow_single_device=False).plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    graph = data["meta"]["profile"]["graph"]
    if edit == "colocation":
        assert any(n["colocation"] for n in graph["nodes"])
        for n in graph["nodes"]:
            n["colocation"] = None
        message = r"no longer keeps .*'mul_' on one device"
    elif edit == "edge":
        graph["edges"] = graph["edges"][1:]
        message = r"lacks the edge"
    else:  # (found by fuzzing) the split follows each node's operators: another node's were taken on trust
        runs = [n for n in graph["nodes"] if n.get("fx_nodes")]
        runs[0]["fx_nodes"] += runs[-1]["fx_nodes"]
        runs[-1]["fx_nodes"] = []
        message = r"runs other operators than in this model's graph"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(WorkloadFormatError, match=message):
        _place(model, (x,), microbatches=1, plan=tmp_path / "plan.json")


@pytest.mark.parametrize("operation", [
    pickle.dumps, copy.deepcopy, copy.copy, lambda m: torch.save(m, io.BytesIO()),
], ids=["pickle", "deepcopy", "copy", "torch.save"])
def test_copying_or_saving_the_module_says_what_to_save_instead(operation):
    model, inputs = build("mlp", batch=4)
    placed = _place(model, inputs)
    with pytest.raises(UnsupportedError, match=r"plan.save\('plan.json'\)"):
        operation(placed)


@pytest.mark.parametrize("operation", [
    lambda m: m.to("cpu"), lambda m: m.half(), lambda m: m.cpu(), lambda m: m.float(),
    lambda m: m.load_state_dict(m.state_dict(), assign=True),
], ids=["to", "half", "cpu", "float", "assign"])
def test_moving_or_replacing_the_placed_tensors_is_refused(operation):
    model, inputs = build("mlp", batch=4)
    placed = _place(model, inputs, microbatches=1)
    with pytest.raises(UnsupportedError, match="place"):
        operation(placed)
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))


# -- item 5: train mode ---------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:the model is in training mode")  # placed in training mode on purpose
def test_train_mode_is_refused_and_changes_nothing():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8))
    x = torch.randn(6, 8)
    placed = _place(model, (x,), microbatches=1)
    with pytest.raises(UnsupportedError, match="placed for inference"):
        placed.train()
    assert not placed.training and not any(m.training for m in model.modules())
    placed.eval()
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))


# -- item 6: inputs ----------------------------------------------------------------------------------
def test_one_tensor_is_one_input_not_a_batch_of_inputs():
    model, (x,) = build("mlp", batch=8)
    placed = _place(model, x, microbatches=1)
    assert len(placed.problem.graph.meta["inputs"]) == 1
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, mask=None, *, scale=1.0):
        h = self.a(x) * scale
        if mask is not None:
            h = h * mask
        return self.b(h)


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_keyword_example_inputs(trace_method):
    model = Scaled().eval()
    x, mask = torch.randn(6, 8), (torch.rand(6, 8) > 0.5).float()
    placed = _place(model, (x,), example_kwargs={"mask": mask}, trace_method=trace_method, microbatches=2)
    with torch.no_grad():
        assert torch.allclose(placed(x, mask=mask), model(x, mask=mask), rtol=0, atol=1e-6)
        assert torch.equal(placed(x, mask=mask), torch.cat([model(x[:3], mask=mask[:3]), model(x[3:], mask=mask[3:])]))


def test_keyword_example_inputs_of_a_transformers_model():
    pytest.importorskip("transformers")
    model, (ids,) = build("gpt2", batch=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    placed = _place(model, (), example_kwargs={"input_ids": ids, "attention_mask": mask}, microbatches=1)
    with torch.no_grad():
        assert torch.equal(placed(input_ids=ids, attention_mask=mask).logits,
                           model(input_ids=ids, attention_mask=mask).logits)


def test_the_decorator_takes_keyword_inputs_on_the_first_call():
    placed_cls = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(Scaled)
    net = placed_cls()
    x, mask = torch.randn(4, 8), torch.ones(4, 8)
    with torch.no_grad():
        assert torch.equal(net(x, mask=mask), net.module(x, mask=mask))
    assert "placed" not in dict(net.named_children())  # no second copy of the weights in state_dict


def _never_profile(*args, **kwargs):
    raise AssertionError("profiling started before the arguments were checked")


@pytest.mark.parametrize("inputs, kwargs, fragment", [
    ((torch.randn(4, 9),), None, "fails on example_inputs"),              # wrong shape
    ((torch.randint(0, 5, (4, 8)),), None, "fails on example_inputs"),    # wrong dtype
    ((), None, "fails on example_inputs"),                                # no inputs
    ((torch.randn(0, 8),), None, "batch size 0"),                         # empty batch
    ({"x": torch.randn(4, 8)}, None, "example_kwargs"),                   # a dict as positional inputs
    ((torch.randn(4, 8),), [1, 2], "example_kwargs must be a dict"),
    ("x", None, "example_inputs must be"),
])
def test_bad_example_inputs_are_refused_before_profiling(monkeypatch, inputs, kwargs, fragment):
    """Malformed arguments are refused before anything runs; inputs the model fails on are found
    when tracing fails (the model is not run eagerly first), and named as the cause."""
    monkeypatch.setattr(api, "profile", _never_profile)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(UsageError, match=fragment):
        torchplace.place(model, DEVICES, inputs, example_kwargs=kwargs)


class _CountsEagerCalls(nn.Module):
    """A linear layer that counts the calls of its forward on real tensors (not on the fake
    tensors or proxies tracing passes)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.calls = nn.Linear(8, 8), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor:
            self.calls.append(len(x))
        return self.linear(x).relu()


def test_place_runs_the_model_on_the_example_batch_only_for_the_loss():
    """Checking the example call eagerly cost a full forward of every place() (2.7 s of GPT-2
    small's 16 s): an inference place() runs the model's own forward on one sample only (whether
    it branches on a batch of one); a training one also on two (whether the trace differentiates
    as it does), on one and two in eval mode (whether dim 0 is the batch) and, with a loss, once on
    the example, to measure the loss's memory."""
    model = _CountsEagerCalls()
    torchplace.place(model, DEVICES, torch.randn(4, 8), trace_method="export", **QUICK)
    assert model.calls == [1]
    model.calls.clear()
    torchplace.place(model, DEVICES, torch.randn(4, 8), trace_method="export", mode="training",
                     loss_fn=lambda out, target: out.pow(2).mean(), example_target=torch.zeros(4), **QUICK)
    assert sorted(model.calls) == [1, 1, 2, 2, 4]


def test_a_model_left_on_several_devices_is_named_as_the_cause():
    # found on an H100: placing a model a second time, after the first place() moved its tensors
    # to cuda:0 and the CPU; here the meta device stands in for the GPU
    from torchplace.arguments import try_example_call

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[2].to("meta")
    with pytest.raises(UsageError, match=r"several devices \(cpu, meta\).*fresh copy"):
        try_example_call(model, (torch.randn(4, 8),), {})


@pytest.mark.parametrize("options, fragment", [
    ({"microbatches": 2.5}, "microbatches"), ({"microbatches": 0}, "microbatches"),
    ({"time_limit": float("nan")}, "time_limit"), ({"time_limit": -1}, "time_limit"),
    ({"repeats": 0}, "repeats"), ({"warmup": -1}, "warmup"),
    ({"objective": "speed"}, "objective"), ({"leaf_modules": ["Lineer"]}, "did you mean 'Linear'"),
    ({"leaf_modules": [3]}, "leaf_modules must hold"), ({"granularity": "layer"}, "granularity"),
    ({"trace_method": "jit"}, "trace method"), ({"plan": 3}, "plan must be"),
    ({"objective": "latency", "microbatches": 4}, "objective='latency' runs each call whole"),
])
def test_bad_options_are_refused_before_profiling(monkeypatch, options, fragment):
    monkeypatch.setattr(api, "profile", _never_profile)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(UsageError, match=fragment):
        torchplace.place(model, DEVICES, (torch.randn(4, 8),), **options)


def test_a_model_on_the_meta_device_or_not_a_module_is_refused():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(UsageError, match="meta device"):
        torchplace.place(model, DEVICES, (torch.randn(4, 32),))
    with pytest.raises(UsageError, match="nn.Module"):
        torchplace.place(lambda x: x, DEVICES, (torch.randn(4, 32),))


def test_leaf_modules_by_class_name_as_in_accelerate():
    model, inputs = build("resnet", batch=4)
    by_name = _place(model, inputs, granularity="module", leaf_modules=["ResidualBlock"])
    modules = {r.module for _, r in by_name.problem.graph.records()}
    assert "blocks.0" in modules and not any(m.startswith("blocks.0.") for m in modules)


class Identity(nn.Module):
    def forward(self, x):
        return x


def test_a_model_with_no_operators_gets_a_one_stage_plan(tmp_path):
    x = torch.randn(4, 8)
    placed = _place(Identity(), (x,))
    assert len(placed.plan.stages) == 1 and placed.plan.stages[0].nodes == ()
    assert placed.plan.objective == 0.0
    with torch.no_grad():
        assert torch.equal(placed(x), x)
    placed.plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").stages == placed.plan.stages


class SharedLayer(nn.Module):
    """One module called in two places."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) + self.a(self.b(x))


def test_refresh_replicas_after_a_write_through_data(monkeypatch):
    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")
    torch.manual_seed(0)
    model = SharedLayer().eval()
    x = torch.randn(4, 8)
    from torchplace.plan import Plan as _Plan, stages_from_order
    probe = _place(model, (x,), ["cpu:0", "cpu:1"], microbatches=1)
    order = probe.problem.graph.topological_order()
    assignment = {v: "cpu:0" if i == 0 else "cpu:1" for i, v in enumerate(order)}
    plan = _Plan.build(probe.problem, stages_from_order(probe.problem, order, assignment), solver="manual",
                       seconds=0.0, lower_bound=0.0)
    placed = _place(model, (x,), ["cpu:0", "cpu:1"], microbatches=1, plan=plan)
    assert placed._executor.stage_params.replicas == 2  # a.weight and a.bias on cpu:1
    with torch.no_grad():
        model.a.weight.data.mul_(2)  # moves neither the version counter nor the memory
        placed.refresh_replicas()
        assert torch.equal(placed(x), model(x))
        model.a.weight.mul_(2)  # an ordinary in-place update is noticed by itself
        assert torch.equal(placed(x), model(x))


def test_calling_the_model_after_model_train_is_refused():
    model, inputs = build("mlp", batch=4)
    placed = _place(model, inputs, microbatches=1)
    model.train()
    with pytest.raises(UnsupportedError, match="training mode"):
        placed(*inputs)
    model.eval()
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))


def test_the_decorator_refuses_train_mode():
    net = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(MLP)()
    with pytest.raises(UnsupportedError, match="placed for inference"):
        net.train()


def test_the_decorator_refuses_conversions_once_placed_and_plan_before():
    """(found by fuzzing) .double() after the first call converted the placed weights in place, and
    the next call failed with a misleading error; .plan before the first call was a RuntimeError."""
    net = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(MLP)()
    with pytest.raises(UsageError, match="placed on its first call"):
        net.plan
    net.double()  # before placing: converts the model, which is then placed as float64
    x = torch.randn(4, 32, dtype=torch.float64)
    net(x)
    for convert in (lambda: net.float(), lambda: net.to(torch.float16), lambda: net.half()):
        with pytest.raises(UnsupportedError, match="would undo the placement"):
            convert()
    assert all(p.dtype == torch.float64 for p in net.parameters())
    with torch.no_grad():
        assert torch.equal(net(x), net.module(x))


def test_the_decorated_model_offers_the_placed_models_methods():
    """An instance of a @placed class is a wrapper: its device_map() was an AttributeError."""
    net = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(MLP)()
    with pytest.raises(UsageError, match=r"call it once before using \.device_map"):
        net.device_map()
    x = torch.randn(4, 32)
    net(x)
    assert net.device_map() == net.placed.device_map() and net.device_map()
    assert net.plot_memory is not None and net.microbatches == net.placed.microbatches
    with pytest.raises(AttributeError):
        net.no_such_attribute


def test_the_decorated_model_has_the_models_state_dict_keys():
    """(found by fuzzing) a @placed instance's state_dict had 'module.'-prefixed keys, so a checkpoint of
    the model did not load into it (a raw RuntimeError) nor its checkpoint into the model."""
    net = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(MLP)()
    plain = MLP()
    assert list(net.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in net.named_parameters()] == [n for n, _ in plain.named_parameters()]
    net.load_state_dict(plain.state_dict())  # before the first call: the model's own
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(net(x), plain(x))
    assert not net.training and not net.module.training  # placed for inference: in eval mode, as the model
    other = MLP()
    net.load_state_dict(other.state_dict())  # once placed: the placed model's, which copies onto the devices
    with torch.no_grad():
        assert torch.equal(net(x), other(x))
    plain.load_state_dict(net.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    with pytest.raises(UsageError, match="Missing key"):
        net.load_state_dict({"x": torch.zeros(1)})


@pytest.mark.parametrize(("options", "message"), [
    ({"microbatch": 2}, "did you mean 'microbatches'"),
    ({"example_kwargs": {}}, "first call's inputs are the examples"),
])
def test_the_decorator_refuses_an_option_place_does_not_take_at_once(options, message):
    """(found by fuzzing) a misspelt option was kept until the first call of each instance, which then
    raised a raw TypeError from place()."""
    with pytest.raises(UsageError, match=message):
        torchplace.placed(devices=DEVICES, **options)


def test_a_decorated_training_model_switches_modes_with_its_model():
    net = torchplace.placed(devices=DEVICES, microbatches=1, mode="training", **QUICK)(MLP)()
    x = torch.randn(4, 32)
    net(x)
    net.eval()
    assert not net.training and not any(m.training for m in net.module.modules())
    with torch.no_grad():
        assert torch.equal(net(x), net.module(x))
    net.train()
    assert net.training and all(m.training for m in net.module.modules())


def test_a_placed_model_is_not_placed_again():
    """Placing a placed module (or a model holding one) failed inside fx with a message about
    control flow or about `is None` branches (found by fuzzing)."""
    model, inputs = build("mlp", batch=4)
    placed = _place(model, inputs, microbatches=1)
    with pytest.raises(UsageError, match="the model is already placed by torchplace"):
        _place(placed, inputs)
    with pytest.raises(UsageError, match="submodule '1' is already placed"):
        _place(nn.Sequential(nn.Identity(), placed), inputs)
    lazy = torchplace.placed(devices=DEVICES, microbatches=1, **QUICK)(MLP)()
    with pytest.raises(UsageError, match="already placed"):
        _place(lazy, inputs)


class SparseBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("adj", torch.eye(8).to_sparse())

    def forward(self, x):
        return torch.sparse.mm(self.adj, self.a(x).t()).t()


def test_a_sparse_buffer_is_placed_with_fx():
    model = SparseBuffer().eval()
    x = torch.randn(4, 8)
    placed = _place(model, (x,), microbatches=1, trace_method="fx")
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))


class IdentityWithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.register_buffer("b", torch.zeros(2))

    def forward(self, x):
        return x


def test_a_model_with_no_operators_maps_its_tensors_to_its_one_stage():
    placed = _place(IdentityWithState(), (torch.randn(4, 3),))
    assert placed.device_map() == {"": placed.plan.stages[0].device}


class WritesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        self.a.weight.mul_(1.0)  # an in-place write of a parameter in forward
        return self.a(x)


def test_a_forward_that_writes_a_parameter_is_refused_rather_than_changed():
    model = WritesItsWeight()
    before = model.a.weight.detach().clone()
    with pytest.raises(UnsupportedError, match="writes its parameter 'a.weight'"):
        _place(model, (torch.randn(4, 8),))
    assert torch.equal(model.a.weight, before)


def test_a_profile_cache_makes_a_second_place_time_nothing(tmp_path, monkeypatch):
    model, inputs = build("mlp", batch=8)
    first = _place(model, inputs, microbatches=2, profile_cache=tmp_path / "profiles")
    files = sorted((tmp_path / "profiles").glob("*.json"))
    assert files, "nothing was kept"  # the whole batch, and one micro-batch for the call prediction
    monkeypatch.setattr(api, "profile", _never_profile)
    again = _place(copy.deepcopy(model), inputs, microbatches=2, profile_cache=tmp_path / "profiles")
    assert again.plan.stages == first.plan.stages and again.plan.objective == first.plan.objective
    with torch.no_grad():
        assert torch.equal(again(*inputs), model(*inputs))
    # other example shapes are another profile: profiling starts (and is refused here)
    with pytest.raises(AssertionError, match="profiling started"):
        _place(copy.deepcopy(model), (torch.randn(4, *inputs[0].shape[1:]),), microbatches=2,
               profile_cache=tmp_path / "profiles")


def test_a_profile_cache_of_another_thread_count_is_not_reused(tmp_path, monkeypatch):
    """A profile timed with torch.set_num_threads(1) (torchrun's OMP_NUM_THREADS=1) was reused by a
    place() with more threads, its CPU times those of one thread (found by fuzzing)."""
    model, inputs = build("mlp", batch=8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _place(model, inputs, microbatches=2, profile_cache=tmp_path)
        torch.set_num_threads(2)
        monkeypatch.setattr(api, "profile", _never_profile)
        with pytest.raises(AssertionError, match="profiling started"):
            _place(copy.deepcopy(model), inputs, microbatches=2, profile_cache=tmp_path)
    finally:
        torch.set_num_threads(before)


def test_an_unreadable_profile_is_profiled_again_and_said(tmp_path):
    model, inputs = build("mlp", batch=8)
    _place(model, inputs, microbatches=1, profile_cache=tmp_path)
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")
    with pytest.warns(PlacementWarning, match="cannot be read"):
        placed = _place(copy.deepcopy(model), inputs, microbatches=1, profile_cache=tmp_path)
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))
    assert all(json.loads(f.read_text())["format"] == PROFILE_FORMAT for f in tmp_path.glob("*.json"))


@pytest.mark.parametrize("edit", ["colocation", "outputs"])
def test_a_profile_on_disk_that_lost_the_models_structure_is_profiled_again(tmp_path, monkeypatch, edit):
    """(found by fuzzing) a profile_cache file was trusted whole: with its colocation labels removed, the
    solver split the in-place writers of h from its readers (outputs differed); with its record of the
    outputs edited, the cost model raised a TypeError. Both are unreadable, as for a plan file's profile."""
    monkeypatch.setenv("TORCHPLACE_ISOLATE_DEVICES", "1")
    torch.manual_seed(0)
    model, x = WritesAValueInPlace().eval(), torch.randn(8, 16)
    _place(copy.deepcopy(model), (x,), microbatches=1, profile_cache=tmp_path)
    for f in tmp_path.glob("*.json"):
        data = json.loads(f.read_text())
        if edit == "colocation":
            assert any(n["colocation"] for n in data["graph"]["nodes"])
            for n in data["graph"]["nodes"]:
                n["colocation"] = None
        else:
            data["graph"]["meta"]["outputs"] = 3
        f.write_text(json.dumps(data))
    with pytest.warns(PlacementWarning, match="cannot be read"):
        placed = _place(copy.deepcopy(model), (x,), ["cpu:0", "cpu:1", "cpu:2"], microbatches=1, contiguous=False,
                        profile_cache=tmp_path, allow_single_device=False)
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))


def test_a_profile_cache_that_cannot_be_written_is_said_and_the_model_placed(tmp_path):
    """A cache directory that could not be made or written (here under a file; a read-only or full
    disk alike) failed place() with an OSError after all its profiling (found by fuzzing)."""
    (tmp_path / "f").write_text("")
    model, inputs = build("mlp", batch=8)
    with pytest.warns(PlacementWarning, match=r"profile cache: .* cannot be written \(NotADirectoryError.*placing "
                                              r"without keeping this profile"):
        placed = _place(model, inputs, microbatches=1, profile_cache=tmp_path / "f" / "cache")
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))


def test_a_profile_cache_that_is_a_file_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "profile", _never_profile)
    (tmp_path / "f").write_text("")
    model, inputs = build("mlp", batch=8)
    with pytest.raises(UsageError, match="is a file"):
        torchplace.place(model, DEVICES, inputs, profile_cache=tmp_path / "f")


class OptionalScale(nn.Module):
    """Scales by ``scale`` when given, and by ``k`` (a number): fx traces an omitted ``scale`` as if
    given, unless it is traced with the example's values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, scale=None, k=2.0):
        h = torch.tanh(self.a(x)) * k
        if scale is not None:
            h = h * scale
        return self.b(h)


def test_fx_traces_the_branch_of_an_input_the_example_leaves_out():
    """fx traced ``if scale is not None:`` as taken when the example left ``scale`` out, and
    place() failed with a bare TypeError in its own run of the graph (found by fuzzing)."""
    torch.manual_seed(0)
    model, x = OptionalScale().eval(), torch.randn(4, 8)
    expected = model(x)
    placed = _place(model, (x,), trace_method="fx", microbatches=1, allow_single_device=False)
    assert placed._traced.method == "fx"
    with torch.no_grad():
        assert torch.equal(placed(x), expected)
        assert torch.equal(placed(x, None, 2.0), expected)  # the example's values, given
        assert torch.equal(placed(x, k=3.0), model(x, k=3.0))  # a number is traced as an input
        with pytest.raises(UsageError, match=r"'scale' is a tensor of shape \(4, 8\), but .* traced with None"):
            placed(x, scale=torch.full((4, 8), 3.0))


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_a_tensor_input_left_out_of_a_call_is_refused(trace_method):
    """Given a tensor in the example, an fx trace reads it as one: a call that left it out ran the
    graph with None, without the branch the model takes for None (found by fuzzing)."""
    torch.manual_seed(0)
    model, x = OptionalScale().eval(), torch.randn(4, 8)
    scale, expected = torch.rand(4, 8), model(x, scale=torch.rand(4, 8), k=3.0)
    placed = _place(model, (x,), example_kwargs={"scale": scale, "k": 3.0}, trace_method=trace_method,
                    microbatches=2, allow_single_device=False)
    with torch.no_grad():
        expected = torch.cat([model(x[:2], scale=scale[:2], k=3.0), model(x[2:], scale=scale[2:], k=3.0)])
        assert torch.equal(placed(x, scale=scale, k=3.0), expected)
        with pytest.raises(UsageError, match="input 'scale' is None, but the example gave a tensor|called as"):
            placed(x, k=3.0)


@pytest.mark.parametrize("change", ["parameter", "module", "hook", "backward hook", "attribute"])
def test_a_model_changed_by_assignment_after_placing_is_refused(change):
    """An assignment after placing changed the model and its state_dict, but the stages kept
    running what was placed, silently; an in-place write is followed (found by fuzzing)."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 32)
    placed = _place(model, (x,), microbatches=1, allow_single_device=False)
    with torch.no_grad():
        first = model.net[0]
        first.weight.mul_(2)  # in place: followed
        assert torch.equal(placed(x), copy.deepcopy(model)(x))
        if change == "parameter":
            first.weight = nn.Parameter(first.weight * 2)
        elif change == "module":
            model.net[0] = nn.Linear(first.in_features, first.out_features)
        elif change == "hook":
            first.register_forward_hook(lambda module, args, out: out * 0)
        elif change == "backward hook":  # never runs on the traced graph: the gradients would differ silently
            first.register_full_backward_hook(lambda module, grad_in, grad_out: tuple(g * 0 for g in grad_in))
        else:
            model.net[1].inplace = True  # a plain attribute the trace took as a constant
        with pytest.raises(UnsupportedError, match="after placing"):
            placed(x)


class TakesKeywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, **kwargs):  # reading kwargs: fx fails, export traces it (without the keywords)
        h = self.a(x)
        return self.b(torch.relu(h * 2 if kwargs.get("double") else h))


def test_a_keyword_through_var_keyword_is_refused_with_advice_that_works():
    """transformers 5 takes output_hidden_states through **kwargs: the refusal said to place the
    model with it in example_kwargs, which export then refuses (found by fuzzing)."""
    placed = _place(TakesKeywords().eval(), (torch.randn(4, 8),), microbatches=1)
    with torch.no_grad(), pytest.raises(UsageError, match=r"through \*\*kwargs.*set it on the model instead"):
        placed(torch.randn(4, 8), output_hidden_states=True)
    scaled = _place(Scaled().eval(), (torch.randn(4, 8),), trace_method="export", microbatches=1)
    with torch.no_grad(), pytest.raises(UsageError, match="example_kwargs$"):  # a named parameter: no such advice
        scaled(torch.randn(4, 8), scale=1.0)


def test_functional_call_of_a_placed_model_is_refused_naming_it():
    """torch.func.functional_call swaps tensors into the placed model, which its stages never see;
    the refusal spoke of an assignment only (found by fuzzing)."""
    model = MLP().eval()
    x = torch.randn(4, 32)
    placed = _place(model, (x,), microbatches=1, allow_single_device=False)
    params = {name: p.detach().clone() for name, p in placed.named_parameters()}
    with pytest.raises(UnsupportedError, match="functional_call and torch.export swap tensors in"):
        torch.func.functional_call(placed, params, (x,))
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))  # the swap was undone: the placed model runs on


class CountsItsCalls(nn.Module):
    """Counts its calls in a buffer (so "auto" exports it) and takes a mask of any dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x, mask):
        self.n += 1
        return self.b(torch.relu(self.a(x))) * mask.to(torch.float32)


def test_an_input_of_another_dtype_than_the_export_s_is_refused_before_any_stage_runs():
    """torch.export asserts each input's dtype inside the graph: a bool mask where the example's was
    int64 failed mid-call as a StageError, after earlier stages had counted the call (found by fuzzing)."""
    x, mask = torch.randn(4, 8), torch.ones(4, 1, dtype=torch.long)
    model = CountsItsCalls().eval()
    placed = _place(model, (x, mask), microbatches=1)
    assert placed._traced.method == "export"
    with torch.no_grad(), pytest.raises(UsageError, match=r"input 'mask' is torch.bool, but .* torch.int64"):
        placed(x, mask.bool())
    assert model.n.item() == 0


def test_an_example_input_that_is_a_view_is_exported_as_a_dense_tensor():
    """torch.export turned a sliced example's base and strides into guards that the recording run's
    copies failed: place() raised an AttributeError (found by fuzzing)."""
    torch.manual_seed(0)
    big, mask = torch.randn(4, 16), torch.ones(4, 1, dtype=torch.long)
    model = CountsItsCalls().eval()
    reference = copy.deepcopy(model)
    placed = _place(model, (big[:, :8], mask), trace_method="export", microbatches=1)  # it counts calls: m=1
    with torch.no_grad():
        out, expected = placed(big[:, 8:], mask), reference(big[:, 8:], mask)
    assert torch.equal(out, expected) and model.n.item() == reference.n.item() == 1


class ReturnsOrderedDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return collections.OrderedDict(logits=self.b(h), hidden=h)


def test_an_fx_trace_returns_the_model_s_own_output_containers():
    """fx returns a plain dict for an OrderedDict or a transformers ModelOutput: `out.logits` and
    `out[0]` failed on the placed model's output (found by fuzzing)."""
    torch.manual_seed(0)
    x = torch.randn(6, 8)
    model = ReturnsOrderedDict().eval()
    placed = _place(model, (x,), microbatches=2, trace_method="fx", allow_single_device=False)
    with torch.no_grad():
        out, expected = placed(x), model(x)
    assert type(out) is collections.OrderedDict and list(out) == ["logits", "hidden"]
    assert torch.allclose(out["logits"], expected["logits"], atol=1e-6)
    pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class ReturnsModelOutput(ReturnsOrderedDict):
        def forward(self, x):
            out = super().forward(x)
            return BaseModelOutput(last_hidden_state=out["logits"], hidden_states=(out["hidden"],))

    model = ReturnsModelOutput().eval()
    placed = _place(model, (x,), microbatches=1, trace_method="fx", allow_single_device=False)
    with torch.no_grad():
        out = placed(x)
        assert isinstance(out, BaseModelOutput) and torch.equal(out.last_hidden_state, model(x).last_hidden_state)
        assert torch.equal(out[0], model(x)[0])


def test_forward_hooks_that_ran_only_while_tracing_are_named():
    """A hook that stores a feature (for a perceptual loss, say) ran only at place() time: the
    placed model's calls never refreshed it, silently (found by fuzzing)."""
    model = MLP().eval()
    features = {}
    model.net[0].register_forward_hook(lambda module, args, out: features.update(first=out))
    with pytest.warns(PlacementWarning, match=r"forward hooks of 1 module\(s\) \(net\.0\) ran while tracing") as seen:
        _place(model, (torch.randn(4, 32),), microbatches=1)
    assert {w.filename for w in seen if "forward hooks" in str(w.message)} == {__file__}  # place()'s caller
    model = MLP().eval()
    model.net[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.warns(PlacementWarning, match=r"backward hooks of 1 module\(s\) \(net\.2\) will not run"):
        _place(model, (torch.randn(4, 32),), microbatches=1)


def test_place_warnings_name_the_callers_line():
    """Every warning points at the line that called place() (or the placed model), however deep in
    torchplace it was raised (the one-device choice named a line of torchplace/api.py; a warning of
    a call, a line of torch's nn.Module)."""
    import inspect

    model = MLP().eval()
    model.net[0].register_forward_hook(lambda module, args, out: None)
    with pytest.warns(PlacementWarning, match="forward hooks") as seen:
        line = inspect.currentframe().f_lineno + 1
        torchplace.place(model, DEVICES, (torch.randn(4, 32),), **QUICK)
    assert [(w.filename, w.lineno) for w in seen if "hooks" in str(w.message)] == [(__file__, line)]
    placed = _place(MLP().eval(), (torch.randn(8, 32),), microbatches=4)
    with pytest.warns(RuntimeWarning, match="micro-batches requested for a batch of 2") as seen:
        line = inspect.currentframe().f_lineno + 1
        placed(torch.randn(2, 32))  # through nn.Module.__call__
    assert [(w.filename, w.lineno) for w in seen if "requested" in str(w.message)] == [(__file__, line)]


def test_a_keyword_the_export_did_not_see_is_refused_with_the_reason():
    """An exported placed model takes the example's arguments only; the refusal said
    'unexpected keyword argument' without why (found by fuzzing)."""
    model = Scaled().eval()
    x = torch.randn(4, 8)
    placed = _place(model, (x,), trace_method="export", microbatches=1)
    with torch.no_grad(), pytest.raises(UsageError, match="traced with the others at their defaults"):
        placed(x, scale=1.0)


@pytest.mark.parametrize("trace_method", ["fx", "export"])
def test_an_argument_the_example_gave_may_be_left_out_at_its_default(trace_method):
    """A model placed with an example that spelled out a default (scale=1.0) refused a later call
    without it ('the placed model is called as GraphModule(...): missing a required argument'),
    which the model takes; the default now fills it, and a constant the export kept is still checked."""
    model, x = Scaled().eval(), torch.randn(4, 8)
    placed = _place(model, (x,), example_kwargs={"scale": 1.0}, trace_method=trace_method, microbatches=1)
    with torch.no_grad():
        assert torch.equal(placed(x), model(x))
        if trace_method == "export":
            with pytest.raises(UsageError, match="traced for inputs with scale == 1.0"):
                placed(x, scale=2.0)
        else:
            assert torch.equal(placed(x, scale=2.0), model(x, scale=2.0))
        with pytest.raises(UsageError, match=r"the placed model is called as Scaled\(x, .*unexpected keyword argument 'bias'"):
            placed(x, bias=1.0)
    if trace_method == "export":  # the refusal of a left-out number says the call left it out, at what default
        placed = _place(model, (x,), example_kwargs={"scale": 2.0}, trace_method=trace_method, microbatches=1)
        with torch.no_grad(), pytest.raises(UsageError, match=r"traced for inputs with scale == 2.0, which this "
                                                              r"call, leaving scale out \(the model's default, 1.0\), breaks"):
            placed(x)


class _SumsItsInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, *xs):
        return self.b(torch.relu(self.a(sum(xs))))


@pytest.mark.parametrize("count", [1, 2])
def test_a_model_whose_forward_takes_star_args_is_placed(count):
    """(found by fuzzing) forward(self, *xs) was never placed: the export's dynamic shapes gave one
    spec per positional input, where torch.export wants those of *xs nested under its name, and the
    TraceError's hint spoke of other things."""
    torch.manual_seed(0)
    model, inputs = _SumsItsInputs().eval(), tuple(torch.randn(4, 8) for _ in range(count))
    placed = _place(model, inputs, microbatches=2)
    with torch.no_grad():
        assert torch.equal(placed(*inputs), model(*inputs))
        with pytest.raises(UsageError, match="too many positional arguments"):  # the example's count is traced
            placed(*inputs, inputs[0])


@pytest.mark.parametrize("transform", ["vmap", "grad", "jit.trace", "jit.script"])
def test_a_function_transform_or_tracer_of_a_placed_model_is_refused_naming_it(transform):
    """vmap failed deep in a stage ('Cannot access storage of BatchedTensorImpl'), jit.trace with
    'Cannot insert a Tensor that requires grad as a constant', jit.script with a parse error of
    forward's signature: the stages run on worker threads none of them follows."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    placed = torchplace.place(model, DEVICES, (x,), microbatches=2, allow_single_device=False, progress=False)
    run = {
        "vmap": lambda: torch.func.vmap(placed)(x),
        "grad": lambda: torch.func.grad(lambda t: placed(t).sum())(x),
        "jit.trace": lambda: torch.jit.trace(placed, (x,)),
        "jit.script": lambda: torch.jit.script(placed),
    }[transform]
    with pytest.raises(UnsupportedError, match="original model"):
        run()
    assert torch.allclose(placed(x), model(x), atol=1e-6)  # nothing left behind
