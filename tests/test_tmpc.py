"""Piper on real models: layers, Megatron pairs and TMPCs of a profiled training graph
(torchplace.profiling.tmpc, .megatron) and parallelism='piper' in plan_model / place."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchplace
from tests.test_piper import brute_force
from torchplace import costmodel
from torchplace.api import prepare
from torchplace.errors import UnsupportedError, UsageError
from torchplace.profiling.tmpc import heads_by_module, parameter_shapes, piper_problem
from torchplace.solvers import piper

transformers = pytest.importorskip("transformers")

FAST = {"progress": False, "warmup": 0, "repeats": 1}
B = 1e9  # bytes/s


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def gpt2_graph():
    """A 2-layer GPT-2's profiled training graph (op level), and the model."""
    model, kwargs = _gpt2()
    placement = prepare(model, ["cpu:0", "cpu:1"], example_kwargs=kwargs, mode="training",
                        allow_single_device=False, **FAST)
    return placement.problem.graph, model


def _problem(graph, model, **kw):
    opts = {"kind": "cpu", "devices": 8, "memory_bytes": 1e12, "bandwidth": B, "microbatches": 8,
            "shapes": parameter_shapes(model), "heads": heads_by_module(model)}
    return piper_problem(graph, **{**opts, **kw})


def test_layers_and_megatron_pairs_of_gpt2(gpt2_graph):
    graph, model = gpt2_graph
    p = _problem(graph, model)
    meta = p.graph.meta["piper"]
    assert list(meta["layers"]) == ["input", "transformer.h.0", "transformer.h.1", "output"]
    assert meta["degrees"] == [1, 2, 4]  # 4 heads: no t = 8
    for block in ("transformer.h.0", "transformer.h.1"):
        attn, mlp = meta["pairs"][block]
        modules = lambda nodes: [graph.record(v).module for v in nodes]  # noqa: E731
        assert modules(attn)[0].endswith("attn.c_attn") and modules(attn)[-1].endswith("attn.c_proj")
        assert modules(mlp)[0].endswith("mlp.c_fc") and modules(mlp)[-1].endswith("mlp.c_proj")
        assert not any("ln_" in m for m in modules(attn) + modules(mlp))  # norms are replicated
    assert meta["pairs"]["input"] == [] and meta["pairs"]["output"] == []
    assert sorted(p.graph.record("transformer.h.0").tmpcs) == [1, 2, 4]


def test_tensor_parallel_tmpcs_follow_megatron(gpt2_graph):
    graph, model = gpt2_graph
    p = _problem(graph, model, tensor_bandwidth=B)
    block = "transformer.h.0"
    nodes = p.graph.meta["piper"]["layers"][block]
    pairs = p.graph.meta["piper"]["pairs"][block]
    split = {v for pair in pairs for v in pair}
    fb = {v: graph.record(v).times["cpu"] + graph.record(f"{v}:backward").times["cpu"] for v in nodes}
    x1, x2 = (p.graph.record(block).tmpcs[t][0] for t in (1, 2))
    # t = 1: the measured forward + backward; t = 2: the split operators (the matmuls among them) at
    # half, the rest replicated, plus an all-reduce of each row linear's output forward and backward
    assert x1.time == pytest.approx(math.fsum(fb.values()))
    allreduce = sum(2 * 2 * (2 - 1) / 2 * graph.record(pair[-1]).output_bytes / B for pair in pairs)
    assert x2.time == pytest.approx(sum(fb[v] / (2 if v in split else 1) for v in nodes) + allreduce)
    assert allreduce > 0 and x2.time < x1.time + allreduce
    state = graph.meta["state"]
    split_weights = sum(e["bytes"] for e in state.values() if e["trainable"] and e["owner"] in split)
    assert x2.param_bytes == pytest.approx(x1.param_bytes - split_weights / 2)
    assert x2.mem_b < x1.mem_b and x2.mem_a < x1.mem_a
    assert x1.sync_in == {"input": 0.0} and x2.sync_in == {"input": p.graph.edge_bytes("input", block)}
    # layers without a Megatron pair are replicated: same cost at every t
    out = p.graph.record("output").tmpcs
    assert out[2][0].time == out[1][0].time and out[4][0].param_bytes == out[1][0].param_bytes


def test_recomputation_costs_time_and_saves_memory(gpt2_graph):
    graph, model = gpt2_graph
    p = _problem(graph, model)
    block = "transformer.h.1"
    nodes = p.graph.meta["piper"]["layers"][block]
    for t, (vanilla, recomp) in p.graph.record(block).tmpcs.items():
        assert recomp.recompute and not vanilla.recompute and recomp.id == "activation recomp"
        assert recomp.time > vanilla.time and recomp.mem_a < vanilla.mem_a
        assert recomp.param_bytes == vanilla.param_bytes
    vanilla, recomp = p.graph.record(block).tmpcs[1]
    assert recomp.time - vanilla.time == pytest.approx(math.fsum(graph.record(v).times["cpu"] for v in nodes))
    assert recomp.mem_a == p.graph.edge_bytes("transformer.h.0", block)  # the stash: its input


def test_piper_plan_of_gpt2_is_valid_and_evaluates_to_its_objective(gpt2_graph):
    graph, model = gpt2_graph
    for memory in (1e12, 2e6):
        p = _problem(graph, model, memory_bytes=memory)
        plan = piper.solve(p)
        plan.validate(p)
        assert plan.objective == costmodel.evaluate(p, plan)
        assert sum(s.data_parallel * s.tensor_parallel for s in plan.stages) <= 8
        assert sorted(v for s in plan.stages for v in s.nodes) == sorted(p.graph)
    # memory below what a block needs on one device (in any TMPC), above what it needs on two
    tmpcs = _problem(graph, model).graph.record("transformer.h.0").tmpcs
    need = {t: min(x.mem_a + x.mem_b for x in tmpcs[t]) for t in (1, 2)}
    assert need[2] < need[1]
    p = _problem(graph, model, memory_bytes=need[1] - 1, devices=4, microbatches=4)
    tight = piper.solve(p)
    assert all(s.tensor_parallel > 1 for s in tight.stages if "transformer.h.0" in s.nodes)
    assert tight.objective == costmodel.evaluate(p, tight)


def test_piper_dp_equals_brute_force_on_a_tiny_traced_model():
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))  # noqa: E731
    model = nn.Sequential(block(), nn.LayerNorm(8), block())
    for devices, n, memory in ((2, 2, None), (4, 4, None), (4, 2, "9KiB")):
        names = [f"cpu:{i}" for i in range(devices)]
        caps = None if memory is None else dict.fromkeys(names, memory)
        plan, p = torchplace.plan_model(model, names, (torch.randn(4, 8),), mode="training", parallelism="piper",
                                        microbatches=n, max_memory=caps, **FAST)
        assert list(p.graph.meta["piper"]["layers"]) == ["0", "1", "2"]
        assert [len(x) for x in p.graph.meta["piper"]["pairs"].values()] == [1, 0, 1]
        exact = piper.solve(p, knapsack="brute-force")
        assert exact.objective == pytest.approx(brute_force(p), rel=1e-9)
        assert plan.objective >= exact.objective * (1 - 1e-9)


def test_plan_model_plans_gpt2_and_place_refuses_to_run_it():
    model, kwargs = _gpt2()
    devices = [f"cpu:{i}" for i in range(4)]
    plan, problem = torchplace.plan_model(model, devices, example_kwargs=kwargs, mode="training",
                                          parallelism="piper", microbatches=4, allreduce_bandwidth="10GB/s", **FAST)
    assert plan.solver == "piper" and problem.parallel.devices == 4 and problem.parallel.bandwidth == 10e9
    assert plan.objective == costmodel.evaluate(problem, plan) and plan.meta["piper_devices"] == devices
    assert "dev[0:" in str(plan)
    with pytest.raises(UnsupportedError, match="torchplace.distributed.place") as e:
        torchplace.place(model, devices, example_kwargs=kwargs, mode="training", parallelism="piper",
                         microbatches=4, **FAST)
    assert e.value.plan.stages and e.value.problem.parallel is not None


def test_a_piper_plan_given_to_run_is_refused_as_what_it_is(tmp_path, monkeypatch):
    import torchplace.distributed as tpd

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x, devices = torch.randn(4, 8), ["cpu:0", "cpu:1"]
    plan, _ = torchplace.plan_model(model, devices, (x,), mode="training", parallelism="piper", microbatches=2, **FAST)
    assert plan.meta["mode"] == "training"  # Piper plans training, whatever the layer graph's problem says
    plan.save(tmp_path / "piper.json")
    for mode in ("training", "inference"):  # not "solved for mode='inference'", nor "does not fit this graph"
        with pytest.raises(UnsupportedError, match=r"piper.json' is a Piper plan .*no runtime here runs Piper plans"):
            torchplace.place(model, devices, (x,), mode=mode, plan=tmp_path / "piper.json", **FAST)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(UnsupportedError, match="is a Piper plan"):  # before any process group
        tpd.place(model, (x,), plan=tmp_path / "piper.json", mode="training")
    with pytest.raises(UsageError, match="leave out plan="):
        torchplace.place(model, devices, (x,), mode="training", parallelism="piper", plan=plan, **FAST)


def test_a_piper_plans_device_map_is_refused_not_empty():
    """A Piper stage runs on d x t devices, which accelerate's form cannot say: the map was {}."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    plan, problem = torchplace.plan_model(model, ["cpu:0", "cpu:1"], (torch.randn(4, 8),), mode="training",
                                          parallelism="piper", microbatches=2, **FAST)
    with pytest.raises(UsageError, match="d x t devices"):
        plan.device_map(problem)


def test_bert_plans_with_piper():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                  vocab_size=128, max_position_embeddings=32)
    model = transformers.BertForSequenceClassification(cfg)
    ids = torch.randint(0, 128, (2, 16))
    plan, problem = torchplace.plan_model(model, [f"cpu:{i}" for i in range(8)],
                                          example_kwargs={"input_ids": ids, "labels": torch.tensor([0, 1])},
                                          mode="training", parallelism="piper", microbatches=8, **FAST)
    meta = problem.graph.meta["piper"]
    blocks = [k for k in meta["layers"] if k.startswith("bert.encoder.layer.")]
    assert blocks == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert all(len(meta["pairs"][b]) == 2 for b in blocks) and meta["degrees"] == [1, 2, 4]
    plan.validate(problem)
    assert plan.objective == costmodel.evaluate(problem, plan)


@pytest.mark.parametrize("options, words", [
    ({"parallelism": "megatron"}, "parallelism must be one of ['pipeline', 'piper']"),
    ({"parallelism": "piper"}, "mode='training'"),
    ({"parallelism": "piper", "mode": "training", "solver": "dp"}, "solved by"),
    ({"parallelism": "piper", "mode": "training", "contiguous": False}, "contiguous"),
    ({"mode": "training", "solver": "piper"}, "parallelism='piper'"),
    ({"allreduce_bandwidth": "1GB/s"}, "goes with parallelism='piper'"),
    ({"parallelism": "piper", "mode": "training", "tensor_bandwidth": "fast"}, "bandwidth"),
    ({"parallelism": "piper", "mode": "training", "allreduce_bandwidth": math.inf}, "finite bandwidth"),
    ({"parallelism": "piper", "mode": "training", "schedule": "gpipe"}, "does not flush"),
    ({"parallelism": "piper", "mode": "training", "fuse": True}, "leave fuse out"),  # was ignored
    ({"parallelism": "piper", "mode": "training", "allow_single_device": True}, "leave allow_single_device out"),
])
def test_bad_parallelism_options_are_usage_errors(options, words):
    with pytest.raises(UsageError) as e:
        torchplace.plan_model(nn.Linear(2, 2), ["cpu:0"], (torch.randn(2, 2),), **options)
    assert words in str(e.value)


def test_piper_needs_devices_of_one_kind(gpt2_graph):
    from torchplace.devices import Cluster, Device
    from torchplace.parallelism import piper_plan

    graph, model = gpt2_graph
    mixed = Cluster((Device("a", "cpu", "cpu", 2**30), Device("b", "cpu", "accel", 2**30)))
    with pytest.raises(UsageError, match="one kind"):
        piper_plan(graph, mixed, model, microbatches=2, solver="auto", recompute=True, time_limit=None)


def test_piper_needs_a_finite_bandwidth_from_the_links_or_the_caller(gpt2_graph):
    """A link of infinite bandwidth (a fitted link with no slope) became Piper's B, and Parallel
    refused it with a ValueError from deep inside (found by fuzzing)."""
    from torchplace.devices import Cluster, Device
    from torchplace.parallelism import piper_plan

    graph, model = gpt2_graph
    free = Cluster((Device("a", "cpu", "cpu", 2**30), Device("b", "cpu", "cpu", 2**30)), bandwidth=math.inf)
    with pytest.raises(UsageError, match="allreduce_bandwidth="):
        piper_plan(graph, free, model, microbatches=2, solver="auto", recompute=True, time_limit=None)
    _, plan = piper_plan(graph, free, model, microbatches=2, solver="auto", recompute=True, time_limit=None,
                         allreduce_bandwidth="10GB/s")
    assert math.isfinite(plan.objective)


def test_cli_plans_an_example_model_with_piper(capsys):
    from torchplace.cli import main

    assert main(["plan", "mlp", "--mode", "training", "--parallelism", "piper", "--devices", "cpu:0", "cpu:1",
                 "--microbatches", "2", "--batch", "4"]) == 0
    assert "Plan by piper" in capsys.readouterr().out
    assert main(["plan", "mlp", "--parallelism", "piper"]) == 2  # inference: a one-line usage error
    assert "mode='training'" in capsys.readouterr().err


def test_a_model_on_the_meta_device_is_planned_from_estimates():
    from torchplace.devices import Device

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (2, 16))
    devices = [Device(f"gpu{i}", "cuda", "cuda", 2**34) for i in range(8)]
    plan, problem = torchplace.plan_model(model, devices, example_kwargs={"input_ids": ids, "labels": ids},
                                          mode="training", parallelism="piper", microbatches=8, progress=False)
    assert problem.cluster.devices[0].kind == "cuda" and problem.graph.meta["piper"]["degrees"] == [1, 2, 4]
    assert plan.objective == costmodel.evaluate(problem, plan) > 0


def test_edges_between_layers_count_the_tensors_read(gpt2_graph):
    from torchplace.profiling import trace

    graph, model = gpt2_graph
    _, kwargs = _gpt2()
    model.train()
    with torch.no_grad():
        traced = trace(model, (), kwargs, training=True)
    from torchplace.profiling.tmpc import fx_outputs

    coarse = _problem(graph, model).graph
    fine = _problem(graph, model, fx=fx_outputs(traced.gm)).graph
    hidden = 2 * 16 * 64 * 4  # the residual stream: batch x tokens x width, float32
    edge = ("transformer.h.0", "transformer.h.1")
    # per graph node, layer 0's mask node also counts the attention output it computes; per fx node
    # only the hidden state and the mask cross
    assert hidden <= fine.edge_bytes(*edge) < coarse.edge_bytes(*edge)
    assert fine.edge_bytes(*edge) <= hidden + 2 * 16 * 16 * 4


# -- synthetic graphs: the rules on their own ----------------------------------------------------
def _synthetic(nodes, edges, weights):
    """An OpGraph of ``(id, op, module)`` nodes; ``weights``: node -> 2-D weight shape it owns."""
    from torchplace.graph import NodeRecord, OpGraph

    g = OpGraph(meta={"state": {f"{v}.weight": {"bytes": 4 * a * b, "trainable": True, "owner": v, "readers": [v]}
                                for v, (a, b) in weights.items()}})
    for v, op, module in nodes:
        g.add_node(v, NodeRecord(v, op=f"call_function:aten.{op}", module=module))
    for u, v in edges:
        g.add_edge(u, v)
    return g, {f"{v}.weight": shape for v, shape in weights.items()}


def test_megatron_pairs_of_a_llama_block():
    from torchplace.profiling.megatron import linear_weights, megatron_pairs

    L = "model.layers.0"
    nodes = [("pow", "pow.Tensor_Scalar", f"{L}.input_layernorm"), ("mean", "mean.dim", f"{L}.input_layernorm"),
             ("norm", "mul.Tensor", f"{L}.input_layernorm"),
             ("q", "linear.default", f"{L}.self_attn.q_proj"), ("k", "linear.default", f"{L}.self_attn.k_proj"),
             ("v", "linear.default", f"{L}.self_attn.v_proj"),
             ("sdpa", "scaled_dot_product_attention.default", f"{L}.self_attn"),
             ("o", "linear.default", f"{L}.self_attn.o_proj"), ("add", "add.Tensor", L),
             ("pow2", "pow.Tensor_Scalar", f"{L}.post_attention_layernorm"),
             ("mean2", "mean.dim", f"{L}.post_attention_layernorm"),
             ("norm2", "mul.Tensor", f"{L}.post_attention_layernorm"),
             ("gate", "linear.default", f"{L}.mlp.gate_proj"), ("up", "linear.default", f"{L}.mlp.up_proj"),
             ("silu", "silu.default", f"{L}.mlp.act_fn"), ("mul", "mul.Tensor", f"{L}.mlp"),
             ("down", "linear.default", f"{L}.mlp.down_proj"), ("add2", "add.Tensor", L)]
    edges = [("pow", "mean"), ("mean", "norm"), ("norm", "q"), ("norm", "k"), ("norm", "v"), ("q", "sdpa"),
             ("k", "sdpa"), ("v", "sdpa"), ("sdpa", "o"), ("o", "add"), ("add", "pow2"), ("pow2", "mean2"),
             ("mean2", "norm2"), ("add", "norm2"), ("norm2", "gate"), ("norm2", "up"), ("gate", "silu"),
             ("silu", "mul"), ("up", "mul"), ("mul", "down"), ("down", "add2"), ("add", "add2")]
    weights = {"q": (64, 64), "k": (64, 64), "v": (64, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64),
               "down": (64, 128)}
    g, shapes = _synthetic(nodes, edges, weights)
    pairs = megatron_pairs(g, g.topological_order(), linear_weights(g, shapes), {f"{L}.self_attn": 2}, (2, 4, 8))
    assert [(p.columns, p.region, p.row) for p in pairs] == [(("q", "k", "v"), ("sdpa",), "o"),
                                                            (("gate", "up"), ("silu", "mul"), "down")]
    assert pairs[0].degrees == (2,) and pairs[1].degrees == (2, 4, 8)  # 2 heads; the MLP by its widths


def test_layers_that_would_form_a_cycle_are_merged():
    from torchplace.profiling.tmpc import layers

    # an op outside every block between two blocks goes with its latest predecessor's block; a
    # block read by an op of an earlier block would make a cycle: the two merge
    nodes = [("a", "relu.default", "blocks.0"), ("x", "relu.default", "mid"), ("b", "relu.default", "blocks.1"),
             ("c", "relu.default", "blocks.0.late"), ("out", "relu.default", "head")]
    g, _ = _synthetic(nodes, [("a", "x"), ("x", "b"), ("b", "c"), ("c", "out")], {})
    assert layers(g) == {"blocks.0+blocks.1": ["a", "x", "b", "c"], "output": ["out"]}
