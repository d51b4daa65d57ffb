"""torchplace's device_map beside accelerate's, on the same budgets (issue 15).

Run:  HF_HUB_OFFLINE=1 python benchmarks/device_map.py [--quick] [--time-limit S] [--phase decode]
      HF_HUB_OFFLINE=1 python benchmarks/device_map.py --gpu [--gpu-share 1.0 1.25]   (needs a GPU)

For each model (GPT-2 small, a Llama-style decoder, BERT-base, T5-small, a small Mixtral-style
MoE; built from configs on the meta device, no weights) and each heterogeneous cluster (a fast
A100-like GPU, a slow T4-like GPU, the host; GPU 0 fast or GPU 0 slow), the same
``max_memory`` goes to

- torchplace: :func:`torchplace.hf.solve_device_map`;
- accelerate ``infer_auto_device_map`` with the budgets as given (``sequential``) and with
  ``get_balanced_memory`` (``balanced``, what ``device_map="auto"`` does with several GPUs, and
  ``balanced_low_0``); and the same three with each GPU's budget lowered by the largest block's
  activations and half the KV cache (``+room``: the headroom a careful user would leave by hand);
- an equal-layer split: the no-split layers in equal numbers over the GPUs in id order, the
  modules before the first layer with it, those after the last with it, tied modules together.

Every map is timed by torchplace's cost model on one problem per (model, cluster)
(:func:`torchplace.hf.evaluate_device_map`: one forward pass of the stated batch, divided by the
batch size: seconds per sample, all estimated: nothing here has a GPU) and checked against the
budgets with the weights, activations and the KV cache of the stated batch and sequence length.
A map that does not fit is reported as such; speed-ups are against the best map that fits.
With ``--phase decode`` the time is that of one generated token of every sequence of the batch
(each attention block also reading its KV cache of ``--seq`` tokens; decoder-only models), and
torchplace's map is solved for it.

Measured with ``--gpu`` (:func:`measured_gpu`): GPT-2 small dispatched over cuda:0 and the host
under each map, time, peak GPU memory against the budget, logits and ``generate()`` tokens against
the model on the GPU. Measured without a GPU: only ``"cpu"`` and ``"disk"`` can be dispatched, so a
GPT-2 with real weights and a CPU budget of 1.25 x its weights (less than its weights, KV cache and
activations need together) is dispatched with accelerate's ``dispatch_model`` under torchplace's
map and under accelerate's ``sequential`` map, and one forward pass of the batch is timed (median
of repeats).
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplace.devices import Cluster, Device  # noqa: E402
from torchplace.hf import build_problem, evaluate_device_map, solve_device_map  # noqa: E402


def models(quick: bool):
    import transformers as tf

    layers = 6 if quick else 12
    return {
        "gpt2": (tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
                 tf.AutoModelForCausalLM),
        "llama": (tf.LlamaConfig(num_hidden_layers=layers, hidden_size=1024, intermediate_size=2816,
                                 num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
                  tf.AutoModelForCausalLM),
        "bert": (tf.BertConfig(num_hidden_layers=layers), tf.AutoModel),
        "t5": (tf.T5Config(num_layers=layers // 2, num_decoder_layers=layers // 2, d_model=512, d_ff=2048,
                           num_heads=8, d_kv=64), tf.AutoModelForSeq2SeqLM),
        "mixtral": (tf.MixtralConfig(num_hidden_layers=layers // 2, hidden_size=512, intermediate_size=1024,
                                     num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
                                     vocab_size=32000), tf.AutoModelForCausalLM),
    }


def meta(config, auto):
    with torch.device("meta"):
        return auto.from_config(config).eval()


def cluster(fast_first: bool) -> Cluster:
    kinds = ["cuda", "cuda-t4"] if fast_first else ["cuda-t4", "cuda"]
    devs = [Device(f"cuda:{i}", f"cuda:{i}", k) for i, k in enumerate(kinds)] + [Device("cpu", "cpu", "cpu")]
    return Cluster(tuple(devs))


def weight_bytes(model, itemsize: int) -> int:
    return sum(p.numel() for p in model.parameters()) * itemsize


def equal_split(model, problem) -> dict[str, int]:
    """Layers (no-split blocks) in equal numbers over the GPUs; the rest with its neighbour layer."""
    g = problem.graph
    order = g.topological_order()
    paths = g.meta["hf"]["modules"]
    no_split = set(model._no_split_modules or ())
    layers = [v for v in order if g.record(v).op.removeprefix("block:") in no_split]
    gpus = sorted(accel for accel in (d.name for d in problem.cluster.devices) if accel.startswith("cuda:"))
    where = {v: int(gpus[i * len(gpus) // len(layers)].split(":")[1]) for i, v in enumerate(layers)}
    current = where[layers[0]]
    for v in order:
        current = where.get(v, current)
        where.setdefault(v, current)
    for label in {g.record(v).colocation for v in order} - {None}:
        tied = [v for v in order if g.record(v).colocation == label]
        for v in tied:
            where[v] = where[tied[0]]
    return {paths[v]: where[v] for v in order if paths[v]}


def accelerate_maps(model, budget, dtype, headroom: int) -> dict[str, dict]:
    """accelerate's maps for ``budget``, and (``+room``) for ``budget`` less ``headroom`` bytes per
    GPU, as a user who knows about the KV cache and activations would ask."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    ns = model._no_split_modules or None
    roomy = {k: (max(v - headroom, 0) if isinstance(k, int) else v) for k, v in budget.items()}
    out = {}
    for suffix, mem in (("", budget), ("+room", roomy)):
        out["sequential" + suffix] = infer_auto_device_map(model, max_memory=dict(mem), no_split_module_classes=ns,
                                                           dtype=dtype)
        for name, low in (("balanced", False), ("balanced_low_0", True)):
            bal = get_balanced_memory(model, max_memory=dict(mem), no_split_module_classes=ns, dtype=dtype,
                                      low_zero=low)
            out[name + suffix] = infer_auto_device_map(model, max_memory=bal, no_split_module_classes=ns, dtype=dtype)
    return out


def predicted(args) -> list[dict]:
    rows = []
    dtype = torch.float16
    for name, (config, auto) in models(args.quick).items():
        model = meta(config, auto)
        if args.phase == "decode" and (model.config.is_encoder_decoder or not model.can_generate()):
            continue  # a generated token is a decoder-only model's step
        w = weight_bytes(model, dtype.itemsize)
        stored, peak, kv = need(model, args, dtype)
        # each GPU: room for the largest block's activations + 60% of the weights and KV cache of the
        # batch: the two GPUs hold the model, one does not; the host has room for everything
        gpu = peak + int(args.share * stored)
        budget = {0: gpu, 1: gpu, "cpu": 64 * 2**30}
        for fast_first in (True, False):
            label = "fast GPU 0" if fast_first else "slow GPU 0"
            problem = build_problem(model, budget, batch_size=args.batch, sequence_length=args.seq, dtype=dtype,
                                    cluster=cluster(fast_first), phase=args.phase)
            t0 = time.perf_counter()
            ours = solve_device_map(model, problem, time_limit=args.time_limit)
            solve_s = time.perf_counter() - t0
            maps = {"torchplace": ours.device_map, **accelerate_maps(model, budget, dtype, peak + kv // 2),
                    "equal layers": equal_split(model, problem)}
            costs = {k: evaluate_device_map(problem, m) for k, m in maps.items()}
            rows.append({"model": name, "cluster": label, "costs": costs, "solve_s": solve_s,
                         "status": f"{ours.plan.status} gap {ours.plan.gap:.0%}",
                         "bound": ours.plan.lower_bound, "weights": w, "costing": problem.graph.meta["hf"]["costs"]})
            print(_row(rows[-1], args.batch), flush=True)
    return rows


def need(model, args, dtype) -> tuple[int, int, int]:
    """(weights + KV cache of the batch, the largest block's activations, the KV cache) in bytes."""
    problem = build_problem(model, {"cpu": 2**50}, batch_size=args.batch, sequence_length=args.seq, dtype=dtype)
    stored = sum(r.param_bytes + r.temp_bytes for _, r in problem.graph.records())
    return stored, problem.graph.meta["hf"]["activations"], sum(problem.graph.meta["hf"]["kv_cache"].values())


ACCELERATE = ("sequential", "balanced", "balanced_low_0", "sequential+room", "balanced+room", "balanced_low_0+room")


def _row(r: dict, batch: int) -> str:
    c = r["costs"]
    cells = [f"{r['model']:<8} {r['cluster']:<11}"]
    for k in ("torchplace", *ACCELERATE, "equal layers"):
        cells.append(f"{c[k].seconds / batch * 1e3:8.3f}{'' if c[k].fits else '*':1}")
    ours = c["torchplace"].seconds
    fitting = [k for k in ACCELERATE if c[k].fits]
    best = min(fitting, key=lambda k: c[k].seconds, default=None)
    cells.append(f"{c[best].seconds / ours:6.2f}x {best:<19}" if best else f"{'   OOM':<27}")
    cells.append(f"{c['balanced'].seconds / ours:6.2f}x{'' if c['balanced'].fits else '*'}")
    cells.append(f"{c['equal layers'].seconds / ours:6.2f}x{'' if c['equal layers'].fits else '*'}")
    cells.append(f"{r['solve_s']:6.1f} {r['status']}")
    return " ".join(cells)


HEADER = ("model    cluster     torchplace sequential balanced  bal_low0   seq+room  bal+room  "
          "low0+room equal lay. vs best fitting accelerate  vs auto vs equal solve s, status")


def measured(args) -> list[tuple[str, float, bool, float, dict]]:
    """GPT-2 with real weights dispatched over cpu + disk with each map; median forward seconds."""
    import transformers as tf
    from accelerate import dispatch_model, infer_auto_device_map

    config = tf.GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=8000, n_positions=256)
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(config).eval()
    w = weight_bytes(base, 4)
    budget = {"cpu": w * 5 // 4, "disk": 4 * w}  # not the weights with the KV cache: some blocks stream from disk
    ids = torch.randint(0, 8000, (args.batch, 64))
    ours = solve_device_map(base, build_problem(base, budget, batch_size=args.batch, sequence_length=64),
                            time_limit=args.time_limit).device_map
    theirs = infer_auto_device_map(base, max_memory=dict(budget), no_split_module_classes=base._no_split_modules)
    problem = build_problem(base, budget, batch_size=args.batch, sequence_length=64)
    maps = {"torchplace": ours, "accelerate sequential": theirs}
    with torch.no_grad():
        expected = base(ids).logits
    with tempfile.TemporaryDirectory() as folder:
        models, times = {}, {k: [] for k in maps}
        for i, (label, device_map) in enumerate(maps.items()):
            model = tf.AutoModelForCausalLM.from_config(config).eval()
            model.load_state_dict(base.state_dict())
            models[label] = dispatch_model(model, device_map, offload_dir=os.path.join(folder, str(i)))
        with torch.no_grad():
            same = {k: bool(torch.equal(m(ids).logits, expected)) for k, m in models.items()}
            for _ in range(args.repeats):  # alternate the two, so load on a shared machine hits both alike
                for label, model in models.items():
                    t0 = time.perf_counter()
                    model(ids)
                    times[label].append(time.perf_counter() - t0)
    return [(k, statistics.median(times[k]), same[k], evaluate_device_map(problem, m).seconds, m)
            for k, m in maps.items()]


def measured_gpu(args, share: float) -> list[dict]:
    """GPT-2 small with real (random) weights, cuda:0 holding ``share`` of its weights and the host
    the rest (accelerate streams CPU-mapped weights to the GPU and computes there): each map
    dispatched with ``dispatch_model``. Per map: the time of one forward pass as ``generate()``
    runs its prefill (KV cache on, the last token's logits: what the maps are sized for), median and
    CUDA-synchronised; the peak the allocator saw during it (weights included) beside the budget and
    the cost model's prediction of that device's memory; full logits against the model wholly on
    cuda:0; greedy ``generate()`` tokens (KV cache on) against it too."""
    import transformers as tf
    from accelerate import dispatch_model, infer_auto_device_map

    from torchplace.errors import InfeasibleError

    config = tf.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                           bos_token_id=1, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_config(config).eval()
    w = weight_bytes(base, 4)
    budget = {0: int(share * w), "cpu": 4 * w}
    ids = torch.randint(0, config.vocab_size, (args.batch, args.gpu_seq))
    problem = build_problem(base, budget, batch_size=args.batch, sequence_length=args.gpu_seq)
    maps: dict[str, object] = {}
    try:
        maps["torchplace"] = solve_device_map(base, problem, time_limit=args.time_limit).device_map
    except InfeasibleError as e:
        maps["torchplace"] = f"refused: {e}"
    maps["accelerate sequential"] = infer_auto_device_map(base, max_memory=dict(budget),
                                                          no_split_module_classes=base._no_split_modules)
    whole = tf.AutoModelForCausalLM.from_config(config).eval()
    whole.load_state_dict(base.state_dict())
    whole = whole.to("cuda:0")
    gpu_ids = ids.to("cuda:0")
    prompt = gpu_ids[:2, :16]
    with torch.no_grad():
        expected = whole(gpu_ids).logits.cpu()
        tokens = whole.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)

    def timed(model) -> float:
        times = []
        with torch.no_grad():
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(gpu_ids, logits_to_keep=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = [{"map": "whole model on cuda:0 (no cap)", "seconds": timed(whole)}]
    del whole
    torch.cuda.empty_cache()
    for label, device_map in maps.items():
        if isinstance(device_map, str):
            rows.append({"map": label, "refused": device_map})
            continue
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(0)  # what earlier maps left behind: not this map's
        model = tf.AutoModelForCausalLM.from_config(config).eval()
        model.load_state_dict(base.state_dict())
        model = dispatch_model(model, device_map)
        with torch.no_grad():
            logits = model(gpu_ids).logits.cpu()
            out = model.generate(prompt, max_new_tokens=16, do_sample=False, use_cache=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        seconds = timed(model)
        cost = evaluate_device_map(problem, device_map)
        rows.append({"map": label, "seconds": seconds, "predicted": cost.seconds, "fits": cost.fits,
                     "predicted_gpu_bytes": cost.memory.get(0, 0),
                     "peak_gpu_bytes": torch.cuda.max_memory_allocated(0) - before,
                     "budget_gpu_bytes": budget[0], "max_abs_diff": float((logits - expected).abs().max()),
                     "generate_equal": bool(torch.equal(out.cpu(), tokens.cpu())),
                     "on_gpu": sum(1 for d in device_map.values() if d == 0), "entries": len(device_map)})
        del model, logits, out
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), cpu)
    except OSError:
        pass
    return f"nproc {os.cpu_count()}, {cpu}, torch {torch.__version__}"


def main() -> None:
    import logging

    # accelerate's get_max_memory warns for every GPU id of max_memory that this machine lacks
    logging.getLogger("accelerate.utils.modeling").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6-layer models instead of 12")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--measured-only", action="store_true", help="only the measured cpu + disk comparison")
    ap.add_argument("--phase", choices=["prefill", "decode"], default="prefill",
                    help="time of the forward pass of the batch, or of one generated token")
    ap.add_argument("--gpu", action="store_true", help="only the measured cuda:0 + host comparison (needs a GPU)")
    ap.add_argument("--gpu-share", type=float, nargs="+", default=[0.75, 1.0],
                    help="with --gpu: cuda:0's budgets, shares of the weights")
    ap.add_argument("--gpu-seq", type=int, default=256, help="with --gpu: tokens per sequence")
    ap.add_argument("--share", type=float, default=0.6,
                    help="each GPU's budget: this share of weights + KV cache, plus the largest block's activations")
    args = ap.parse_args()
    print(f"# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {machine()}")
    unit = "ms per generated token per sequence" if args.phase == "decode" else "ms per sample"
    print(f"# batch {args.batch}, sequence {args.seq}, float16 weights, phase {args.phase}; {unit} predicted by "
          "the cost model; * = does not fit the budget with the batch's activations and KV cache")
    if args.gpu:
        print(f"# measured on {torch.cuda.get_device_name(0)}: GPT-2 small (12 x 768) fp32, batch {args.batch} x "
              f"{args.gpu_seq}, a forward pass as generate() runs its prefill (KV cache, last token's logits); "
              "cuda:0's budget a share of the weights, the rest on the host (streamed to the GPU)")
        print("| cuda:0 budget | map | measured ms | predicted ms | entries on cuda:0 | fits (predicted) | "
              "GPU MiB predicted / peak / budget | max abs diff vs whole on GPU | generate() tokens equal |")
        print("|---|---|---|---|---|---|---|---|---|")
        for share in args.gpu_share:
            for r in measured_gpu(args, share):
                if "refused" in r:
                    print(f"| {share:g} x weights | {r['map']} | {r['refused']} |||||||", flush=True)
                elif "predicted" not in r:
                    print(f"| {share:g} x weights | {r['map']} | {r['seconds'] * 1e3:.1f} | - | all | - | - | - | - |")
                else:
                    mib = [r[k] / 2**20 for k in ("predicted_gpu_bytes", "peak_gpu_bytes", "budget_gpu_bytes")]
                    print(f"| {share:g} x weights | {r['map']} | {r['seconds'] * 1e3:.1f} | {r['predicted'] * 1e3:.1f} | "
                          f"{r['on_gpu']} of {r['entries']} | {r['fits']} | {mib[0]:.0f} / {mib[1]:.0f} / {mib[2]:.0f} | "
                          f"{r['max_abs_diff']:.2e} | {r['generate_equal']} |", flush=True)
        return
    if not args.measured_only:
        print(HEADER)
        predicted(args)
    if args.phase == "decode":
        return
    print("# measured on this machine: GPT-2 (6 x 256) dispatched over cpu (1.25 x the weights) + disk")
    for label, seconds, same, predicted_s, device_map in measured(args):
        print(f"{label:<22} measured {seconds * 1e3:8.1f} ms, predicted {predicted_s * 1e3:8.1f} ms per forward of "
              f"batch {args.batch}; logits equal: {same}; map {device_map}")


if __name__ == "__main__":
    main()
