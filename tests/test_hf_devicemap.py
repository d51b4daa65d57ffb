"""torchplace.infer_device_map: accelerate-form maps that accelerate accepts, that fit the batch's
KV cache, keep tied weights together, and dispatch to a model that generates the same tokens.

This machine has no GPU, so the dispatch tests split a model over the two places accelerate can
use without one: ``"cpu"`` (the main device) and ``"disk"`` (an offload folder). A small ``"cpu"``
budget forces blocks onto ``"disk"``; ``dispatch_model`` then attaches its ``AlignDevicesHook`` s,
which load those blocks' weights from the folder for every call, so the test runs accelerate's
real offload path, including tied weights split from their module's device. Placement on several
GPUs is covered by the planning tests (maps over ``{0: ..., 1: ..., "cpu": ...}``), which need no
device.
"""
from __future__ import annotations

import math

import pytest
import torch

import torchplace
from torchplace.errors import InfeasibleError, PlacementWarning, UsageError

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from accelerate import dispatch_model  # noqa: E402
from accelerate.utils import check_device_map, find_tied_parameters  # noqa: E402

from torchplace.hf import build_problem, evaluate_device_map, plan_device_map  # noqa: E402

VOCAB = 512


def gpt2_config(layers: int = 4):
    return transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=1)


def llama_config(layers: int = 4):
    return transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                    max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def build(config, device: str = "cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def owner(device_map, name: str):
    keys = [k for k in device_map if k == "" or name == k or name.startswith(f"{k}.")]
    return device_map[max(keys, key=len)]


@pytest.mark.parametrize("config", [gpt2_config, llama_config], ids=["gpt2", "llama"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_dispatched_model_generates_the_same_tokens(config, use_cache, tmp_path):
    model = build(config())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = plan_device_map(model, {"cpu": params // 2, "disk": "1GiB"}, batch_size=2, sequence_length=16)
    device_map = plan.device_map
    assert {"cpu", "disk"} <= set(device_map.values()), device_map  # a real split: hooks run
    saved = {n.rpartition(".")[0] for n in model.state_dict()}
    on_disk = [k for k, d in device_map.items() if d == "disk"]
    assert all(any(w == k or w.startswith(f"{k}.") for w in saved) for k in on_disk), \
        "a module with nothing in the state dict is sent to disk (accelerate cannot offload it)"
    check_device_map(model, device_map)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache)

    other = build(config())
    other.load_state_dict(model.state_dict())
    other = dispatch_model(other, device_map, offload_dir=str(tmp_path))
    offloaded = [n for n, m in other.named_modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    assert offloaded, "no module runs through accelerate's offload hooks"
    got = other.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=use_cache)
    assert torch.equal(got, expected)


def test_from_pretrained_accepts_the_map(tmp_path):
    model = build(gpt2_config())
    model.save_pretrained(tmp_path / "model")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    device_map = torchplace.infer_device_map(model, {"cpu": params // 2, "disk": "1GiB"}, batch_size=1,
                                             sequence_length=16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                               offload_folder=str(tmp_path / "offload"))
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(loaded.generate(ids, max_new_tokens=4, do_sample=False), expected)


def test_gpu_map_keeps_tied_weights_together_and_prefers_the_fast_gpu(tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"format": "torchplace.cluster/1", "devices": ['
                       '{"name": "cuda:0", "kind": "cuda-t4", "torch_device": "cuda:0"},'
                       '{"name": "cuda:1", "kind": "cuda", "torch_device": "cuda:1"},'
                       '{"name": "cpu", "kind": "cpu", "torch_device": "cpu"}]}')
    config = transformers.GPT2Config(n_layer=6, n_embd=512, n_head=8, vocab_size=VOCAB, n_positions=256)
    model = build(config, "meta")
    plan = plan_device_map(model, {0: "100MiB", 1: "100MiB", "cpu": "1GiB"}, cluster=cluster, batch_size=8,
                           sequence_length=128)
    check_device_map(model, plan.device_map)
    assert "disk" not in plan.device_map.values()  # disk only when max_memory names it
    for group in find_tied_parameters(model):
        assert len({owner(plan.device_map, n) for n in group}) == 1, group
    fast = [k for k, v in plan.device_map.items() if v == 1]
    assert fast, "nothing on the fast GPU"
    caps = {0: 100 * 2**20, 1: 100 * 2**20, "cpu": 2**30}
    assert all(plan.memory[d] <= caps[d] for d in plan.memory)
    cost = evaluate_device_map(plan.problem, plan.device_map)
    assert cost.fits and cost.seconds == pytest.approx(plan.plan.objective)


def test_kv_cache_is_counted_where_its_layer_is():
    model = build(llama_config(2), "meta")
    cfg = model.config
    small = plan_device_map(model, {"cpu": "1GiB"}, batch_size=1, sequence_length=8)
    big = plan_device_map(model, {"cpu": "1GiB"}, batch_size=4, sequence_length=64)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 2 * 4 * 64 * cfg.num_key_value_heads * head_dim * 4
    assert big.kv_cache["cpu"] == cfg.num_hidden_layers * per_layer
    assert big.memory["cpu"] - small.memory["cpu"] >= big.kv_cache["cpu"] - small.kv_cache["cpu"]


def test_a_budget_without_room_for_the_kv_cache_says_how_much_is_needed():
    model = build(gpt2_config(2), "meta")
    with pytest.raises(InfeasibleError, match="KV cache") as err:
        plan_device_map(model, {"cpu": "600KiB"}, batch_size=64, sequence_length=128)
    assert err.value.min_memory_bytes > 600 * 2**10


def test_a_main_device_without_room_for_what_it_computes_of_the_offloaded_blocks_is_named_with_its_room():
    """The weights fit GPU 0, the CPU and disk together, but GPU 0 computes the offloaded blocks: their
    KV cache and the largest one's weights do not fit beside the activations (nor on the CPU alone)."""
    model = build(gpt2_config(3), "meta")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(InfeasibleError, match=r"overfills cuda:0, which computes the offloaded blocks \(.* KiB of its "
                                              r"max_memory left beside the activations' .* KiB\) with their KV cache"):
        plan_device_map(model, {0: int(params * 0.4), "cpu": int(params * 0.5), "disk": "1GiB"}, batch_size=2,
                        sequence_length=16, repeats=0)



def test_a_meta_model_is_planned_for_a_batch_no_ram_could_hold_without_allocating_its_inputs():
    """The example input_ids were drawn on the CPU, then moved to the meta device: a batch of 1e11
    failed with the allocator's RuntimeError (a traceback from `torchplace plan --hf`; found by fuzzing)."""
    model = build(llama_config(1), "meta")
    with pytest.raises(InfeasibleError, match="lower batch_size") as err:
        plan_device_map(model, {"cpu": "1GiB"}, batch_size=10**11, sequence_length=16, repeats=0)
    assert err.value.min_memory_bytes > 2**40
    with pytest.raises(UsageError, match=r"lower batch_size or sequence_length"):  # was a TypeError: int64 overflow
        plan_device_map(model, {"cpu": "1GiB"}, batch_size=10**30, sequence_length=16, repeats=0)

def test_meta_model_is_planned_without_weights():
    model = build(llama_config(4), "meta")
    device_map = torchplace.infer_device_map(model, {0: "1MiB", "cpu": "1GiB"}, batch_size=1, sequence_length=16)
    check_device_map(model, device_map)
    assert all(p.is_meta for p in model.parameters())
    problem = build_problem(model, {0: "1MiB", "cpu": "1GiB"}, sequence_length=16)
    assert problem.graph.meta["hf"]["costs"] == "estimated"



@pytest.mark.parametrize("gpu", [0, "1KiB"])
def test_a_gpu_too_small_for_anything_gives_the_map_that_computes_on_the_cpu(gpu):
    """With a GPU named, "cpu" only stored offloaded weights, so a GPU without room for their KV cache
    was InfeasibleError, though {"": "cpu"} (accelerate's own answer) fits and dispatch_model runs it
    on the CPU (found by fuzzing)."""
    model = build(gpt2_config(2), "meta")
    with pytest.warns(PlacementWarning, match="no device map fits GPU"):
        plan = plan_device_map(model, {0: gpu, "cpu": "1GiB"}, sequence_length=16, repeats=0)
    assert plan.device_map == {"": "cpu"} and set(plan.memory) == {"cpu"}
    assert "no map fits GPU(s) 0: the CPU computes every block" in str(plan)
    check_device_map(model, plan.device_map)
    with pytest.raises(InfeasibleError):  # a CPU too small as well is still refused
        plan_device_map(model, {0: gpu, "cpu": "10KiB"}, sequence_length=16, repeats=0)

@pytest.mark.filterwarnings("ignore:no device map fits GPU")
def test_other_maps_are_priced_on_the_budgets_given_when_the_cpu_computes_every_block():
    """When no map fitted the GPUs the plan's problem was the CPU-only one, and pricing accelerate's
    map on it said "sends to '0', which is not in max_memory ['cpu']" though max_memory named 0; and
    on the problem of max_memory a map naming no GPU was priced as streamed to GPU 0, not as the CPU
    computing every block, as dispatch_model runs it."""
    from accelerate import infer_auto_device_map

    model = build(gpt2_config(2), "meta")
    budget = {0: "1KiB", "cpu": "1GiB"}
    plan = plan_device_map(model, budget, batch_size=2, sequence_length=16, repeats=0)
    assert plan.device_map == {"": "cpu"} and plan.requested is not plan.problem
    assert [d.name for d in plan.requested.cluster.devices] == ["cuda:0", "cpu"]
    own = evaluate_device_map(plan.requested, plan.device_map)
    assert own == evaluate_device_map(plan.problem, plan.device_map)
    assert own.fits and own.memory == plan.memory and own.seconds == pytest.approx(plan.plan.objective)
    on_gpu = evaluate_device_map(plan.requested, {"": 0})
    assert not on_gpu.fits and on_gpu.memory[0] > 1024 and on_gpu.seconds > 0
    theirs = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)
    evaluate_device_map(plan.requested, theirs)  # priced, whatever it names
    with pytest.raises(UsageError, match=r"not in max_memory \['cpu'\].*DeviceMapPlan.requested"):
        evaluate_device_map(plan.problem, {"": 0})
    fitting = plan_device_map(model, {0: "1GiB", "cpu": "1GiB"}, batch_size=2, sequence_length=16, repeats=0)
    assert fitting.requested is fitting.problem


def test_no_split_classes_are_kept_whole():
    model = build(gpt2_config(2), "meta")
    device_map = torchplace.infer_device_map(model, {0: "10MiB", "cpu": "1GiB"}, sequence_length=8,
                                             no_split_module_classes=["GPT2LMHeadModel"])
    assert device_map == {"": 0}


def test_accelerate_map_is_evaluated_on_the_same_problem():
    from accelerate import infer_auto_device_map

    model = build(gpt2_config(4), "meta")
    budget = {0: "800KiB", 1: "800KiB", "cpu": "1GiB"}
    problem = build_problem(model, budget, batch_size=2, sequence_length=32)
    theirs = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=model._no_split_modules)
    ours = plan_device_map(model, budget, batch_size=2, sequence_length=32)
    a, b = evaluate_device_map(problem, theirs), evaluate_device_map(ours.problem, ours.device_map)
    assert b.fits and not a.fits  # accelerate budgets weights only: no room left for the KV cache


@pytest.mark.parametrize("bad, match", [({"gpu": "1GiB"}, "GPU ids"), ({0: "lots"}, r"max_memory\[0\]"),
                                        ({}, "non-empty")])
def test_bad_max_memory_is_named(bad, match):
    with pytest.raises(UsageError, match=match):
        torchplace.infer_device_map(build(gpt2_config(2), "meta"), bad)


def test_cli_plans_a_config_on_the_meta_device(tmp_path, capsys):
    import json

    from torchplace.cli import main

    config = tmp_path / "config.json"
    gpt2_config(3).to_json_file(config)
    assert main(["plan", "--hf", str(config), "--max-memory", "0=1MiB", "cpu=1GiB", "--sequence-length", "16",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    check_device_map(build(gpt2_config(3), "meta"), out["device_map"])
    assert set(out["memory"]) <= {"0", "cpu"} and out["seconds"] >= out["lower_bound"] > 0
    assert main(["plan", "--hf", str(config), "--max-memory", "0=10KiB"]) == 2
    assert "needs" in capsys.readouterr().err


# -- time per generated token ------------------------------------------------------------------------
def test_decode_phase_times_one_token_reading_the_kv_cache():
    """phase="decode": a block's time is one token's step plus reading its KV cache once, so the
    step grows with the cached length while the prefill pass is far longer than one token's."""
    from torchplace.hf.blocks import HF_DEVICE_SPECS

    model = build(llama_config(2), "meta")
    budget = {0: "64MiB", "cpu": "1GiB"}
    short = build_problem(model, budget, batch_size=4, sequence_length=16, phase="decode")
    long = build_problem(model, budget, batch_size=4, sequence_length=128, phase="decode")
    prefill = build_problem(model, budget, batch_size=4, sequence_length=128)
    kv = long.graph.meta["hf"]["kv_cache"]
    assert kv and long.graph.meta["hf"]["phase"] == "decode"
    for v, nbytes in kv.items():
        grown = long.graph.record(v).time_on("cuda") - short.graph.record(v).time_on("cuda")
        assert grown == pytest.approx((nbytes - short.graph.meta["hf"]["kv_cache"][v]) / HF_DEVICE_SPECS["cuda"].mem_bandwidth)
    def total(problem):
        return sum(r.time_on("cuda") for _, r in problem.graph.records())

    assert total(short) < total(long) < total(prefill)
    # room for the prompt's activations is kept as in a prefill map
    assert long.graph.meta["hf"]["activations"] >= prefill.graph.meta["hf"]["activations"]


def test_decode_map_is_a_valid_map_timed_per_generated_token():
    model = build(gpt2_config(2), "meta")
    plan = plan_device_map(model, {0: "2MiB", "cpu": "1GiB"}, batch_size=2, sequence_length=64, phase="decode")
    check_device_map(model, plan.device_map)
    assert "per generated token" in str(plan)
    with pytest.raises(UsageError, match="phase must be one of"):
        plan_device_map(model, {"cpu": "1GiB"}, phase="generate")
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16, vocab_size=VOCAB))
    with pytest.raises(UsageError, match="encoder-decoder"):
        build_problem(t5, {"cpu": "1GiB"}, phase="decode")


def test_offloaded_blocks_charge_the_main_device_with_their_kv_cache_and_streamed_weights():
    # an H100 showed it: a block mapped to "cpu" computes on the main GPU (the lowest id), so its KV
    # cache is made there and its weights are copied there while it runs
    from torchplace.costmodel import device_memory
    from torchplace.hf.maps import dispatched_memory, offload_charge
    from torchplace.plan import Stage

    model = build(gpt2_config(4), "meta")
    problem = build_problem(model, {0: "64MiB", "cpu": "1GiB"}, batch_size=2, sequence_length=32)
    g, kv = problem.graph, problem.graph.meta["hf"]["kv_cache"]
    order = g.topological_order()
    layers = [v for v in order if v in kv]
    away = set(layers[:2])
    stages, cur = [], None
    for v in order:
        dev = "cpu" if v in away else "cuda:0"
        if cur is None or cur.device != dev:
            cur = Stage(dev, (v,))
            stages.append(cur)
        else:
            stages[-1] = cur = Stage(dev, (*cur.nodes, v))
    main, extra = offload_charge(problem, stages)
    assert main == "cuda:0"
    assert extra == sum(kv[v] for v in away) + max(g.record(v).param_bytes for v in away)
    assert dispatched_memory(problem, stages)["cuda:0"] == device_memory(problem, stages)["cuda:0"] + extra


def test_activations_of_offloaded_blocks_move_as_the_main_device_sends_them(tmp_path):
    """A block mapped to "cpu" or "disk" computes on GPU 0: its inputs and outputs cost nothing to
    and from GPU 0 and each other, and take GPU 0's link to any other GPU (here an NVLink from
    the cluster file, where the host link it would otherwise be charged is 100x slower)."""
    from torchplace.clusterfile import load_cluster
    from torchplace.hf.budget import hf_cluster

    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"format": "torchplace.cluster/1", "bandwidth": 2e9, "devices": ['
                       '{"name": "cuda:0", "kind": "cuda", "torch_device": "cuda:0"},'
                       '{"name": "cuda:1", "kind": "cuda", "torch_device": "cuda:1"}],'
                       '"links": [{"src": "cuda:0", "dst": "cuda:1", "bandwidth": 2e11, "bidirectional": true}]}')
    hw = hf_cluster({0: "1GiB", 1: "1GiB", "cpu": "4GiB", "disk": "8GiB"}, load_cluster(cluster))
    nbytes = 6 * 2**20
    for a, b in [("cuda:0", "cpu"), ("cpu", "cuda:0"), ("cpu", "disk"), ("disk", "cuda:0")]:
        assert hw.link_time(nbytes, a, b) == 0.0, (a, b)
    nvlink = hw.link_time(nbytes, "cuda:0", "cuda:1")
    assert nvlink < nbytes / 2e9 / 50  # the NVLink, not the host link
    for a, b in [("cpu", "cuda:1"), ("cuda:1", "disk")]:
        assert hw.link_time(nbytes, a, b) == pytest.approx(nvlink), (a, b)
    # with no GPU, "disk" blocks compute on the CPU: nothing moves between them
    assert hf_cluster({"cpu": "4GiB", "disk": "8GiB"}).link_time(nbytes, "cpu", "disk") == 0.0


def test_a_map_that_offloads_every_block_names_the_gpu_that_computes_them():
    from torchplace.hf.maps import to_device_map
    from torchplace.plan import Plan, Stage

    model = build(gpt2_config(2), "meta")
    problem = build_problem(model, {0: "64MiB", "cpu": "1GiB"}, batch_size=2, sequence_length=32)
    plan = Plan([Stage("cpu", tuple(problem.graph.topological_order()))], 0.0, 0.0, "test", 0.0)
    device_map = to_device_map(model, problem, plan)
    check_device_map(model, device_map)
    gpu = [k for k, v in device_map.items() if v == 0]
    assert len(gpu) == 1 and not any(True for _ in model.get_submodule(gpu[0]).parameters())


def test_block_memory_counts_the_attention_scores_the_math_kernel_makes():
    # CPU's flash kernel makes no score matrix; CUDA's math fallback (fp32 with a mask) does
    batch, seq, heads = 4, 64, 4
    model = build(gpt2_config(1), "meta")
    problem = build_problem(model, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq)
    assert problem.graph.meta["hf"]["activations"] >= 2 * batch * heads * seq * seq * 4  # scores and softmax


@pytest.mark.parametrize("share", [0.3, 0.4, 0.5, 0.6])
@pytest.mark.filterwarnings("ignore:no device map fits GPU")
def test_every_map_returned_fits_once_offloaded_blocks_are_charged_to_their_gpu(share, tmp_path):
    # a fast GPU 0, a slow GPU 1 and the host: offloading to the host (computing on GPU 0) is what
    # the time prefers, and what overfills GPU 0 unless the solve keeps room for it (at 0.4 and 0.5
    # of the weights per GPU the first plan does; at 0.3 no map fits the GPUs, and the CPU computes)
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"format": "torchplace.cluster/1", "devices": ['
                       '{"name": "cuda:0", "kind": "cuda", "torch_device": "cuda:0"},'
                       '{"name": "cuda:1", "kind": "cuda-t4", "torch_device": "cuda:1"},'
                       '{"name": "cpu", "kind": "cpu", "torch_device": "cpu"}]}')
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=128,
                                     bos_token_id=0, eos_token_id=1, pad_token_id=1)
    model = build(config, "meta")
    gpu = int(share * sum(p.numel() * 4 for p in model.parameters()))
    try:
        plan = plan_device_map(model, {0: gpu, 1: gpu, "cpu": "1GiB"}, cluster=cluster, batch_size=2,
                               sequence_length=16)
    except InfeasibleError as e:
        assert share < 0.4 and "max_memory" in str(e)
        return
    check_device_map(model, plan.device_map)
    cost = evaluate_device_map(plan.problem, plan.device_map)
    assert cost.fits and cost.seconds == pytest.approx(plan.plan.objective)
    if share < 0.4:
        assert plan.device_map == {"": "cpu"}
    if share in (0.4, 0.5):
        assert plan.plan.meta["offload"].startswith("room kept")
        assert "cpu" in plan.device_map.values()


def test_the_offload_link_is_measured_for_a_model_with_weights_on_an_attached_gpu(monkeypatch):
    """accelerate copies a CPU-mapped block's weights to the GPU on every call, from pageable
    memory: that link is measured (pretended here: 2 GB/s), not taken from PCIe's nominal rate."""
    import torchplace.hf.infer as infer
    from torchplace.profiling.links import LinkFit

    calls = []
    monkeypatch.setattr(infer, "measure_host_links", lambda device, repeats=5: calls.append(("cpu", device)) or {
        ("cpu", device): LinkFit(0.0, 2e9, 1.0, 6), (device, "cpu"): LinkFit(0.0, 1e9, 1.0, 6)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    budget = {0: "64MiB", "cpu": "1GiB"}
    for device, measured in (("meta", False), ("cpu", True)):
        calls.clear()
        g = build_problem(build(gpt2_config(2), device), budget, batch_size=2, sequence_length=16).graph
        assert calls == ([("cpu", "cuda:0")] if measured else [])
        bandwidth = 2e9 if measured else torchplace.devices.DEFAULT_LINK_BANDWIDTH
        heavy = max((r for _, r in g.records()), key=lambda r: r.param_bytes)
        assert heavy.times["cpu-offload"] == pytest.approx(heavy.times["cuda"] + heavy.param_bytes / bandwidth)


def test_a_mixture_of_experts_on_the_meta_device_is_costed_by_the_experts_it_routes_to():
    """Grouped expert matmuls have a bfloat16-only fake kernel and no flop formula of torch's: a
    float32 Mixtral on the meta device is probed on bfloat16 fake tensors, each token charged for
    the experts it is routed to (not every expert, as the structural fallback would), with its
    activations in float32 bytes."""
    from torchplace.hf import blocks

    def mixtral(k: int):
        return transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                          num_experts_per_tok=k, vocab_size=VOCAB, max_position_embeddings=128)

    batch, seq = 2, 16
    kwargs = {"input_ids": torch.randint(0, VOCAB, (batch, seq)), "use_cache": False}
    flops = {}
    for k in (1, 2):
        model = build(mixtral(k), "meta")
        assert next(model.parameters()).dtype == torch.float32
        graph = blocks.block_graph(model, kwargs, kinds=["cuda"], no_split=["MixtralDecoderLayer"], repeats=0)
        assert graph.meta["hf"]["costs"] == "estimated"
        layer = next(r for _, r in graph.records() if r.name == "model.layers.0")
        assert layer.output_bytes == batch * seq * 64 * 4
        probe = blocks._probe(model, blocks.blocks_of(model, ["MixtralDecoderLayer"]), kwargs, 0,
                              fake_dtype=torch.bfloat16)
        flops[k] = probe.records["model.layers.0"].flops
    assert flops[2] - flops[1] == batch * seq * 3 * 2 * 64 * 128  # one more expert: gate, up and down


# -- what accelerate and from_pretrained really do ----------------------------------------------------
def accelerates_main(device_map):
    """The device accelerate 1.15's dispatch_model computes offloaded blocks on (its own expression)."""
    gpus = set(device_map.values()) - {"cpu", "disk"}
    return list(gpus)[0] if gpus else "cpu"


def test_offloaded_blocks_are_charged_to_the_gpu_accelerate_computes_them_on(tmp_path):
    # a slow GPU 0 with little room and a fast GPU 1: the plan offloads and puts blocks on both;
    # accelerate computes the offloaded ones on the lowest id its map names, not the first in order
    from torchplace.hf.maps import offload_charge

    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"format": "torchplace.cluster/1", "devices": ['
                       '{"name": "cuda:0", "kind": "cuda-t4", "torch_device": "cuda:0"},'
                       '{"name": "cuda:1", "kind": "cuda", "torch_device": "cuda:1"},'
                       '{"name": "cpu", "kind": "cpu", "torch_device": "cpu"}]}')
    config = transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, n_positions=128, vocab_size=1000)
    model = build(config, "meta")
    weights = sum(p.numel() * 4 for p in model.parameters())
    budget = {0: int(weights * 0.2), 1: int(weights * 0.7), "cpu": "1GiB"}
    plan = plan_device_map(model, budget, batch_size=2, sequence_length=16, cluster=cluster, time_limit=2, repeats=0)
    values = set(plan.device_map.values())
    assert "cpu" in values and {0, 1} <= values, plan.device_map  # offloads, and both GPUs hold blocks
    main, extra = offload_charge(plan.problem, plan.plan.stages)
    assert extra > 0 and main == f"cuda:{accelerates_main(plan.device_map)}"
    assert plan.memory[0] <= budget[0]  # the charge is inside GPU 0's budget
    cost = evaluate_device_map(plan.problem, plan.device_map)
    assert cost.fits and cost.memory == plan.memory and cost.seconds == pytest.approx(plan.plan.objective)


def test_a_map_that_offloads_names_the_gpu_its_offloaded_blocks_were_priced_on():
    """A plan offloading with nothing on GPU 0 was priced computing on GPU 0 (its kind, its links):
    the map names GPU 0 through a module without weights, so accelerate computes there too."""
    from torchplace.hf.maps import to_device_map
    from torchplace.plan import Plan, Stage

    model = build(gpt2_config(2), "meta")
    problem = build_problem(model, {0: "64MiB", 1: "64MiB", "cpu": "1GiB"}, batch_size=2, sequence_length=32)
    order = problem.graph.topological_order()
    layers = [v for v in order if v in problem.graph.meta["hf"]["kv_cache"]]
    stages, cur = [], None
    for v in order:
        dev = "cpu" if v == layers[0] else "cuda:1"
        if cur is None or cur.device != dev:
            stages.append(Stage(dev, (v,)))
        else:
            stages[-1] = Stage(dev, (*cur.nodes, v))
        cur = stages[-1]
    device_map = to_device_map(model, problem, Plan(stages, 0.0, 0.0, "test", 0.0))
    check_device_map(model, device_map)
    assert accelerates_main(device_map) == 0
    named = [k for k, v in device_map.items() if v == 0]
    assert len(named) == 1 and not any(True for _ in model.get_submodule(named[0]).parameters())
    # any map is priced where accelerate would compute its offloaded blocks: here GPU 1
    theirs = {k: v for k, v in device_map.items() if v != 0}
    charged = evaluate_device_map(problem, theirs).memory
    assert charged[1] > evaluate_device_map(problem, device_map).memory[1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_weights_kept_in_float32_by_from_pretrained_are_counted_in_float32(dtype, tmp_path):
    # T5's _keep_in_fp32_modules (["wo"]) stay float32 when from_pretrained loads float16, not bfloat16:
    # every block must weigh what the loaded model's block weighs
    from torchplace.hf.blocks import blocks_of

    config = transformers.T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16,
                                   vocab_size=VOCAB, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=dtype)
    assert any(p.dtype == torch.float32 for p in loaded.parameters()) == (dtype == torch.float16)
    no_split = list(model._no_split_modules)
    planned = [(b.path, b.param_bytes) for b in blocks_of(model, no_split, dtype)]
    assert planned == [(b.path, b.param_bytes) for b in blocks_of(loaded, no_split)]


def test_a_16_bit_map_is_timed_at_the_gpus_16_bit_peak():
    """HF_DEVICE_SPECS priced every dtype at the A100's FP32 peak (19.5 TFLOP/s): a float16 decoder
    layer, compute-bound, was predicted as slow as a float32 one (a float16 Llama-70B forward pass
    at about a minute), though its tensor cores run float16 and bfloat16 at 312."""
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=1024,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=256)
    model = build(config, "meta")

    def layers(dtype):
        problem = build_problem(model, {0: "1GiB"}, batch_size=8, sequence_length=128, dtype=dtype, repeats=0)
        return sum(r.times["cuda"] for _, r in problem.graph.records() if r.op == "block:LlamaDecoderLayer")

    fp32, fp16, bf16 = layers(torch.float32), layers(torch.float16), layers(torch.bfloat16)
    assert fp16 == bf16 and fp32 / fp16 > 4  # halving the bytes alone gives at most 2


def test_a_block_kept_in_float32_is_timed_at_the_fp32_peak():
    from torchplace.hf.blocks import HF_DEVICE_SPECS

    config = transformers.T5Config(num_layers=1, num_decoder_layers=1, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
                                   vocab_size=VOCAB, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(config).eval()
    problem = build_problem(model, {0: "1GiB"}, batch_size=8, sequence_length=128, dtype=torch.float16,
                            no_split_module_classes=[], repeats=0)
    spec, times = HF_DEVICE_SPECS["cuda"], {r.module: r.times["cuda"] for _, r in problem.graph.records()}
    wo, wi = "encoder.block.0.layer.1.DenseReluDense.wo", "encoder.block.0.layer.1.DenseReluDense.wi"
    flops = 2 * 256 * 1024 * 8 * 128  # wi and wo: the same matmul, transposed
    assert times[wo] >= flops / spec.peak(torch.float32) > times[wi] >= flops / spec.peak(torch.float16)


def test_a_disk_only_budget_gives_a_map_dispatch_model_and_from_pretrained_run(tmp_path):
    model = build(gpt2_config(2))
    model.save_pretrained(tmp_path / "model")
    device_map = torchplace.infer_device_map(model, {"disk": "1GiB"}, sequence_length=8, time_limit=2, repeats=0)
    assert set(device_map.values()) == {"disk"} and "" not in device_map
    check_device_map(model, device_map)
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    other = build(gpt2_config(2))
    other.load_state_dict(model.state_dict())
    other = dispatch_model(other, device_map, offload_dir=str(tmp_path / "dispatch"))
    assert torch.equal(other.generate(ids, max_new_tokens=3, do_sample=False), expected)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                               offload_folder=str(tmp_path / "offload"))
    assert torch.equal(loaded.generate(ids, max_new_tokens=3, do_sample=False), expected)


def test_accelerates_memory_strings_are_read_as_accelerate_reads_them():
    from accelerate.utils import convert_file_size_to_int

    from torchplace.hf.budget import hf_cluster

    for amount in ("8Gb", "8gb", "8GB", "800Mb", "64Kb", "1.5GiB", "0.3gib"):
        caps = {d.name: d.memory_bytes for d in hf_cluster({0: amount, "cpu": "1GiB"}).devices}
        assert caps["cuda:0"] == convert_file_size_to_int(amount), amount



def test_a_cluster_without_memory_for_max_memory_to_take_says_to_give_max_memory():
    """With max_memory left out, a cluster naming no cuda:i / cpu / disk device with a memory was
    "max_memory must be a non-empty dict ..., got {}", of a max_memory the user never gave (found by fuzzing)."""
    from torchplace.devices import Cluster, Device
    from torchplace.hf.budget import hf_cluster

    for devices in ([Device("cuda:0", "meta", "cuda"), Device("cpu", "cpu", "cpu")],
                    [Device("gpu-a", "meta", "cuda", 2**30)]):
        with pytest.raises(UsageError, match=r"no max_memory is given.*give max_memory \(command line: --max-memory"):
            hf_cluster(None, Cluster(tuple(devices)))

def bad_input_cases():
    ids = torch.randint(0, VOCAB, (2, 8))
    vit = transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                 image_size=32, patch_size=16)
    return {
        "seq-beyond-positions-real": (lambda: (build(gpt2_config(1)), dict(sequence_length=1000)), "at most 128"),
        "seq-beyond-positions-meta": (lambda: (build(llama_config(1), "meta"), dict(sequence_length=129)),
                                      "max_position_embeddings"),
        "vision-model-no-example": (lambda: (transformers.ViTModel(vit).eval(), {}), "takes no input_ids"),
        "sequential-no-example": (lambda: (torch.nn.Sequential(torch.nn.Linear(4, 4)), {}), "takes no input_ids"),
        "misspelt-kwarg-real": (lambda: (build(gpt2_config(1)), dict(example_kwargs={"input_idz": ids})),
                                "failed on its example inputs"),
        "misspelt-kwarg-meta": (lambda: (build(gpt2_config(1), "meta"), dict(example_kwargs={"input_idz": ids})),
                                "failed on its example inputs"),
        "no-split-typo": (lambda: (build(gpt2_config(1), "meta"), dict(no_split_module_classes=["GPT2block"])),
                          "did you mean 'GPT2Block'"),
        "no-split-not-a-class": (lambda: (build(gpt2_config(1), "meta"), dict(no_split_module_classes=[3])),
                                 "module classes or their names"),
        "integer-dtype": (lambda: (build(gpt2_config(1), "meta"), dict(dtype=torch.int8)), "floating"),
        # 4 attention heads, 3 KV heads: the model cannot run, with weights or without
        "heads-do-not-divide-real": (lambda: (build(uneven_heads_config()), {}), "failed on its example inputs"),
        "heads-do-not-divide-meta": (lambda: (build(uneven_heads_config(), "meta"), {}),
                                     "failed on its example inputs"),
    }


def uneven_heads_config():
    return transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=3, vocab_size=VOCAB,
                                    max_position_embeddings=128)


@pytest.mark.parametrize("case", list(bad_input_cases()))
def test_bad_inputs_are_usage_errors_naming_the_problem(case):
    make, match = bad_input_cases()[case]
    model, options = make()
    with pytest.raises(UsageError, match=match):
        plan_device_map(model, {"cpu": "1GiB"}, time_limit=2, repeats=0, **options)



@pytest.mark.parametrize("option, value, match", [
    ("time_limit", float("nan"), "time_limit: expected a positive"), ("time_limit", 0, "time_limit: expected a positive"),
    ("disk_bandwidth", 0, "disk_bandwidth: expected a positive"), ("repeats", -1, "repeats: expected a non-negative"),
    ("kv_cache", "no", "kv_cache must be True or False"), ("specs", {"cpu": 1}, "specs must map device kinds to DeviceSpec")])
def test_bad_solver_and_cost_options_are_usage_errors_naming_them(option, value, match):
    """disk_bandwidth=0 was a ZeroDivisionError, time_limit nan, 0 or -1 a SolverLimitError saying no
    scheduler finished, repeats=-1 was taken (place() checks all three; found by fuzzing); kv_cache="no"
    was taken as true, a KV cache planned for a caller who asked for none; specs={"cpu": 1} was an
    AttributeError ('int' object has no attribute 'peak_flops')."""
    options = {"time_limit": 2, "repeats": 0, option: value}
    with pytest.raises(UsageError, match=match):
        plan_device_map(build(gpt2_config(1), "meta"), {"cpu": "100KiB", "disk": "1GiB"}, sequence_length=8, **options)

def test_an_option_infer_device_map_does_not_take_is_named_with_the_one_meant():
    """A misspelt option (phse="decode") was Python's TypeError naming plan_device_map, a function
    the caller never called."""
    model = build(gpt2_config(1), "meta")
    with pytest.raises(UsageError, match="infer_device_map takes no option 'phse': did you mean 'phase'"):
        torchplace.infer_device_map(model, {"cpu": "1GiB"}, phse="decode")
    with pytest.raises(UsageError, match="no option 'zzz': its options are .*'time_limit'"):
        torchplace.infer_device_map(model, {"cpu": "1GiB"}, zzz=1)


def test_cli_refuses_a_device_named_twice_and_shows_why_a_config_cannot_be_built(tmp_path, capsys):
    from torchplace.cli import main

    config = tmp_path / "config.json"
    gpt2_config(1).to_json_file(config)
    assert main(["plan", "--hf", str(config), "--max-memory", "0=1MiB", "0=2GiB", "--sequence-length", "8"]) == 2
    assert "twice" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    transformers.GPT2Config(n_layer=1, n_embd=66, n_head=4, vocab_size=VOCAB).to_json_file(bad)
    assert main(["plan", "--hf", str(bad), "--max-memory", "cpu=1GiB"]) == 2
    assert "divisible" in capsys.readouterr().err  # transformers' own reason


# -- the KV cache, as a real forward pass makes it ------------------------------------------------------
def real_cache_bytes(model, batch: int, seq: int) -> int:
    """Bytes of the cache ``model`` (real weights) keeps after a forward pass of ``batch x seq``
    tokens (Whisper: of the decoder, after its encoder read ``batch`` clips of the longest audio)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "use_cache": True}
    if model.main_input_name == "input_features":
        frames = 2 * model.config.max_source_positions  # conv2's stride of 2 leaves max_source_positions
        kwargs = {"input_features": torch.randn(batch, model.config.num_mel_bins, frames), "use_cache": True}
    if model.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = ids
    with torch.no_grad():
        cache = model(**kwargs).past_key_values
    caches = [cache.self_attention_cache, cache.cross_attention_cache] if hasattr(cache, "cross_attention_cache") \
        else [cache]
    return sum(t.numel() * t.element_size() for c in caches for layer in c.layers for t in (layer.keys, layer.values))


def bart_config(layers: int = 1, vocab: int = VOCAB):
    return transformers.BartConfig(encoder_layers=layers, decoder_layers=layers, d_model=64, encoder_ffn_dim=128,
                                   decoder_ffn_dim=128, encoder_attention_heads=2, decoder_attention_heads=2,
                                   vocab_size=vocab, max_position_embeddings=64)


@pytest.mark.parametrize("no_split", [None, [], ["LlamaMLP"]], ids=["default", "none", "mlp-only"])
def test_kv_cache_is_counted_when_no_split_classes_split_the_attention_module(no_split):
    """A split attention module's cache is made by its key and value projections: it is charged
    there, never dropped."""
    model = build(llama_config(2))
    batch, seq = 2, 16
    problem = build_problem(model, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq, repeats=0,
                            no_split_module_classes=no_split)
    kv, paths = problem.graph.meta["hf"]["kv_cache"], problem.graph.meta["hf"]["modules"]
    assert sum(kv.values()) == real_cache_bytes(model, batch, seq)
    holders = sorted(paths[v].rpartition(".")[2] for v in kv)
    assert holders == (["0", "1"] if no_split is None else ["k_proj", "k_proj", "v_proj", "v_proj"])


def test_an_encoder_decoder_models_cache_is_not_put_on_its_root_tensors():
    """BART's ``final_logits_bias`` is a block at path "" holding only that tensor: the decoder's
    self- and cross-attention caches go to the attention modules' projections, not to it."""
    model = transformers.BartForConditionalGeneration(bart_config()).eval()
    batch, seq = 2, 16
    problem = build_problem(model, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq, repeats=0,
                            no_split_module_classes=[])
    kv, paths = problem.graph.meta["hf"]["kv_cache"], problem.graph.meta["hf"]["modules"]
    assert sum(kv.values()) == real_cache_bytes(model, batch, seq)
    assert all(paths[v].startswith("model.decoder.layers.") and paths[v].endswith(("k_proj", "v_proj")) for v in kv)


def test_an_offload_device_holds_only_the_weights_of_its_blocks():
    """A block mapped to "cpu" computes on GPU 0, where its KV cache is made: "cpu" needs room for
    its weights only, so a budget of exactly those weights fits (and a map is found for it)."""
    model = build(gpt2_config(2), "meta")
    device_map = {"transformer.wte": "cpu", "transformer.wpe": 0, "transformer.h": "cpu", "transformer.ln_f": 0,
                  "lm_head": "cpu"}
    on_cpu = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                 if owner(device_map, n) == "cpu")
    budget = {0: "700KiB", "cpu": on_cpu}
    problem = build_problem(model, budget, batch_size=2, sequence_length=32, repeats=0)
    assert sum(problem.graph.meta["hf"]["kv_cache"].values()) > 0
    cost = evaluate_device_map(problem, device_map)
    assert cost.memory["cpu"] == on_cpu and cost.fits
    plan = plan_device_map(model, budget, batch_size=2, sequence_length=32, repeats=0, time_limit=2)
    check_device_map(model, plan.device_map)
    assert "cpu" not in plan.kv_cache and plan.memory.get("cpu", 0) <= on_cpu
    assert evaluate_device_map(plan.problem, plan.device_map).fits


# -- pricing anyone's map ----------------------------------------------------------------------------
def test_a_key_naming_a_tensor_prices_that_tensor_on_its_device():
    """accelerate's keys may name a module's own tensors (BART's "final_logits_bias", which
    torchplace's own maps name too): the tensor is charged where its key sends it."""
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(bart_config(vocab=4096)).eval()
    problem = build_problem(model, {0: "64MiB", 1: "64MiB"}, batch_size=1, sequence_length=16, repeats=0)
    peak = problem.graph.meta["hf"]["activations"]
    cost = evaluate_device_map(problem, {"final_logits_bias": 1, "model": 0, "lm_head": 0})
    assert cost.memory[1] - peak == model.final_logits_bias.numel() * model.final_logits_bias.element_size()


def test_a_map_splitting_tied_weights_is_charged_a_copy_and_does_not_fit():
    model = build(gpt2_config(2), "meta")
    problem = build_problem(model, {0: "10MiB", 1: "10MiB"}, batch_size=2, sequence_length=32, repeats=0)
    peak = problem.graph.meta["hf"]["activations"]
    device_map = {"transformer": 0, "lm_head": 1}
    assert any(len({owner(device_map, n) for n in group}) > 1 for group in find_tied_parameters(model))
    cost = evaluate_device_map(problem, device_map)
    assert not cost.fits
    assert cost.memory[1] - peak == model.lm_head.weight.numel() * model.lm_head.weight.element_size()


def test_a_map_leaving_weights_without_a_device_is_refused_as_accelerate_refuses_it():
    model = build(gpt2_config(2), "meta")
    problem = build_problem(model, {0: "10MiB", 1: "10MiB"}, batch_size=2, sequence_length=32, repeats=0)
    device_map = {"transformer.h": 1}
    with pytest.raises(ValueError, match="transformer.wte.weight"):
        check_device_map(model, device_map)
    with pytest.raises(UsageError, match="no device for transformer.wte.weight"):
        evaluate_device_map(problem, device_map)


def bart_meta(layers: int = 2, vocab: int = 4096):
    with torch.device("meta"):
        return transformers.AutoModelForSeq2SeqLM.from_config(bart_config(layers, vocab)).eval()


def test_a_plan_offloading_with_nothing_on_the_main_gpu_moves_a_block_there(monkeypatch):
    """BART has no module without weights to name GPU 0 in a map: a solved plan that offloads its
    embeddings and puts everything else on GPU 1 gets a block moved onto GPU 0 (within budget),
    so accelerate computes the offloaded blocks where they were priced."""
    import torchplace.hf.infer as infer
    from torchplace.plan import Plan, Stage

    model = bart_meta()
    budget = {0: "64MiB", 1: "64MiB", "cpu": "1GiB"}
    problem = build_problem(model, budget, batch_size=2, sequence_length=16, repeats=0)
    stages = []
    for v in problem.graph.topological_order():
        dev = "cpu" if "embed" in problem.graph.record(v).name or problem.graph.record(v).colocation else "cuda:1"
        if stages and stages[-1].device == dev:
            stages[-1] = Stage(dev, (*stages[-1].nodes, v))
        else:
            stages.append(Stage(dev, (v,)))
    offloading = Plan.build(problem, stages, solver="hand", seconds=0.0, lower_bound=0.0)
    monkeypatch.setattr(infer, "_solve_dispatched", lambda problem, time_limit: offloading)
    plan = infer.solve_device_map(model, problem)
    check_device_map(model, plan.device_map)
    assert "cpu" in plan.device_map.values() and accelerates_main(plan.device_map) == 0
    cost = evaluate_device_map(problem, plan.device_map)
    assert cost.fits and cost.memory == plan.memory and cost.seconds == pytest.approx(plan.plan.objective)


def test_the_map_is_never_slower_than_filling_the_devices_in_order(monkeypatch):
    """A MILP stopped by its time limit may hold a plan slower than filling the devices in order
    (T5 on a fast and a slow GPU: 8.3 ms where accelerate's sequential map with room left by hand
    took 6.3 ms). The in-order fill, tied weights placed whole with their first block, is a
    candidate the returned plan is never slower than; where the solver finds nothing, it is the plan."""
    import torchplace.hf.infer as infer
    from torchplace.hf.maps import budgets, dispatched_memory
    from torchplace.plan import Plan, Stage

    model = bart_meta()
    problem = build_problem(model, {0: "64MiB", 1: "64MiB", "cpu": "1GiB"}, batch_size=2, sequence_length=16,
                            repeats=0)
    filled = infer._filled_in_order(problem, 0.0)
    assert filled is not None
    caps, memory = budgets(problem), dispatched_memory(problem, filled.stages)
    assert all(caps[d] is None or b <= caps[d] for d, b in memory.items())
    g, where = problem.graph, filled.assignment
    tied = {g.record(v).colocation for v in g} - {None}
    assert tied and all(len({where[v] for v in g if g.record(v).colocation == label}) == 1 for label in tied)
    devices = [d.name for d in problem.cluster.devices]
    untied = [devices.index(where[v]) for v in g.topological_order() if g.record(v).colocation is None]
    assert untied == sorted(untied)  # in order: never back to an earlier device

    stages = []  # a slower plan than the fill: embeddings offloaded, the rest on GPU 1
    for v in g.topological_order():
        dev = "cpu" if g.record(v).colocation else "cuda:1"
        if stages and stages[-1].device == dev:
            stages[-1] = Stage(dev, (*stages[-1].nodes, v))
        else:
            stages.append(Stage(dev, (v,)))
    slower = Plan.build(problem, stages, solver="hand", seconds=0.0, lower_bound=0.0)
    assert slower.objective > filled.objective
    monkeypatch.setattr(infer, "_solved_dispatched", lambda problem, time_limit: slower)
    assert infer._solve_dispatched(problem, 1.0).objective == pytest.approx(filled.objective)

    def nothing(problem, time_limit):
        raise InfeasibleError("no plan")

    monkeypatch.setattr(infer, "_solved_dispatched", nothing)
    plan = infer.solve_device_map(model, problem)
    check_device_map(model, plan.device_map)
    assert plan.plan.solver == "in-order fill" and evaluate_device_map(problem, plan.device_map).fits


def test_a_tight_main_gpu_still_gets_a_map_when_the_model_has_no_weightless_module():
    # the fuzzer's case: the solver's plan offloaded the embeddings with nothing on GPU 0
    model = bart_meta()
    budget = {0: 2117580, 1: 2117580, "cpu": "1GiB"}
    plan = plan_device_map(model, budget, batch_size=2, sequence_length=16, repeats=0, time_limit=None)
    check_device_map(model, plan.device_map)
    assert evaluate_device_map(plan.problem, plan.device_map).fits


@torch.library.custom_op("torchplace_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class _FakeUnfriendly(torch.nn.Module):
    """An embedding, then an operator fake tensors cannot run: a custom one with no fake kernel,
    or one whose output shape depends on the data."""

    def __init__(self, op):
        super().__init__()
        self.embed, self.proj, self.op = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 16), op

    def forward(self, input_ids):
        return self.proj(self.op(self.embed(input_ids)))


@pytest.mark.parametrize("op", [torch.ops.torchplace_test.no_fake,
                                lambda h: h[torch.nonzero(h[..., 0] > 0, as_tuple=True)]],
                         ids=["no-fake-kernel", "data-dependent"])
def test_a_meta_model_fake_tensors_cannot_run_is_costed_from_its_parameters(op):
    from torchplace.hf import blocks

    with torch.device("meta"):
        model = _FakeUnfriendly(op).eval()
    kwargs = {"input_ids": torch.randint(0, VOCAB, (2, 8))}
    graph = blocks.block_graph(model, kwargs, kinds=["cuda"], no_split=[], repeats=0)
    assert graph.meta["hf"]["costs"] == "structural"


def test_a_meta_model_costed_from_its_parameters_is_costed_in_the_dtype_it_will_run_in():
    """The structural costs took the model's own element size for the target dtype's: a float32 meta
    model planned for float16 had its outputs sized in float32 and its FLOPs halved (its float16
    weight bytes divided by 4 bytes per parameter)."""
    from types import SimpleNamespace

    from torchplace.hf import blocks
    from torchplace.profiling.estimate import DeviceSpec

    with torch.device("meta"):
        model = _FakeUnfriendly(torch.ops.torchplace_test.no_fake).eval()
    model.config = SimpleNamespace(hidden_size=16)
    kwargs = {"input_ids": torch.randint(0, VOCAB, (2, 8))}
    flops_only = {"cuda": DeviceSpec(peak_flops=1.0, mem_bandwidth=math.inf, overhead=0.0)}  # time = FLOPs
    for dtype, item in ((None, 4), (torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)):
        graph = blocks.block_graph(model, kwargs, kinds=["cuda"], no_split=[], dtype=dtype, repeats=0, specs=flops_only)
        assert graph.meta["hf"]["costs"] == "structural"
        proj = next(r for _, r in graph.records() if r.module == "proj")
        assert proj.output_bytes == 16 * 16 * item
        assert proj.times["cuda"] == 2 * (16 * 16 + 16) * 16


# -- config files ------------------------------------------------------------------------------------
def whisper_config():
    return transformers.WhisperConfig(encoder_layers=1, decoder_layers=1, d_model=64, encoder_ffn_dim=128,
                                      decoder_ffn_dim=128, encoder_attention_heads=2, decoder_attention_heads=2,
                                      vocab_size=VOCAB, num_mel_bins=16, max_source_positions=32,
                                      max_target_positions=64, pad_token_id=1, bos_token_id=0, eos_token_id=1,
                                      decoder_start_token_id=0)


@pytest.mark.parametrize("config, auto", [(bart_config, "AutoModelForSeq2SeqLM"),
                                          (whisper_config, "AutoModelForSpeechSeq2Seq")], ids=["bart", "whisper"])
def test_an_encoder_decoder_config_without_architectures_is_planned_with_its_encoder(config, auto, tmp_path):
    import json

    from torchplace.hf.config import meta_model

    cfg = config()
    data = cfg.to_dict()
    data.pop("architectures", None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    model = meta_model(path)
    assert type(model) is getattr(transformers, auto)._model_mapping[type(cfg)]
    assert any(n.startswith("model.encoder.") for n, _ in model.named_parameters())


def kv_cases():
    small = dict(max_position_embeddings=128, vocab_size=VOCAB)
    return {
        "falcon-multi-query": lambda: transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, multi_query=True,
            new_decoder_architecture=False, **small),
        "falcon-multi-head": lambda: transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, multi_query=False,
            new_decoder_architecture=False, **small),
        "falcon-new-architecture": lambda: transformers.FalconConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
            new_decoder_architecture=True, **small),
        "gpt-bigcode-multi-query": lambda: transformers.GPTBigCodeConfig(
            n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=VOCAB, multi_query=True),
        "mistral-sliding-window": lambda: transformers.MistralConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=8, **small),
        "gemma2-alternating-windows": lambda: transformers.Gemma2Config(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, **small),
        # multi-head latent attention: transformers 5 caches the compressed latent (kv_lora_rank +
        # qk_rope_head_dim, one head); 4.x cached every head's keys and values
        "deepseek-v3-latent": lambda: transformers.DeepseekV3Config(
            num_hidden_layers=2, first_k_dense_replace=2, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, **small),
        "deepseek-v3-latent-moe": lambda: transformers.DeepseekV3Config(
            num_hidden_layers=2, first_k_dense_replace=1, hidden_size=64, intermediate_size=128,
            moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, **small),
        "minicpm3-latent": lambda: transformers.MiniCPM3Config(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, **small),
    }


@pytest.mark.parametrize("case", list(kv_cases()))
def test_the_kv_cache_planned_is_the_one_a_forward_pass_keeps(case):
    """Multi-query attention caches one key/value head, Falcon-40B's architecture every head, a
    sliding-window layer its last window - 1 tokens: the plan sizes the cache as the model keeps it."""
    model = build(kv_cases()[case]())
    batch, seq = 2, 32
    problem = build_problem(model, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq, repeats=0)
    assert sum(problem.graph.meta["hf"]["kv_cache"].values()) == real_cache_bytes(model, batch, seq)


def encoder_decoder_cases():
    return {
        "bart": (transformers.BartForConditionalGeneration, bart_config(2)),
        "bart-decoder-only": (transformers.BartForCausalLM, bart_config(2)),
        "whisper": (transformers.WhisperForConditionalGeneration, whisper_config()),
        "t5": (transformers.T5ForConditionalGeneration,
               transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=16, num_heads=4,
                                     vocab_size=VOCAB, decoder_start_token_id=0)),
    }


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("case", list(encoder_decoder_cases()))
def test_cross_attention_caches_are_sized_by_the_encoders_output(case, device):
    """A cross-attention layer caches the encoder's output once: Whisper's is as long as its audio
    (2 x 32 frames here, 1500 positions in the real model), not as the tokens generated, and was
    charged as 16 tokens (a third of the cache missed). BartForCausalLM's decoder has
    cross-attention modules that never run without an encoder, and was charged for them (2x)."""
    cls, cfg = encoder_decoder_cases()[case]
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).eval()
    batch, seq = 2, 16
    problem = build_problem(model, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq, repeats=0)
    torch.manual_seed(0)
    assert sum(problem.graph.meta["hf"]["kv_cache"].values()) == real_cache_bytes(cls(cfg).eval(), batch, seq)


def test_cli_plans_whisper_from_its_config(tmp_path, capsys):
    """Whisper's forward takes audio features, not token ids: the CLI makes them (mel bins x the
    frames its encoder takes) and plans it; a sequence past its decoder's positions is refused."""
    import json

    from torchplace.cli import main

    config = tmp_path / "config.json"
    whisper_config().to_json_file(config)
    args = ["plan", "--hf", str(config), "--max-memory", "cpu=1GiB", "--json"]
    assert main([*args, "--sequence-length", "16", "--batch", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = transformers.WhisperForConditionalGeneration(whisper_config()).eval()
    assert out["device_map"] and sum(out["kv_cache"].values()) == real_cache_bytes(model, 2, 16)
    assert main([*args, "--sequence-length", "65"]) == 2
    assert "max_target_positions" in capsys.readouterr().err


def test_a_meta_model_s_latent_cache_is_sized_as_its_layers_keep_it():
    """Planned before loading, DeepSeek-V3's cache was sized from its heads (2 x heads x head_dim per
    token and layer: 28x the compressed latent transformers 5 keeps at the real model's sizes); the
    layers are now read from the model's own cache, also where its experts do not run on meta."""
    cfg = kv_cases()["deepseek-v3-latent-moe"]()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    batch, seq = 2, 32
    problem = build_problem(meta, {"cpu": "1GiB"}, batch_size=batch, sequence_length=seq, repeats=0)
    assert sum(problem.graph.meta["hf"]["kv_cache"].values()) == real_cache_bytes(build(cfg), batch, seq)


def bad_config_cases():
    whisper = whisper_config().to_dict()
    whisper.update(pad_token_id=VOCAB + 1)  # transformers asserts padding_idx < num_embeddings
    gpt2 = gpt2_config(1).to_dict()
    gpt2.update(n_positions="abc")  # huggingface_hub's strict dataclass refuses the field
    return {"pad-token-beyond-vocabulary": (whisper, "Padding_idx"),
            "field-of-the-wrong-type": (gpt2, "n_positions")}


@pytest.mark.parametrize("case", list(bad_config_cases()))
def test_cli_refuses_a_config_transformers_refuses_with_its_reason_and_the_file(case, tmp_path, capsys):
    import json

    from torchplace.cli import main

    data, reason = bad_config_cases()[case]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--hf", str(path), "--max-memory", "cpu=1GiB"]) == 2
    err = capsys.readouterr().err
    assert reason in err and str(path) in err


def test_cli_plans_a_model_without_a_kv_cache_with_no_kv_cache(tmp_path, capsys):
    """Mamba names no attention heads: the error names the CLI's option, which plans it."""
    import json

    from torchplace.cli import main

    config = tmp_path / "config.json"
    transformers.MambaConfig(num_hidden_layers=2, hidden_size=64, state_size=4, vocab_size=VOCAB).to_json_file(config)
    args = ["plan", "--hf", str(config), "--max-memory", "cpu=1GiB", "--sequence-length", "16"]
    assert main(args) == 2
    assert "--no-kv-cache" in capsys.readouterr().err
    assert main([*args, "--no-kv-cache", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache"] == {} and out["device_map"]


def test_a_disk_only_plan_reports_the_ram_of_the_cpu_that_computes():
    """With "disk" alone accelerate computes on the CPU: the KV cache, the activations and the
    block being run are in its RAM (a "cpu" row), the disk holds the weights."""
    model = build(gpt2_config(2), "meta")
    plan = plan_device_map(model, {"disk": "1GiB"}, batch_size=2, sequence_length=32, repeats=0, time_limit=2)
    g = plan.problem.graph
    kv = sum(g.meta["hf"]["kv_cache"].values())
    largest = max(r.param_bytes for _, r in g.records())
    assert kv > 0 and plan.kv_cache == {"cpu": kv}
    assert plan.memory == {"disk": sum(r.param_bytes for _, r in g.records()),
                           "cpu": kv + largest + g.meta["hf"]["activations"]}
    assert "cpu" in str(plan) and evaluate_device_map(plan.problem, plan.device_map).memory == plan.memory


def test_a_disk_only_map_with_a_module_of_non_persistent_buffers_is_evaluated_as_planned():
    """With "disk" alone the map sends Llama's rotary_emb (only a non-persistent inv_freq) to "cpu",
    where accelerate computes; evaluate_device_map refused that map of its own plan: "device_map sends
    'model.rotary_emb' to 'cpu', which is not in max_memory ['disk']"."""
    model = build(llama_config(2), "meta")
    plan = plan_device_map(model, {"disk": "1GiB"}, batch_size=2, sequence_length=16, repeats=0, time_limit=2)
    assert plan.device_map["model.rotary_emb"] == "cpu"
    check_device_map(model, plan.device_map)
    cost = evaluate_device_map(plan.problem, plan.device_map)
    assert cost.fits and cost.memory == plan.memory and cost.seconds == pytest.approx(plan.plan.objective)
    # only such blocks: a map that sends weights to "cpu" puts them in a RAM max_memory does not give
    # (it was priced as the disk plan and said to fit)
    with pytest.raises(UsageError, match="sends .model.embed_tokens. to .cpu., which is not in max_memory"):
        evaluate_device_map(plan.problem, {"": "cpu"})


def test_a_module_of_non_persistent_buffers_stays_where_the_map_sends_it():
    """The map sends a module holding only non-persistent buffers (rotary_emb's inv_freq) to the main
    device, but the solver could plan it on an offload device: the plan's memory counted its bytes
    there and evaluate_device_map on the main device (seen on Mistral, decode, cpu + disk). The
    problem keeps such a block off the offload devices, so the plan is the map."""
    from torchplace.errors import InvalidPlanError
    from torchplace.hf.maps import dispatched_memory, to_device_map, with_reserve
    from torchplace.plan import Plan, Stage, stages_from_order

    model = build(llama_config(2), "meta")
    problem = build_problem(model, {0: "1GiB", "cpu": "1GiB", "disk": "1GiB"}, batch_size=2, sequence_length=16,
                            no_split_module_classes=[], repeats=0)
    g = problem.graph
    [rotary] = [v for v, r in g.records() if r.module == "model.rotary_emb"]
    assert g.record(rotary).param_bytes > 0
    assert g.record(rotary).time_on("cpu-offload") == g.record(rotary).time_on("disk-offload") == math.inf
    assert g.meta["hf"]["buffers_only"] == [rotary]
    order = g.topological_order()
    with pytest.raises(InvalidPlanError, match="cannot run"):
        Plan.build(problem, [Stage("disk", tuple(order))], solver="by hand", seconds=0.0, lower_bound=0.0)
    # everything on disk but rotary_emb, which the map sends to GPU 0, where the plan has it too
    stages = stages_from_order(problem, order, {**dict.fromkeys(order, "disk"), rotary: "cuda:0"})
    plan = Plan.build(problem, stages, solver="by hand", seconds=0.0, lower_bound=0.0, status="feasible")
    device_map = to_device_map(model, problem, plan)
    assert device_map["model.rotary_emb"] == 0 and set(device_map.values()) == {0, "disk"}
    cost = evaluate_device_map(problem, device_map)
    assert cost.memory == with_reserve(problem, dispatched_memory(problem, plan.stages))
    assert cost.seconds == pytest.approx(plan.objective)
    # no device that computes has room for it: said so, not the solver's "no placement satisfies"
    options = dict(batch_size=2, sequence_length=16, no_split_module_classes=[], repeats=0)
    peak = build_problem(model, {"cpu": "1GiB", "disk": "1GiB"}, **options).graph.meta["hf"]["activations"]
    with pytest.raises(InfeasibleError, match=r"'model.rotary_emb' holds only buffers the state dict lacks.*raise "
                                              r"max_memory of cpu"):
        plan_device_map(model, {"cpu": peak, "disk": "1GiB"}, **options)


def test_cli_never_asks_to_run_the_remote_code_a_configs_auto_map_names(tmp_path, capsys, monkeypatch):
    """transformers asked on the terminal "Do you wish to run the custom code? [y/N]" and waited 15 s
    (a 'y' would fetch and run it; found by fuzzing)."""
    import json

    from torchplace.cli import main

    asked: list[str] = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "n")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mymodel", "hidden_size": 8,
                                "auto_map": {"AutoConfig": "someone/repo--configuration_my.MyConfig",
                                             "AutoModelForCausalLM": "someone/repo--modeling_my.MyModel"}}))
    assert main(["plan", "--hf", str(path), "--max-memory", "cpu=1GiB"]) == 2
    assert asked == []
    assert "custom code" in capsys.readouterr().err


def test_cli_names_a_plan_given_as_the_cluster_file(tmp_path, capsys):
    """A plan given to --cluster was "top level: unknown field 'assignment'" (found by fuzzing)."""
    from torchplace.cli import main

    config, plan = tmp_path / "config.json", tmp_path / "plan.json"
    gpt2_config(1).to_json_file(config)
    plan.write_text('{"format": "torchplace.plan/1", "objective": 1.0}')
    assert main(["plan", "--hf", str(config), "--cluster", str(plan), "--sequence-length", "8"]) == 2
    assert "plan.json is a torchplace plan, not a cluster file" in capsys.readouterr().err
