"""Pipeline fidelity (issue 17): the predicted time of one call vs the measured one, and placed vs plain.

Run:  HF_HUB_OFFLINE=1 python benchmarks/pipeline_fidelity.py [--small] [--models ...] [--cpus 2 3]
      [--microbatches 1 4 8 16] [--runs 3] [--profiling fast|exhaustive]

For each model and each set of logical CPUs (``cpu:0``, ``cpu:1`` [, ``cpu:2``]) the model is placed
with default settings except ``allow_single_device=False`` (so the split itself is measured), then
for each ``m`` the call is predicted as ``place()`` predicts it (:func:`torchplace.callmodel.predict_call`
on the graph profiled at the micro-batch size, with the executor's measured overheads) and the
placed model is timed (median of ``--runs`` calls after one warm-up). Each row also gives the
steady-state prediction (the solver's max load), the whole model on one device as ``place()``
predicts it, what ``place()`` with default settings would run, and the plain model's measured call.
The summary line gives, over all rows, the Pearson correlation and median relative error of
predicted vs measured call time, and for ``m >= 8`` the measured share of predicted throughput.

Models: GPT-2 small and BERT-base (transformers configs, random weights, no download), a
Llama-style decoder (transformers' LlamaForCausalLM from a small config), and the two demo models
(``torchplace demo``: GPT-2 8 layers d=256, the residual CNN). ``--small``: the demo models at
their quick sizes, 2 CPUs, m = 1, 4, 8.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

import torchplace
from torchplace.callmodel import predict_call
from torchplace.callplan import decide
from torchplace.devices import kind_threads
from torchplace.profiling import profile
from torchplace.report.fidelity import pearson
from torchplace.runtime.microbatch import scatter
from torchplace.runtime.overhead import executor_overheads

BATCH = 16


def _gpt2_small(seq: int) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = GPT2LMHeadModel(GPT2Config(use_cache=False)).eval()  # 12 layers, d=768, 124M parameters
    ids = torch.randint(0, 50257, (BATCH, seq))
    return model, (ids,), {"granularity": "module", "leaf_modules": [GPT2Block]}


def _bert_base(seq: int) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from transformers import BertConfig, BertModel
    from transformers.models.bert.modeling_bert import BertLayer

    model = BertModel(BertConfig(attn_implementation="eager"), add_pooling_layer=False).eval()  # 12 x 768
    ids = torch.randint(0, 30522, (BATCH, seq))
    return model, (ids,), {"granularity": "module", "leaf_modules": [BertLayer]}


def _llama(seq: int) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, use_cache=False)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (BATCH, seq))
    return model, (ids,), {"granularity": "module", "leaf_modules": [LlamaDecoderLayer]}


def _demo(which: str, quick: bool) -> Callable[[int], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]:
    def build(seq: int) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
        from torchplace import demo

        case = (demo._gpt2 if which == "gpt2" else demo._resnet)(quick)
        return case.model, case.inputs, dict(case.options)

    return build


MODELS: dict[str, Callable[[int], tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]] = {
    "gpt2-small": _gpt2_small,
    "bert-base": _bert_base,
    "llama-style": _llama,
    "demo-gpt2": _demo("gpt2", False),
    "demo-cnn": _demo("cnn", False),
    "demo-gpt2-quick": _demo("gpt2", True),
    "demo-cnn-quick": _demo("cnn", True),
}


def _wall(fn: Callable[[], Any], runs: int) -> float:
    fn()
    walls = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def _rows(name: str, cpus: int, ms: list[int], runs: int, seq: int, share_cores: bool,
          profiling: str = "fast") -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, inputs, options = MODELS[name](seq)
    devices = [f"cpu:{i}" for i in range(cpus)]
    with torch.no_grad():
        plain = _wall(lambda: model(*inputs), runs)
    placed = torchplace.place(model, devices, inputs, progress=False, allow_single_device=False, time_limit=10,
                              share_cores=share_cores, profiling=profiling, **options)
    problem, plan, traced = placed.problem, placed.plan, placed._traced
    batch = inputs[0].shape[0]
    overheads = executor_overheads()
    graphs: dict[int, Any] = {1: None}

    def profiler(m: int) -> Any:
        chunk_args, chunk_kwargs = scatter(inputs, {}, m)[0]
        return profile(traced, chunk_args, chunk_kwargs, kinds=["cpu"], progress=False,
                       threads=kind_threads(problem.cluster), exhaustive=profiling == "exhaustive")

    # what place() with default settings runs: the same decision, single device allowed
    default = decide(problem, dataclasses.replace(plan, meta={}), "auto", batch, profiler, overheads=overheads)
    default_run = (f"{default.plan.stages[0].device} alone" if len({s.device for s in default.plan.stages}) == 1
                   else f"split, m={default.microbatches}")
    single_pred = (default.plan.meta.get("single_device") or {}).get("seconds", float("nan"))
    rows = []
    for m in ms:
        if m not in graphs:
            graphs[m] = profiler(m)
        call = predict_call(problem, plan.stages, m, microbatch_graph=graphs[m], overheads=overheads)
        placed.microbatches = m
        with torch.no_grad():
            measured = _wall(lambda: placed(*inputs), runs)
        rows.append({"model": name, "cpus": cpus, "m": m, "stages": len(plan.stages), "predicted": call.seconds,
                     "measured": measured, "steady": plan.objective, "plain": plain, "single": single_pred,
                     "default": default_run})
        r = rows[-1]
        print(f"| {name} | {cpus} | {m} | {r['stages']} | {1e3 * r['predicted']:.1f} | {1e3 * r['measured']:.1f} | "
              f"{100 * (r['measured'] - r['predicted']) / r['predicted']:+.1f}% | "
              f"{r['predicted'] / r['measured']:.2f} | {1e3 * r['steady']:.1f} | {1e3 * r['single']:.1f} | "
              f"{1e3 * r['plain']:.1f} | {r['plain'] / r['measured']:.2f} | {r['default']} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the demo models at quick sizes, 2 CPUs, m = 1, 4, 8")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--cpus", nargs="+", type=int)
    ap.add_argument("--microbatches", nargs="+", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence for the transformers models")
    ap.add_argument("--share-cores", action="store_true", help="place with share_cores=True (default: False)")
    ap.add_argument("--profiling", choices=["fast", "exhaustive"], default="fast", help="place()'s profiling")
    args = ap.parse_args()
    models = args.models or (["demo-gpt2-quick", "demo-cnn-quick"] if args.small else
                             ["demo-cnn", "demo-gpt2", "llama-style", "bert-base", "gpt2-small"])
    cpus = args.cpus or ([2] if args.small else [2, 3])
    ms = args.microbatches or ([1, 4, 8] if args.small else [1, 4, 8, 16])
    load = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, nproc {os.cpu_count()}, {cpu}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} intra-op threads, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"batch {BATCH}, seq {args.seq}, share_cores={args.share_cores}, executor overheads {executor_overheads()}\n")
    print("| model | CPUs | m | stages | predicted ms | measured ms | error | measured / predicted throughput | "
          "steady-state ms | one device predicted ms | plain model ms | plain / placed | place() default runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for name in models for c in cpus for r in _rows(name, c, ms, args.runs, args.seq, args.share_cores, args.profiling)]
    xs, ys = [r["predicted"] for r in rows], [r["measured"] for r in rows]
    errors = [abs(y - x) / x for x, y in zip(xs, ys)]
    high = [r["predicted"] / r["measured"] for r in rows if r["m"] >= 8]
    load = os.getloadavg()
    print(f"\n{len(rows)} calls: Pearson {pearson(xs, ys):.3f}, median |error| {100 * statistics.median(errors):.1f}%; "
          f"m >= 8: measured >= 90% of predicted throughput in {sum(h >= 0.9 for h in high)} of {len(high)} "
          f"(median {statistics.median(high) if high else float('nan'):.2f}); load average at the end "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
